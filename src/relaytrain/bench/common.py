"""What several benchmarks share: a prepared slice of the demo corpus, the rate a training
step consumes tokens, and running a training config to completion."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from relaytrain.config import load_config
from relaytrain.data.prepare import prepare

if TYPE_CHECKING:
    from relaytrain.runtime.summary import RunSummary


def demo_data(directory: str | Path, max_docs: int = 300, vocab: int = 2048) -> str:
    """A prepared slice of the demo corpus (the running Python's standard library)."""
    out = Path(directory) / "data"
    prepare(None, out, f"bpe:{vocab}", max_docs=max_docs, progress=False)
    return str(out)


def train_tokens_per_s(preset: str, vocab: int, seq_len: int, global_batch: int,
                       micro_batch: int, steps: int = 5, threads: int = 2) -> float:
    """Tokens per second one training step consumes (our step, fp32 CPU, after a warm-up)."""
    from relaytrain.model.init import init_weights
    from relaytrain.model.olmo3 import Olmo3
    from relaytrain.parallel.reduce import GradReducer
    from relaytrain.train.optim import build_optimizer
    from relaytrain.train.step import train_step

    torch.set_num_threads(threads)
    cfg = load_config(None, [f"model.preset={preset}", f"train.global_batch={global_batch}",
                             f"train.micro_batch={micro_batch}"])
    model_cfg = cfg.model_config(vocab)
    model = Olmo3(model_cfg)
    init_weights(model, 0)
    opt = build_optimizer(model, cfg.optim)
    m = global_batch // micro_batch
    red = GradReducer(list(model.parameters()), None, exact=False, total_micro_batches=m)
    gen = torch.Generator().manual_seed(0)
    mbs = [(j, torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen))
           for j in range(m)]
    device = torch.device("cpu")
    train_step(model, opt, red, mbs, m, 1e-5, 1.0, device)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(model, opt, red, mbs, m, 1e-5, 1.0, device)
    return steps * global_batch * seq_len / (time.perf_counter() - t0)


TINY_RUN = ["model.preset=tiny", "data.seq_len=32", "train.global_batch=12",
            "train.micro_batch=1", "optim.lr=3e-3", "optim.warmup=5", "eval.every=0",
            "checkpoint.every=0", "log.progress=false"]


def run_training(overrides: list[str]) -> RunSummary:
    """Run a tiny-preset training job with `overrides`, its progress bar on stderr; the
    controller's summary."""
    from relaytrain.runtime.controller import Controller

    return Controller(load_config(None, [*TINY_RUN, *overrides, "log.progress=true"])).run()
