"""The held-out n-gram overlap on its own: the audit's contamination checks use it (test_audit.py
covers a contaminated corpus end to end)."""

from __future__ import annotations

from relaytrain.data.contamination import ngram_overlap
from relaytrain.data.dataset import TokenDataset


def test_the_clean_test_corpus_has_no_ngram_overlap(prepared):
    ds = TokenDataset.open(prepared)
    ngram = ngram_overlap(ds.split("train"), ds.split("heldout"))
    assert ngram["sampled"] > 0 and ngram["matched"] == 0
