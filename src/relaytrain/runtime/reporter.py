"""The step reporter: everything the run directory records about training as it goes.

It turns the workers' `StepResult`s (or the `StepView`s of their wire form, read alike) into
one step record (metrics.jsonl, TensorBoard, the progress bar), the data ledger's lines (which
ids each DP rank trained on, restarts, rollbacks), the loss-spike and memorisation alarms, and
the held-out evaluation record. It decides nothing about workers; the controller tells it what
happened.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable
from itertools import chain
from operator import attrgetter
from typing import Any

from relaytrain.config.sections import RunConfig
from relaytrain.data.eval_sets import OWN_EVAL_SET, absolute_paths
from relaytrain.data.ledger import (
    LedgerWriter,
    header_record,
    read_ledger,
    rollback_record,
    step_record,
)
from relaytrain.errors import warn
from relaytrain.parallel.groups import Placement
from relaytrain.runtime.wire import Step
from relaytrain.train.evaluate import mean_loss
from relaytrain.train.metrics import MemorisationAlarm, MetricsLog, SpikeDetector, TensorBoard
from relaytrain.train.optim import lr_at


class TrainingStopped(Exception):
    """The run stopped on purpose (divergence, memorisation alarm with stop_on_alarm)."""


# The fields a step's record takes the slowest worker's value of (the gradient reduction's
# only where steps are unpipelined: a pipeline's schedule measures its own)
_SLOWEST = ("time_data", "time_compute", "state_bytes", "peak_rss")
_REDUCTION = ("time_fold", "time_comm", "wire_bytes_per_param")
_losses, _finite, _ids = attrgetter("losses"), attrgetter("finite"), attrgetter("ids")


def combine(step: int, results: dict[int, Step], placements: dict[int, Placement],
            cfg: RunConfig) -> dict[str, Any]:
    """One step's record from every worker's result. The loss is summed over micro-batches in
    index order, so the number does not depend on how micro-batches were split over ranks.
    One pass over the results per field, in C where it can be (at 1,024 workers this runs
    every step on the controller)."""
    values = results.values()
    losses = dict(chain.from_iterable(map(dict.items, map(_losses, values))))
    m = cfg.micro_batches
    total, ce, z = zip(*map(losses.__getitem__, range(m)), strict=True)
    last = cfg.parallel.pp - 1
    last_stage = min(placements) if last == 0 else \
        min(w for w, p in placements.items() if p.stage == last)
    keys = _SLOWEST + (_REDUCTION if cfg.parallel.pp == 1 else ())
    slowest = map(max, zip(*map(attrgetter(*keys), values), strict=True))
    record = {"loss": math.fsum(total) / m, "ce_loss": math.fsum(ce) / m,
              "z_loss": math.fsum(z) / m, "grad_norm": results[last_stage].grad_norm,
              "lr": lr_at(step, cfg.optim, cfg.train.max_steps),
              **dict(zip(keys, slowest, strict=True))}
    if cfg.optim.skip_spikes:  # every rank decided alike, from the same global values
        record["skipped"] = results[last_stage].skipped
    if cfg.parallel.pp > 1:  # every stage's schedule measurements (its DP rank 0's)
        record["pipeline"] = {str(p.stage): dataclasses.asdict(results[w].pipeline)
                              for w, p in placements.items() if p.dp_rank == 0}
    return record


def first_stage(placements: dict[int, Placement]) -> list[int]:
    """The first stage's workers in DP-rank order: those whose ids the ledger records."""
    workers = {p.dp_rank: w for w, p in placements.items() if p.stage == 0}
    return [workers[i] for i in range(len(workers))]


def ledger_parts(results: dict[int, Step], order: list[int]) -> list[list[int]]:
    """The ids each DP rank trained on, read from the first stage's workers in DP-rank order
    (`first_stage`)."""
    return list(map(_ids, map(results.__getitem__, order)))


