"""A worker's optimizer steps over a span, through one protocol (`Stepper`) with two
implementations: an unpipelined replica (`LocalStepper`: each step's batch from the loader, one
`train_step`) and a pipeline stage (`PipelineStepper`: the span's batches through the stage
executor, train/pipeline_stage.py). Both form their steps' results (`StepResult`, what the
controller receives) by the one `step_result`, and evaluate through the same path they step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from relaytrain.checkpoint.writer import WriteReport
from relaytrain.config.sections import RunConfig
from relaytrain.data.loader import Loader
from relaytrain.parallel.context import ContextGroup, ContextSplit
from relaytrain.parallel.groups import PipelineGroups
from relaytrain.parallel.reduce import GradReducer, ReduceStats
from relaytrain.train.evaluate import heldout_losses
from relaytrain.train.metrics import proc_bytes
from relaytrain.train.optim import lr_at, set_lr
from relaytrain.train.pipeline_stage import StageRunner, StageSpec, Transport
from relaytrain.train.skip_step import SkipCheck, SkipHistory, SkipRule
from relaytrain.train.state import TrainState, state_bytes
from relaytrain.train.step import PipelineStats, StepOutcome, train_step

if TYPE_CHECKING:  # imported only by workers that shard (parallel/shards.py says why)
    from relaytrain.parallel.fsdp import ShardedGradReducer


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
    pipeline: PipelineStats | None = None  # pp > 1: the stage's schedule measurements
    skipped: bool = False  # optim.skip_spikes held the update back (its data still consumed)
    # bytes of the parameters, their gradients and AdamW's moments this worker holds (its
    # shards under parallel.fsdp), and its process's peak resident bytes during the step
    # (Linux; 0 elsewhere); unpipelined steps
    state_bytes: int = 0
    peak_rss: int = 0
    # the gradient reduction's share of the step (parallel/reduce.py's `ReduceStats`): seconds
    # folding and converting, seconds in collectives, bytes reduced per parameter; unpipelined
    time_fold: float = 0.0
    time_comm: float = 0.0
    wire_bytes_per_param: float = 0.0
    # checkpoint writes that finished by the end of the call (on a call's last step only)
    written: list[WriteReport] = field(default_factory=list)


def step_result(step: int, out: StepOutcome, ids: list[int], time_data: float,
                time_compute: float) -> StepResult:
    """The one place a step's result is formed, for plain and pipelined steps alike."""
    red = out.reduction or ReduceStats()
    return StepResult(step=step, losses=out.losses, grad_norm=out.grad_norm, finite=out.finite,
                      ids=ids, time_data=time_data, time_compute=time_compute,
                      pipeline=out.pipeline, skipped=out.skipped, time_fold=red.fold_s,
                      time_comm=red.comm_s,
                      wire_bytes_per_param=red.wire_bytes / max(1, red.params))


class Stepper(Protocol):
    """Trains steps and evaluates on the model as this worker holds it."""

    def run(self, first: int, count: int, history: SkipHistory | None = None
            ) -> list[StepResult]:
        """Optimizer steps first .. first+count-1 (1-based; step k trains global batch k-1),
        one result per step. A span ends drained: its end is a consistent cut. `history`: the
        steps before `first` as optim.skip_spikes compares them (train/skip_step.py)."""

    def evaluate(self, split: Any, ids: list[int], part: int, parts: int) -> dict[int, float]:
        """Per-instance held-out loss of chunk share `part` of `parts` of `ids` (those this
        worker computes the loss of; {} on a pipeline's other stages)."""


def reset_peak_rss() -> None:
    """Start the process's peak resident size (VmHWM) afresh (Linux; elsewhere nothing)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    """The process's peak resident bytes since `reset_peak_rss` (0 where /proc is missing)."""
    return proc_bytes("/proc/self/status", "VmHWM") or 0


