"""What crosses between the controller and a worker, typed: one step's result and one
checkpoint write's report. Plain dataclasses of Python values, so every engine can carry them
(in process, or pickled between Ray actors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WriteReport:
    """A checkpoint part this worker finished writing in the background (or failed to)."""

    step: int
    part: str
    info: dict[str, Any] | None = None  # the part's files, as the manifest records them
    error: str | None = None  # set when the write failed; the step is then not committed


@dataclass
class StepResult:
    """One optimizer step as seen by one worker (one DP rank of one stage)."""

    step: int
    # global micro-batch index -> (total, ce, z) losses of the micro-batches this worker
    # computed the loss of (on a pipeline: only the last stage's workers)
    losses: dict[int, tuple[float, float, float]]
    grad_norm: float
    finite: bool
    ids: list[int]  # the instance ids this DP rank trained on
    time_data: float
    time_compute: float
    pipeline: dict[str, Any] | None = None  # pp > 1: the stage's schedule measurements
    # bytes of the parameters, their gradients and AdamW's moments this worker holds (its
    # shards under parallel.fsdp), and its process's peak resident bytes during the step
    # (Linux; 0 elsewhere); unpipelined steps
    state_bytes: int = 0
    peak_rss: int = 0
    # checkpoint writes that finished by the end of the call (on a call's last step only)
    written: list[WriteReport] = field(default_factory=list)
