"""What crosses between the controller and a worker, typed, named in one place: one step's
result (made by the worker's stepper, train/stepper.py) and one checkpoint write's report (by
its writes, checkpoint/writer.py). Plain dataclasses of Python values, so every engine can carry
them (in process, or pickled between Ray actors)."""

from __future__ import annotations

from relaytrain.checkpoint.writer import WriteReport
from relaytrain.train.stepper import StepResult

__all__ = ["StepResult", "WriteReport"]