def synced_since(t: float, device: torch.device) -> float:
    """Seconds since `t`, once the device has finished the work queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


class LocalStepper:
    """An unpipelined replica's steps: each one's batch from the loader, one `train_step`,
    with the state's size and the process's peak resident memory measured."""

    def __init__(self, state: TrainState, reducer: GradReducer | ShardedGradReducer,
                 loader: Loader, cfg: RunConfig, context: ContextGroup | None = None):
        self.state, self.reducer, self.loader, self.cfg = state, reducer, loader, cfg
        self.context = context  # parallel.cp: this rank's part of every sequence
        self.rule = SkipRule.from_config(cfg)
        self._state_bytes: int | None = None  # measured after the first step

    def run(self, first: int, count: int, history: SkipHistory | None = None
            ) -> list[StepResult]:
        check = None if self.rule is None else SkipCheck(self.rule, history or SkipHistory())
        return [self._step(step, check) for step in range(first, first + count)]

    def _step(self, step: int, check: SkipCheck | None) -> StepResult:
        model, optimizer, device = self.state.model, self.state.optimizer, self.state.device
        reset_peak_rss()
        t0 = time.perf_counter()
        batch = self.loader.get(step - 1 + self.cfg.batch_offset)
        t1 = time.perf_counter()
        set_lr(optimizer, lr_at(step, self.cfg.optim, self.cfg.train.max_steps))
        model.train()
        out = train_step(model, optimizer, self.reducer, batch.micro_batches,
                         self.cfg.micro_batches, self.cfg.train.z_loss, self.cfg.train.clip,
                         device, check, batch.documents, self.cfg.document_masking,
                         self.context)
        result = step_result(step, out, batch.ids.tolist(), t1 - t0, synced_since(t1, device))
        if self._state_bytes is None:  # fixed for a generation once AdamW's state exists
            self._state_bytes = state_bytes(model, optimizer)
        result.state_bytes = self._state_bytes
        result.peak_rss = peak_rss()
        return result

    def evaluate(self, split: Any, ids: list[int], part: int, parts: int) -> dict[int, float]:
        return heldout_losses(self.state.model, split, ids, self.cfg.seq_len,
                              self.cfg.train.micro_batch, self.state.device, part, parts)


class PipelineStepper:
    """A pipeline stage's steps: a span's batches through the stage executor at once (one step
    for flush schedules), timings split evenly over the span's steps."""

    def __init__(self, runner: StageRunner, loader: Loader, device: torch.device,
                 batch_offset: int = 0):
        self.runner, self.loader, self.device = runner, loader, device
        self.batch_offset = batch_offset  # RunConfig.batch_offset

    def run(self, first: int, count: int, history: SkipHistory | None = None
            ) -> list[StepResult]:
        t0 = time.perf_counter()
        batches = [self.loader.get(step - 1 + self.batch_offset)
                   for step in range(first, first + count)]
        t1 = time.perf_counter()
        outs = self.runner.run_span(first, batches, history)
        compute = synced_since(t1, self.device)
        return [step_result(first + i, out, batch.ids.tolist(), (t1 - t0) / count,
                            compute / count)
                for i, (out, batch) in enumerate(zip(outs, batches, strict=True))]

    def evaluate(self, split: Any, ids: list[int], part: int, parts: int) -> dict[int, float]:
        return self.runner.evaluate(split, ids, part, parts)


def make_reducer(cfg: RunConfig, state: TrainState, group: dist.ProcessGroup | None,
                 replica_group: dist.ProcessGroup | None, dp: int
                 ) -> GradReducer | ShardedGradReducer:
    """The reduction of the state's gradients over its data-parallel `group` (sharded: the
    shards' reduce-scatter, over a replica's fsdp x cp ranks, then over the `replica_group`
    holding the same shard)."""
    exact = cfg.determinism == "exact"
    params = list(state.model.parameters())
    # every micro-batch's gradient arrives in cp parts, each summed by the reducer (sharded:
    # over dp x cp ranks, each folding its own micro-batches' parts)
    cp = cfg.parallel.cp
    micro_batches = cfg.micro_batches * cp
    if state.sharded:
        from relaytrain.parallel.fsdp import ShardedGradReducer  # parallel/shards.py: why

        return ShardedGradReducer(state.units, params, group, replica_group, exact,
                                  micro_batches, dp * cp)
    return GradReducer(params, group, exact=exact, total_micro_batches=micro_batches)


def make_stepper(cfg: RunConfig, state: TrainState, reducer: GradReducer | ShardedGradReducer,
                 loader: Loader, groups: PipelineGroups | None, dp: int,
                 cp: tuple[int, dist.ProcessGroup] | None = None) -> Stepper:
    """The local stepper, or with pipeline `groups` (pp > 1) that of the state's stage, in a
    generation of `dp` DP ranks per stage; with `cp` (this rank's cp rank and its cp group)
    either trains its part of every sequence."""
    context = None if cp is None else ContextGroup(
        ContextSplit(cfg.seq_len, cfg.parallel.cp, cp[0]), cp[1], cfg.determinism == "exact")
    if groups is None:
        return LocalStepper(state, reducer, loader, cfg, context)
    spec = StageSpec.from_config(cfg, state.layout[0], state.model_cfg.d_model, dp)
    runner = StageRunner(state.model, state.optimizer, reducer, spec, Transport(state.device),
                         groups.prev, groups.next, groups.pipe,
                         lambda step: lr_at(step, cfg.optim, cfg.train.max_steps),
                         state.device, sharded=state.sharded, wrap=groups.wrap,
                         context=context)
    return PipelineStepper(runner, loader, state.device, cfg.batch_offset)
