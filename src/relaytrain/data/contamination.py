"""How much of a held-out set occurs in training, token for token: sampled held-out n-token
windows looked up in every training n-gram with a vectorised rolling hash (over the whole
training stream, or evenly spaced chunks of it past a budget). It catches contamination that
document hashes miss (near copies, shared passages), and works on token arrays that carry no
document text. `relaytrain data audit` reports it per evaluation set (data/audit.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from relaytrain.data.dataset import TokenSplit

NGRAM = 32
NGRAM_SAMPLES = 256
HASH_MULT = np.uint64(0x100000001B3)
NGRAM_SEED = 0x0DA7A1


def _ngram_hashes(windows: np.ndarray) -> np.ndarray:
    """Polynomial hash (mod 2**64) of each row of `windows`."""
    h = np.zeros(windows.shape[0], dtype=np.uint64)
    for j in range(windows.shape[1]):
        h = h * HASH_MULT + windows[:, j].astype(np.uint64)
    return h


def _chunk_starts(total: int, chunk: int, budget: int) -> Iterable[int]:
    starts = range(0, total, chunk)
    if total <= budget:
        return starts
    k = max(1, budget // chunk)
    return sorted({starts[i] for i in np.linspace(0, len(starts) - 1, k).astype(int)})


def ngram_overlap(train: TokenSplit, heldout: TokenSplit, *, n: int = NGRAM,
                  samples: int = NGRAM_SAMPLES, max_scan_tokens: int = 1 << 28,
                  chunk: int = 1 << 22) -> dict[str, Any]:
    """Share of sampled held-out n-token windows (inside one document, EOS excluded) that occur
    anywhere in the training stream (or its evenly spaced chunks above max_scan_tokens)."""
    spans = heldout.doc_spans()
    starts_per_doc = np.maximum(spans[:, 1] - 1 - n + 1, 0)  # windows that avoid the EOS
    total = int(starts_per_doc.sum())
    k = min(samples, total)
    result: dict[str, Any] = {"n": n, "sampled": k, "matched": 0, "overlap": 0.0,
                              "train_tokens_scanned": 0, "train_coverage": 0.0}
    if k == 0 or train.num_tokens < n:
        return result
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([NGRAM_SEED])))
    pick = np.sort(rng.choice(total, size=k, replace=False))
    cum = np.cumsum(starts_per_doc)
    docs = np.searchsorted(cum, pick, side="right")
    offsets = spans[docs, 0] + pick - (cum[docs] - starts_per_doc[docs])
    windows = np.asarray(heldout.tokens)[offsets[:, None] + np.arange(n)]
    qh = _ngram_hashes(windows)
    order = np.argsort(qh)
    qsorted = qh[order]
    matched: dict[int, int] = {}  # sample -> training position
    tokens = train.tokens
    T = train.num_tokens
    scanned = 0
    for s in _chunk_starts(T - n + 1, chunk, max_scan_tokens):
        seg = np.asarray(tokens[s:min(s + chunk + n - 1, T)], dtype=np.uint64)
        L = seg.size - n + 1
        h = np.zeros(L, dtype=np.uint64)
        for j in range(n):
            np.multiply(h, HASH_MULT, out=h)
            np.add(h, seg[j:j + L], out=h)
        scanned += L
        idx = np.searchsorted(qsorted, h).clip(max=k - 1)
        for p in np.flatnonzero(qsorted[idx] == h).tolist():
            lo = np.searchsorted(qsorted, h[p], side="left")
            hi = np.searchsorted(qsorted, h[p], side="right")
            for q in order[lo:hi].tolist():
                if q not in matched and np.array_equal(seg[p:p + n], windows[q]):
                    matched[q] = s + p
        if len(matched) == k:
            break
    result.update(matched=len(matched), overlap=len(matched) / k,
                  train_tokens_scanned=scanned, train_coverage=scanned / max(T - n + 1, 1))
    if matched:
        q = min(matched)
        result["first_match"] = {"heldout_document": int(docs[q]),
                                 "heldout_offset": int(offsets[q]),
                                 "train_offset": int(matched[q])}
    return result
