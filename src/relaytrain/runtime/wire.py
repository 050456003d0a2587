"""What crosses between the controller and a worker, typed, named in one place: a worker's
process (each ping's answer) and what it joined a generation as (setup's), one step's result
(made by the worker's stepper, train/stepper.py, with a pipeline stage's measurements,
train/step.py), the window of earlier steps optim.skip_spikes compares a step with
(train/skip_step.py) and one checkpoint write's report (by its writes, checkpoint/writer.py).
Plain dataclasses and named tuples of Python values, so every engine can carry them (in
process, or pickled between Ray actors); the run's config crosses as the `RunConfig` it is
(config/sections.py).

A step's results cross a process boundary in a wire form of their own (`steps_to_wire`, read
back by `steps_from_wire`): every worker's result of every step reaches the controller, which
unpickles N of them a step, and a plain tuple of the fields' values unpickles with no class
looked up and no Python call (at 1,024 workers, about half the time of a class per result)."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterable, Iterator
from functools import partial
from operator import attrgetter
from typing import NamedTuple

from relaytrain.checkpoint.writer import WriteReport
from relaytrain.runtime.liveness import ProcessIdentity
from relaytrain.train.skip_step import SkipHistory
from relaytrain.train.step import PipelineStats
from relaytrain.train.stepper import StepResult

__all__ = ["PipelineStats", "ProcessIdentity", "SkipHistory", "Step", "StepResult", "StepView",
           "WorkerInfo", "WriteReport", "steps_from_wire", "steps_to_wire"]

_STEP_FIELDS = tuple(StepResult.__dataclass_fields__)
# A step's result as the controller reads it off the wire: a named tuple of `StepResult`'s
# fields, read by the same names, made from the plain tuple without a Python call per result
StepView = namedtuple("StepView", _STEP_FIELDS)
Step = StepResult | StepView  # what the controller's readers (runtime/reporter.py) take
_values = attrgetter(*_STEP_FIELDS)
_views = partial(map, partial(tuple.__new__, StepView))  # one worker's results read


def steps_to_wire(results: list[StepResult]) -> list[tuple]:
    """A worker's results as an engine that pickles them sends them: plain tuples."""
    return list(map(_values, results))


def steps_from_wire(answers: Iterable[list[tuple]]) -> Iterator[list[StepView]]:
    """Each worker's results as `steps_to_wire` sent them, read by the names of `StepResult`'s
    fields: worker by worker, as the iterator is taken, with no Python call per worker (one
    cost the controller ~0.3 ms a step at 1,024 workers)."""
    return map(list, map(_views, answers))


class WorkerInfo(NamedTuple):
    """A worker as it joined a generation: its process, host and device (a named tuple, as
    `ProcessIdentity`: every worker sends one at every generation)."""

    process: ProcessIdentity
    host: str
    device: str