class StepReporter:
    def __init__(self, cfg: RunConfig, fingerprint: str, n_instances: int, quiet: bool,
                 last_checkpoint: Callable[[], int]):
        self.cfg = cfg
        # the newest committed step: a diverged run's message, the unsaved steps on the bar
        self.last_checkpoint = last_checkpoint
        self.fingerprint = fingerprint
        self.n_instances = n_instances
        self.quiet = quiet
        self.tokens_per_step = cfg.train.global_batch * cfg.seq_len
        self.spikes = SpikeDetector(cfg.train.spike_factor)
        self.alarms: dict[str, MemorisationAlarm] = {}  # one per evaluation set
        self.recent_losses: list[float] = []
        self.last: dict[str, Any] = {"loss": math.nan}
        self.heldout = math.nan
        self.productive_s = 0.0
        self.flops_per_token = 0.0
        self.peak_flops = 0.0
        self.metrics: MetricsLog | None = None
        self.ledger: LedgerWriter | None = None
        self.tensorboard: TensorBoard | None = None
        self.bar: Any = None
        self.failed_save = 0  # the step of the newest save that failed (0: none)
        # the layout the ledger's order of workers was found for, and that order (asked every
        # step; the same layout is the same dict: runtime/recovery.py `placements`)
        self._first: tuple[dict[int, Placement], list[int]] | None = None

    # ---- the run's files -------------------------------------------------------------------
    def open(self, start: int, dp: int) -> None:
        """Open the run's records at `start`: ledger lines past it (a run killed before its
        next checkpoint) are rolled back, and the order parameters written again."""
        cfg = self.cfg
        self.metrics = MetricsLog(os.path.join(cfg.run_dir, "metrics.jsonl"))
        if cfg.log.tensorboard:
            self.tensorboard = TensorBoard(os.path.join(cfg.run_dir, "tensorboard"))
        path = os.path.join(cfg.run_dir, "ledger.jsonl")
        ledger_last = _ledger_last_step(path)
        self.ledger = LedgerWriter(cfg.run_dir)
        if ledger_last > start:
            self.rollback(range(start + 1, ledger_last + 1), start)
        self.header(start, dp)
        if start > self.cfg.start_step:
            self.metrics.write("restart", step=start)

    def start_progress(self, start: int, flops_per_token: float, peak_flops: float) -> None:
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        if self.cfg.log.progress and not self.quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=self.cfg.train.max_steps, initial=start, unit="step",
                            dynamic_ncols=True, file=sys.stderr, desc="train")

    def close(self) -> None:
        for part in (self.bar, self.metrics, self.ledger, self.tensorboard):
            if part is not None:
                part.close()

    def header(self, step: int, dp: int) -> None:
        """At every start, resume and resize: the facts the audit recomputes the order from."""
        cfg = self.cfg
        self.ledger.write(header_record(
            seed=cfg.seed, data_seed=cfg.data_seed, global_batch=cfg.train.global_batch,
            micro_batch=cfg.train.micro_batch, seq_len=cfg.seq_len, n_instances=self.n_instances,
            fingerprint=self.fingerprint, data_path=os.path.abspath(cfg.data.path), dp=dp,
            order=cfg.data.order, eval_sets=absolute_paths(cfg.eval.sets), init=cfg.init.origin,
            packing=cfg.packing))

    def rollback(self, steps: range, to_step: int) -> None:
        """Steps whose updates a restore discarded: their data counts as unconsumed."""
        if len(steps):
            self.ledger.write(rollback_record(steps, to_step))

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        return self.metrics.write(kind, **fields)

    # ---- steps -----------------------------------------------------------------------------
    def check(self, first: int, per_step: list[dict[int, Step]],
              placements: dict[int, Placement]) -> list[dict[str, Any]]:
        """The records of steps first, first+1, ... (each: every worker's result). A
        non-finite step stops the run here, before it is checkpointed or recorded."""
        records = [combine(first + i, per, placements, self.cfg)
                   for i, per in enumerate(per_step)]
        for i, per in enumerate(per_step):
            if not all(map(_finite, per.values())):
                self._diverged(first + i, records[i], per, placements)
        return records

    def steps(self, first: int, per_step: list[dict[int, Step]],
              records: list[dict[str, Any]], placements: dict[int, Placement],
              seconds_per_step: float, checkpoint_s: float) -> None:
        """Write the checked records of steps first, first+1, ... and their ledger lines."""
        tps = self.tokens_per_step / seconds_per_step
        mfu = tps * self.flops_per_token / self.peak_flops if self.peak_flops else 0.0
        for i, (per, rec) in enumerate(zip(per_step, records, strict=True)):
            step = first + i
            self.ledger.write(step_record(step, ledger_parts(per, self._first_stage(placements)),
                                          step - 1 + self.cfg.batch_offset))
            self.last = self.metrics.write(
                "step", step=step, **rec, tokens=step * self.tokens_per_step, tokens_per_s=tps,
                mfu=mfu, time_checkpoint=checkpoint_s if i == len(per_step) - 1 else 0.0)
            self.productive_s += seconds_per_step
            if self.tensorboard:
                self.tensorboard.write(self.last)
            if rec.get("skipped"):
                warn(f"step {step}: CE loss {rec['ce_loss']:.4g} or gradient norm "
                     f"{rec['grad_norm']:.4g} above optim.skip_spikes' threshold; its update "
                     "was skipped (its data counts as consumed)")
            spike = self.spikes.check(rec["loss"])
            if spike:
                self.metrics.write("spike", step=step, message=spike)
                warn(f"step {step}: {spike}")
            self.recent_losses.append(rec["loss"])

    def _first_stage(self, placements: dict[int, Placement]) -> list[int]:
        """`first_stage(placements)`, found once per layout."""
        if self._first is None or self._first[0] is not placements:
            self._first = placements, first_stage(placements)
        return self._first[1]

    def _diverged(self, step: int, rec: dict[str, Any], per: dict[int, Step],
                  placements: dict[int, Placement]) -> None:
        self.ledger.write(step_record(step, ledger_parts(per, self._first_stage(placements)),
                                          step - 1 + self.cfg.batch_offset))
        self.metrics.write("nan", step=step, message=f"non-finite loss/gradient: "
                           f"loss={rec['loss']} grad_norm={rec['grad_norm']}")
        raise TrainingStopped(f"training diverged at step {step} (loss {rec['loss']}, grad "
                              f"norm {rec['grad_norm']}); the update was skipped and the last "
                              f"good checkpoint (step {self.last_checkpoint()}) is intact")

    def unsaved(self, step: int, save_step: int, unsaved: int, last_committed: int,
                error: str) -> None:
        """A save failed: `unsaved` steps trained by `step` are held by no committed
        checkpoint; the progress bar shows the count until a newer checkpoint commits."""
        self.failed_save = max(self.failed_save, save_step)
        self.metrics.write("unsaved", step=step, save_step=save_step, unsaved=unsaved,
                           last_committed=last_committed, error=error)

    def progress(self, step: int) -> None:
        if self.bar is None:
            return
        newest = self.last_checkpoint()
        unsaved = {"unsaved": step - newest} if self.failed_save > newest else {}
        self.bar.set_postfix(loss=f"{self.last['loss']:.3f}", heldout=f"{self.heldout:.3f}",
                             tok_s=f"{self.last.get('tokens_per_s', 0):,.0f}", **unsaved,
                             refresh=False)
        self.bar.n = step
        self.bar.refresh()

    # ---- evaluation ------------------------------------------------------------------------
    def evaluation(self, step: int, per_worker: dict[int, dict[str, dict[int, float]]],
                   sets: dict[str, list[int]]) -> None:
        """Record each evaluation set's loss over its instances `sets[name]` against the recent
        training loss (`heldout_loss` is the first set's: the run's own held-out split when it
        has one); each set's memorisation alarm warns, or stops the run with
        eval.stop_on_alarm."""
        losses = {}
        for name, ids in sets.items():
            per_instance: dict[int, float] = {}
            for r in per_worker.values():
                per_instance.update({int(k): v for k, v in r.get(name, {}).items()})
            losses[name] = mean_loss(per_instance, ids)
        self.heldout = next(iter(losses.values()))
        recent = self.recent_losses[-max(1, self.cfg.eval.every):]
        train_loss = math.fsum(recent) / len(recent)
        rec = self.metrics.write("eval", step=step, tokens=step * self.tokens_per_step,
                                 heldout_loss=self.heldout,
                                 heldout_ppl=math.exp(min(self.heldout, 50.0)),
                                 train_loss=train_loss, sets=losses)
        if self.tensorboard:
            self.tensorboard.write(rec)
        for name, loss in losses.items():
            alarm = self.alarms.setdefault(name, MemorisationAlarm(self.cfg.eval.memo_gap,
                                                                   self.cfg.eval.memo_patience))
            message = alarm.update(train_loss, loss)
            if message is None:
                continue
            if name != OWN_EVAL_SET:
                message = f"eval set '{name}': {message}"
            self.metrics.write("alarm", step=step, message=message, set=name)
            warn(message)
            if self.cfg.eval.stop_on_alarm:
                raise TrainingStopped(f"stopped at step {step}: {message}")


def _ledger_last_step(path: str) -> int:
    """The last step the ledger holds as consumed (after its rollbacks)."""
    last = 0
    if os.path.exists(path):
        for rec in read_ledger(path).records:
            if rec.get("kind") == "step":
                last = max(last, rec["step"])
            elif rec.get("kind") == "rollback":
                last = rec["to_step"]
    return last
