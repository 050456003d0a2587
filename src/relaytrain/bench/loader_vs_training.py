"""`relaytrain bench loader`: the loader's throughput next to the rate a training step of the
same shape consumes tokens on this machine (target: the loader >= 50x faster)."""

from __future__ import annotations

from typing import Any

from relaytrain.bench import progress
from relaytrain.bench.common import train_tokens_per_s
from relaytrain.bench.data import bench_loader


def bench_loader_vs_training(quick: bool = False) -> dict[str, Any]:
    shape = {"seq_len": 256, "global_batch": 16, "micro_batch": 4}
    steps = 2 if quick else 5
    progress.start("loader", f"the loader ({'300' if quick else '3,000'} batches, once), then "
                   f"{steps} training steps")
    loader = bench_loader(quick, **shape)
    olmo = bench_loader(quick, **shape, order="olmo-core")
    progress.report("training steps")
    training = train_tokens_per_s("small", 1024, **shape, steps=steps)
    return {"loader": loader, "loader_olmo_core": olmo, "training_tokens_per_s": training,
            "loader_over_training": loader["tokens_per_s"] / training,
            "olmo_core_loader_over_training": olmo["tokens_per_s"] / training, "target": 50.0}


def format_report(r: dict[str, Any]) -> str:
    lines = [f"loader, {name}: {r[key]['tokens_per_s']:,.0f} tokens/s ({r[key]['make_ms']:.2f} "
             f"ms to build a batch without read-ahead), {r[ratio]:,.0f}x training "
             f"(target >= {r['target']:.0f}x)"
             for name, key, ratio in (
                 ("prepared data, relay order", "loader", "loader_over_training"),
                 ("OLMo-core mix (4 files), olmo-core order", "loader_olmo_core",
                  "olmo_core_loader_over_training"))]
    return "\n".join([*lines, f"training step (small preset, same shape): "
                                f"{r['training_tokens_per_s']:,.0f} tokens/s"])
