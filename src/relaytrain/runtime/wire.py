"""What crosses between the controller and a worker, typed, named in one place: a worker's
process (each ping's answer) and what it joined a generation as (setup's), one step's result
(made by the worker's stepper, train/stepper.py, with a pipeline stage's measurements,
train/step.py), the window of earlier steps optim.skip_spikes compares a step with
(train/skip_step.py) and one checkpoint write's report (by its writes, checkpoint/writer.py).
Plain dataclasses and named tuples of Python values, so every engine can carry them (in
process, or pickled between Ray actors); the run's config crosses as the `RunConfig` it is
(config/sections.py)."""

from __future__ import annotations

from typing import NamedTuple

from relaytrain.checkpoint.writer import WriteReport
from relaytrain.runtime.liveness import ProcessIdentity
from relaytrain.train.skip_step import SkipHistory
from relaytrain.train.step import PipelineStats
from relaytrain.train.stepper import StepResult

__all__ = ["PipelineStats", "ProcessIdentity", "SkipHistory", "StepResult", "WorkerInfo",
           "WriteReport"]


class WorkerInfo(NamedTuple):
    """A worker as it joined a generation: its process, host and device (a named tuple, as
    `ProcessIdentity`: every worker sends one at every generation)."""

    process: ProcessIdentity
    host: str
    device: str
