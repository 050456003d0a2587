"""How fast the loader serves batches (to compare with the rate a training step consumes
them), from a prepared directory or the same tokens as an OLMo-core mix; self-contained: it
prepares into a temporary directory and removes it. The prepare benchmark is bench/prepare.py."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from relaytrain.bench import progress
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.loader import Loader
from relaytrain.data.mix_index import index_mix
from relaytrain.data.prepare import prepare
from relaytrain.data.token_arrays import MixFile


def _as_olmo_mix(prepared: Path, out: Path, files: int = 4) -> Path:
    """The prepared training split cut at document ends into `files` OLMo-core token files,
    indexed in place: an OLMo-format mix of the same tokens."""
    split = TokenDataset.open(prepared).split("train")
    ends = split.doc_spans().sum(axis=1)
    cuts = [0, *(int(ends[len(ends) * (i + 1) // files - 1]) for i in range(files))]
    mix = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        np.asarray(split.tokens[a:b]).tofile(out / f"part-{i}.npy")
        mix.append(MixFile("bench", str(out / f"part-{i}.npy")))
    ds = TokenDataset.open(prepared)
    index_mix({"train": mix}, out / "index", vocab_size=ds.vocab_size, eos_id=ds.eos_id,
              dtype=ds.dtype)
    return out / "index"


def bench_loader(quick: bool = False, seq_len: int = 256, global_batch: int = 16,
                 micro_batch: int = 4, order: str = "relay") -> dict[str, float]:
    """Batches served by `Loader.get` in sequence (the read-ahead thread running), for a
    `small`-like shape, plus the synchronous cost of building one batch. order "olmo-core"
    reads the same tokens as an OLMo-core mix of 4 files, in OLMo-core's order."""
    max_docs, batches = (200, 300) if quick else (None, 3000)
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        data = Path(tmp) / "data"
        progress.report("loader: preparing data")
        prepare(None, data, "bpe:1024", max_docs=max_docs)
        if order == "olmo-core":
            data = _as_olmo_mix(data, Path(tmp))
        progress.report(f"loader: {batches} batches served, {batches} built")
        split = TokenDataset.open(data).split("train")
        n = split.num_instances(seq_len)
        with Loader(split, seq_len, 0, global_batch, micro_batch, 0, 1, order=order) as loader:
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
    return {"order": order, "seq_len": seq_len, "global_batch": global_batch, "instances": n,
            "batches": batches, "epochs": 2 * batches * global_batch / n,
            "tokens_per_s": tokens / served, "batches_per_s": batches / served,
            "make_ms": 1e3 * built / batches, "sync_tokens_per_s": tokens / built}
