"""Data benchmarks: prepare throughput on the demo corpus, and how fast the loader serves
batches (to compare with the rate a training step consumes them).

Both are self-contained: they prepare into a temporary directory and remove it.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from relaytrain.bench import progress
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.loader import Loader
from relaytrain.data.prepare import prepare

DEMO_VOCAB = 8192  # ~8.6M tokens from CPython 3.11's standard library


def bench_prepare(quick: bool = False) -> dict[str, float]:
    """Demo corpus -> token files with a freshly trained byte-level BPE."""
    max_docs, vocab = (200, 2048) if quick else (None, DEMO_VOCAB)
    progress.start("prepare", f"one preparation of the demo corpus ({max_docs or 'all'} "
                   f"documents, BPE {vocab})")
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        r = prepare(None, Path(tmp) / "data", f"bpe:{vocab}", max_docs=max_docs)
    tokens = sum(r.tokens.values())
    encode_s = r.seconds - r.tokenizer_seconds
    return {"documents": sum(r.documents.values()), "tokens": tokens, "vocab": r.vocab_size,
            "seconds": r.seconds, "bpe_seconds": r.tokenizer_seconds,
            "tokens_per_s": r.tokens_per_s, "encode_tokens_per_s": tokens / max(encode_s, 1e-9)}


def bench_loader(quick: bool = False, seq_len: int = 256, global_batch: int = 16,
                 micro_batch: int = 4) -> dict[str, float]:
    """Batches served by `Loader.get` in sequence (the read-ahead thread running), for a
    `small`-like shape, plus the synchronous cost of building one batch."""
    max_docs, batches = (200, 300) if quick else (None, 3000)
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        progress.report("loader: preparing data")
        prepare(None, Path(tmp) / "data", "bpe:1024", max_docs=max_docs)
        progress.report(f"loader: {batches} batches served, {batches} built")
        split = TokenDataset.open(Path(tmp) / "data").split("train")
        n = split.num_instances(seq_len)
        with Loader(split, seq_len, 0, global_batch, micro_batch, 0, 1) as loader:
            loader.get(0)  # start the thread and compute the first epoch's permutation
            t = time.perf_counter()
            for k in range(1, batches + 1):
                loader.get(k)
            served = time.perf_counter() - t
            t = time.perf_counter()
            for k in range(batches + 1, 2 * batches + 1):
                loader.make(k)
            built = time.perf_counter() - t
    tokens = batches * global_batch * seq_len
    return {"seq_len": seq_len, "global_batch": global_batch, "instances": n,
            "batches": batches, "epochs": 2 * batches * global_batch / n,
            "tokens_per_s": tokens / served, "batches_per_s": batches / served,
            "make_ms": 1e3 * built / batches, "sync_tokens_per_s": tokens / built}
