"""What a run reports when it ends (`Controller.run`): read by `relaytrain train` (its `--json`
line is `to_dict()`), by the recovery and GPU benchmarks and by the tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from relaytrain.model.backend_choice import Choice


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    steps: int  # train.max_steps, reached
    resumed_from: int  # the checkpoint's step (0: a fresh run)
    final_loss: float | None
    final_heldout_loss: float  # nan without held-out evaluation
    checkpoint_step: int  # the last committed checkpoint
    setup_s: float  # from `run()` to the first step: run directory, engine, workers
    peak_flops: float  # of all workers together, for MFU
    peak_source: str
    matmul: Choice  # the backends `auto` chose (or the config gave), and why
    kernels: Choice
    attention: Choice
    recoveries: list[dict[str, Any]]  # the recovery records, as in metrics.jsonl
    goodput: float  # productive seconds over wall seconds
    wall_s: float
    dp: int  # data-parallel ranks at the end
    generation: int  # the worker group's generation (0: the first group)
    pids: dict[int, int]  # worker -> process id at the end
    initial_pids: dict[int, int]  # ... and at the start
    metrics: str  # the metrics.jsonl path
    checkpoints: str  # the checkpoint store's URL

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (each backend's `Choice` as a dict), in field order."""
        return dataclasses.asdict(self)
