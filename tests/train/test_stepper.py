"""The stepper protocol with a fake model step, no process group: each implementation forms one
result per step, with the ids its loader gave, its timings (the loader's and the step's apart,
read on a scripted clock) and, locally, the learning rate of each step set before it runs and
the state's size."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relaytrain.config import load_config
from relaytrain.config.sections import OptimSection
from relaytrain.data.loader import Batch
from relaytrain.parallel.reduce import ReduceStats
from relaytrain.train import stepper
from relaytrain.train.optim import build_optimizer, lr_at
from relaytrain.train.state import state_bytes
from relaytrain.train.step import PipelineStats, StepOutcome
from relaytrain.train.stepper import LocalStepper, PipelineStepper

pytestmark = pytest.mark.timeout(30)
CPU = torch.device("cpu")
LOAD_S, STEP_S = 2.0, 3.0  # what the fake loader and the fake step take on the clock


class Clock:
    """The stepper's `time`: the fakes move it on."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(stepper, "time", clock)
    return clock


class FakeLoader:
    """Global batch k holds instances 10k, 10k + 1 in one micro-batch; each takes LOAD_S."""

    def __init__(self, clock: Clock):
        self.clock = clock

    def get(self, k: int) -> Batch:
        self.clock.now += LOAD_S
        ids = np.array([10 * k, 10 * k + 1])
        return Batch(k, ids, np.zeros(2, dtype=np.int64), [(k, torch.zeros(2, 5))])


def outcome(k: int, pipeline: PipelineStats | None = None) -> StepOutcome:
    """A step's made-up outcome, told apart by the batch it trained (`k`)."""
    return StepOutcome(losses={k: (k + 0.5, k + 0.25, 0.25)}, grad_norm=float(k), finite=k != 3,
                       pipeline=pipeline, reduction=ReduceStats(100, 0.25, 0.5, 800))


def test_the_local_stepper_forms_a_result_per_step_with_its_ids_timings_and_size(
        monkeypatch, tmp_path, clock):
    cfg = load_config("configs/tiny.yaml", [f"run_dir={tmp_path}"])
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, OptimSection())
    seen = []

    def fake_step(model, optimizer, reducer, micro_batches, *args):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.state[model.weight] = {"exp_avg": torch.zeros(2, 3)}  # AdamW's, after a step
        clock.now += STEP_S
        return outcome(micro_batches[0][0])

    monkeypatch.setattr(stepper, "train_step", fake_step)
    state = SimpleNamespace(model=model, optimizer=optimizer, device=CPU)
    results = LocalStepper(state, None, FakeLoader(clock), cfg).run(3, 2)
    assert [r.step for r in results] == [3, 4]
    assert seen == [lr_at(s, cfg.optim, cfg.train.max_steps) for s in (3, 4)]
    for r, k in zip(results, (2, 3), strict=True):  # step s trains global batch s - 1
        assert (r.ids, r.losses, r.grad_norm, r.finite) == ([10 * k, 10 * k + 1],
                                                           outcome(k).losses, k, k != 3)
        assert (r.time_data, r.time_compute) == (LOAD_S, STEP_S)
        assert r.state_bytes == state_bytes(model, optimizer) == 2 * 4 * 8 + 4 * 6
        assert r.pipeline is None and r.written == []
        assert (r.time_fold, r.time_comm, r.wire_bytes_per_param) == (0.25, 0.5, 8.0)
        assert r.peak_rss > 0 or not os.path.exists("/proc/self/status")


def test_the_pipeline_stepper_runs_a_span_at_once_and_splits_its_timings(clock):
    stats = [PipelineStats(0.1, 0.01, 0.2, 1, 2, 100, 1, 0.01, 0.02, 0.0, [m, 0])
             for m in range(3)]
    spans = []

    class FakeRunner:
        def run_span(self, first, batches, history):
            spans.append((first, [b.batch_index for b in batches], history))
            clock.now += STEP_S
            return [outcome(b.batch_index, stats[i]) for i, b in enumerate(batches)]

        def evaluate(self, split, ids, part, parts):
            return {i: float(part + parts) for i in ids}

    pipeline = PipelineStepper(FakeRunner(), FakeLoader(clock), CPU)
    window = object()  # the skip rule's window (optim.skip_spikes), passed to the stage as is
    results = pipeline.run(1, 3, window)
    assert spans == [(1, [0, 1, 2], window)]
    assert [r.step for r in results] == [1, 2, 3]
    assert [r.ids for r in results] == [[0, 1], [10, 11], [20, 21]]
    assert [r.pipeline for r in results] == stats
    assert [(r.losses, r.grad_norm, r.finite) for r in results] == [
        (outcome(k).losses, k, k != 3) for k in range(3)]
    assert all((r.time_data, r.time_compute) == (LOAD_S, STEP_S / 3) for r in results)
    assert pipeline.evaluate(None, [7, 8], 1, 2) == {7: 3.0, 8: 3.0}
