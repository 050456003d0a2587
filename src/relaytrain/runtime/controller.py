"""The controller: one process that drives the workers through the step loop.

It owns the run directory and decides when things happen; each concern is a part of its own:
the checkpoint catalogue (runtime/catalogue.py), membership and recovery (runtime/recovery.py)
and the step reporter (runtime/reporter.py). Workers only compute.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import time
from itertools import chain
from typing import Any

import yaml

from relaytrain import storage
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.config import check_resume_compatible, init_section, keep_settled
from relaytrain.config.sections import InitSection, RunConfig
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.eval_sets import eval_ids, open_eval_sets
from relaytrain.data.loader import check_order
from relaytrain.data.packing import train_split
from relaytrain.data.position import Stream
from relaytrain.errors import ConfigError, UserError, warn
from relaytrain.model.accounting import flops_per_token
from relaytrain.parallel.pipeline.schedules import asynchronous
from relaytrain.parallel.precision import gather_dtype
from relaytrain.runtime.catalogue import (
    STORAGE_WAIT_S,
    CheckpointCatalogue,
    WorkNotSaved,
    prove_writable,
)
from relaytrain.runtime.engines.base import Engine, WorkerCall
from relaytrain.runtime.failures import WorkerFailure
from relaytrain.runtime.faults import (
    FaultInjector,
    end_storage_outage,
    plan_faults,
    start_disk_full,
)
from relaytrain.runtime.heap import frozen_heap
from relaytrain.runtime.liveness import kill_local
from relaytrain.runtime.preemption import Notice, Preempted
from relaytrain.runtime.recovery import Recovery
from relaytrain.runtime.reporter import StepReporter, TrainingStopped
from relaytrain.runtime.summary import RunSummary
from relaytrain.train.auto_backends import settle_backends
from relaytrain.train.execution import pick_device
from relaytrain.train.init_from import continue_at
from relaytrain.train.init_from import resolve as resolve_init
from relaytrain.train.metrics import run_peak_flops
from relaytrain.train.skip_step import SkipRule, SkipWindow

__all__ = ["Controller", "TrainingStopped", "WorkNotSaved"]

FINAL_SAVE_TRIES = 2  # saves of the final state from the workers' memory after its first


def _written(results: list[Any]) -> list[Any]:
    """The checkpoint writes a worker reported with its last step's result."""
    return results[-1].written


@dataclasses.dataclass
class Dispatched:
    """Steps step+1 .. step+count started on the workers, their results not yet taken."""

    step: int
    count: int
    started: Any  # the engine's handle (Engine.start_all)
    t0: float  # when they were dispatched


def make_engine(cfg: RunConfig) -> Engine:
    if cfg.runtime.engine == "ray":
        from relaytrain.runtime.engines.ray import RayEngine

        return RayEngine(cfg)
    from relaytrain.runtime.engines.inline import InlineEngine

    return InlineEngine()


class Controller:
    def __init__(self, cfg: RunConfig, quiet: bool = False, notice: Notice | None = None,
                 engine: Engine | None = None):
        """`notice`: the CLI's SIGTERM/SIGINT notice (runtime/preemption.py); `engine`: one to
        run on instead of runtime.engine's (the control-plane benchmark's simulated workers,
        runtime/engines/simulated.py)."""
        if not cfg.run_dir:
            raise ConfigError("config key 'run_dir' is empty; give a directory for the run's "
                              "metrics, ledger and checkpoints (e.g. run_dir=runs/demo)")
        if not cfg.data.path:
            raise ConfigError("config key 'data.path' is empty; give a directory written by "
                              "`relaytrain data prepare`")
        self.dataset = TokenDataset.open(cfg.data.path)
        check_order(self.dataset, cfg.data.order)
        self.model_cfg = cfg.model_config(self.dataset.vocab_size)
        self.store = CheckpointStore(cfg.checkpoint_url, keep_last=cfg.checkpoint.keep_last)
        self.catalogue = CheckpointCatalogue(self.store, self._manifest_meta,
                                             on_failed_write=lambda step: self.faults.unblock(step))
        if storage.scheme(self.store.url) == "file" and end_storage_outage(self.store.url):
            warn(f"{self.store.url} was left unavailable by an injected storage outage of a "
                 "run that was killed; restored it")
        # Proven writable before anything is read, settled or trained (and nothing is left
        # by the proof): a run whose work could never be saved does not start.
        prove_writable(cfg.run_dir, "run_dir")
        prove_writable(self.store.url, "checkpoint.url")
        resume = self._resume_manifest(cfg)
        self.start = 0 if resume is None else int(resume["step"])
        cfg = self._settle_init(cfg, resume)
        if resume is None:
            self.start = cfg.start_step  # a continued run starts at its source's step
        self.catalogue.base = cfg.start_step
        # The run's config is settled once, here, before anything reads it: `auto` replaced by
        # the backends chosen for the run (those the checkpoint recorded, where its host chose
        # them), which every worker runs; the fused kernels are built (once per host) here.
        cfg, self.backends = settle_backends(cfg, self.model_cfg, resume)
        self.cfg = cfg
        # optim.skip_spikes' window of earlier steps: from the checkpoint resumed, kept here
        rule = SkipRule.from_config(cfg)
        self.skip_window = None if rule is None else \
            SkipWindow(rule, (resume or {}).get("skip_window"))
        n_train = train_split(self.dataset, cfg.seq_len, cfg.packing).num_instances(cfg.seq_len)
        if n_train < cfg.train.global_batch:
            raise UserError(f"data.path {cfg.data.path!r} has {n_train} training instances of "
                            f"data.seq_len={cfg.seq_len}; train.global_batch="
                            f"{cfg.train.global_batch} needs at least that many")
        self.n_train = n_train
        self.eval_ids = eval_ids(open_eval_sets(self.dataset, cfg.eval.sets), cfg.seq_len,
                                 cfg.eval.instances) if cfg.eval.every > 0 else {}
        self.faults = FaultInjector(plan_faults(cfg.faults, cfg.seed, cfg.train.max_steps,
                                                cfg.world_size), cfg.faults.slow_seconds)
        self.reporter = StepReporter(cfg, self.dataset.fingerprint, n_train, quiet,
                                     last_checkpoint=lambda: self.catalogue.last_committed)
        # SIGTERM/SIGINT (runtime/preemption.py): the CLI's notice; in process, one never in
        # force (the caller's handlers stay)
        self.notice = notice or Notice(cfg.checkpoint.preempt_grace)
        self.engine: Engine | None = engine  # else started by run()
        self._results_at = 0.0  # when the last step's results came
        self.recovery: Recovery | None = None  # needs the engine

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Train to train.max_steps, recovering from worker failures; the run's summary.
        Raises `Preempted` when a notice stopped it at a step boundary, its state saved."""
        t_run = time.perf_counter()
        cfg, start = self.cfg, self.start
        if self.notice.received:  # while the run was being set up: start nothing
            raise self._preempted(start, "nothing was trained")
        if self.engine is None:  # first: a cluster that cannot be joined writes nothing
            self.engine = make_engine(cfg)
        self.notice.reinstall()  # Ray's start replaced SIGTERM's handler with its own
        self.notice.on_stop = self._stop_at_once
        try:
            self._prepare_run_dir()
            self.reporter.open(start, cfg.data_parallel)
            self.recovery = Recovery(cfg, self.engine, (cfg, self.dataset.vocab_size),
                                     self.catalogue, self.reporter, self.faults)
            self.recovery.start(start)
            setup_s = time.perf_counter() - t_run
            peak, peak_src = run_peak_flops(pick_device(cfg.train.device),
                                            cfg.runtime.threads_per_worker)
            self.reporter.start_progress(start, flops_per_token(self.model_cfg, cfg.seq_len),
                                         peak * cfg.world_size)
            with frozen_heap():  # runtime/heap.py: garbage-collection passes per step
                step = self._loop(start)
            if step < cfg.train.max_steps:
                raise self._preempt(step)
            self._finish_writes(wait=STORAGE_WAIT_S)
            self._final_save(cfg.train.max_steps)
            return self._summary(start, setup_s, peak * cfg.world_size, peak_src,
                                 time.perf_counter() - t_run)
        finally:
            self.faults.cancel()
            self.reporter.close()
            if self.recovery is not None:
                self.recovery.close()
            self.engine.shutdown()

    def _loop(self, start: int) -> int:
        """Train from `start` until train.max_steps or a notice; the step reached."""
        step, ahead = start, None
        # after a notice, the steps already dispatched ahead are taken, then it stops
        while step < self.cfg.train.max_steps and (ahead or not self.notice.received):
            count = self._span(step)
            done, in_flight = step, count
            try:
                current, ahead = ahead or self._dispatch(step, count), None
                ahead = self._dispatch_ahead(step + count)
                self._train(current)
                done, in_flight = step + count, 0
                if not self.notice.received:
                    self._between_steps(done)
            except WorkerFailure as failure:
                done = self.recovery.recover(failure, done, in_flight,
                                             ahead=ahead.count if ahead else 0)
                ahead = None
            step = done
            self.reporter.progress(step)
        return step

    def _dispatch(self, step: int, count: int) -> Dispatched:
        """Start steps step+1 .. step+count on every worker (their planned faults delivered)."""
        t0 = time.perf_counter()
        self._inject(step + 1, step + count)
        window = self.skip_window
        history = None if window is None else window.history(step)
        started = self.engine.start_all(self.recovery.members,
                                        lambda w: w.run_steps(step + 1, count, history),
                                        self.cfg.runtime.call_timeout * count)
        return Dispatched(step, count, started, t0)

    def _dispatch_ahead(self, step: int) -> Dispatched | None:
        """Dispatch ahead: the steps after `step`, started before `step`'s results are checked
        and recorded, so that no worker waits for the controller between steps; None where
        `step` ends at a barrier: a checkpoint, an evaluation, a possible resize (below the
        configured size), the end of the run, a preemption notice, an injected fault due next
        (delivered, as ever, when its step is dispatched), or optim.skip_spikes (each step
        compares itself with the results of the steps before it)."""
        cfg = self.cfg
        every = [e for e in (cfg.checkpoint.every, cfg.eval.every if self.eval_ids else 0) if e]
        if (not cfg.runtime.dispatch_ahead or step >= cfg.train.max_steps
                or self.notice.received or self.skip_window is not None
                or any(step % e == 0 for e in every)
                or self.recovery.dp < self.recovery.target_dp):
            return None
        count = self._span(step)
        if self.faults.planned(step + 1, step + count):
            return None
        return self._dispatch(step, count)

    def _train(self, d: Dispatched) -> None:
        """The dispatched steps' results: checked, recorded, and checkpointed at their end."""
        cfg, recovery, step, count = self.cfg, self.recovery, d.step, d.count
        results = self.engine.finish(d.started)
        now = time.perf_counter()
        # per step, from the later of its dispatch and the previous results (dispatched ahead)
        elapsed = (now - max(d.t0, self._results_at)) / count
        self._results_at = now
        per_step = [{w: r[i] for w, r in results.items()} for i in range(count)]
        placements = recovery.placements()
        records = self.reporter.check(step + 1, per_step, placements)
        end = step + count
        window = self.skip_window
        if window is not None:  # before a commit's manifest asks for it; kept back to the
            # oldest state a restore may go to (the last committed checkpoint, a snapshot)
            window.take(step + 1, records, min(self.catalogue.last_committed,
                                               end - cfg.elastic.snapshot_every))
        self.catalogue.record(list(chain.from_iterable(map(_written, results.values()))))
        t_ckpt = 0.0
        if (cfg.checkpoint.every and end % cfg.checkpoint.every == 0) \
                or end == cfg.train.max_steps:
            t_ckpt = self._save(end)  # a failure here loses the span with the snapshot
        self._saves_failed(end)
        self.reporter.steps(step + 1, per_step, records, placements, elapsed, t_ckpt)
        recovery.recovered(end)

    def _between_steps(self, step: int) -> None:
        """At a step boundary: held-out evaluation when due, growing back when possible."""
        if self.eval_ids and (step % self.cfg.eval.every == 0
                              or step == self.cfg.train.max_steps):
            results = self.engine.call_all(self.recovery.members,
                                           lambda w: w.evaluate(self.eval_ids),
                                           self.cfg.runtime.call_timeout)
            self.reporter.evaluation(step, results, self.eval_ids)
        self._limit_unsaved(step)
        self.recovery.maybe_grow(step)

    def _span(self, step: int) -> int:
        """Steps per dispatch: one, or for asynchronous pipeline schedules a span that ends at
        the next evaluation, checkpoint or fault (the pipeline drains at span ends)."""
        cfg = self.cfg
        if cfg.parallel.pp == 1 or not asynchronous(cfg.parallel.schedule):
            return 1
        end = min(step + cfg.parallel.span, cfg.train.max_steps)
        for every in (cfg.eval.every, cfg.checkpoint.every):
            if every:
                end = min(end, (step // every + 1) * every)
        return max(1, end - step)

    def _summary(self, start: int, setup_s: float, peak: float, peak_src: str,
                 wall: float) -> RunSummary:
        cfg, recovery, reporter = self.cfg, self.recovery, self.reporter
        return RunSummary(
            run_dir=cfg.run_dir, steps=cfg.train.max_steps, resumed_from=start,
            final_loss=reporter.last.get("loss"), final_heldout_loss=reporter.heldout,
            checkpoint_step=self.catalogue.last_committed, setup_s=setup_s, peak_flops=peak,
            peak_source=peak_src, **self.backends, recoveries=recovery.log,
            goodput=reporter.productive_s / wall, wall_s=wall, dp=recovery.dp,
            generation=recovery.generation,
            pids={w: self.engine.pid(w) for w in recovery.members},
            initial_pids=recovery.initial_pids,
            metrics=os.path.join(cfg.run_dir, "metrics.jsonl"), checkpoints=self.store.url)

    # ---- run directory ---------------------------------------------------------------------
    def _resume_manifest(self, cfg: RunConfig) -> dict[str, Any] | None:
        """The manifest of the checkpoint the run resumes from (None: a fresh run), read before
        the run's config is settled (it records the backends the run chose); refused where
        `cfg` may not continue it."""
        manifest = self.catalogue.newest_good_manifest(cfg.checkpoint.start_over)
        if manifest is None:
            return None
        if manifest.get("config"):
            check_resume_compatible(manifest["config"], cfg)
        fp = manifest.get("data", {}).get("fingerprint")
        if fp and fp != self.dataset.fingerprint:
            raise UserError(f"data.path {cfg.data.path!r} is not the data this run was "
                            f"trained on (fingerprint {self.dataset.fingerprint[:12]} != "
                            f"{fp[:12]}); point data.path at the original prepared data")
        start = int(manifest["step"])
        if start >= cfg.train.max_steps:
            raise UserError(f"run_dir {cfg.run_dir!r} already reached step {start}; "
                            f"raise train.max_steps above {start} to continue")
        return manifest

    def _settle_init(self, cfg: RunConfig, resume: dict[str, Any] | None) -> RunConfig:
        """`cfg` with `init.origin` settled: a new run with `init.from` resolves it (found,
        verified, of the run's dimensions: train/init_from.py), before anything is written; a
        resumed run keeps the origin its checkpoint recorded, and ignores `init.from`. An unset
        `model.softmax_rows` is settled too: the origin's (OLMo-core's `padded` for an OLMo-core
        checkpoint), the tokenizer's rows for a run from the seed, a resumed run's own (and its
        data seed, where it took its source's: `config.keep_settled`)."""
        init = dataclasses.replace(cfg.init, origin=None)
        rows = None
        if resume is not None:
            if init.from_ is not None:
                warn(f"config key 'init.from' is ignored: run_dir {cfg.run_dir!r} resumes its "
                     f"own checkpoint step {self.start}")
            init = init_section(resume.get("config") or {})
            cfg = keep_settled(resume.get("config") or {}, cfg)
        elif init.from_ is not None:
            init = dataclasses.replace(init, origin=resolve_init(init, self.model_cfg))
            rows = init.origin["softmax_rows"]
            if "trainer" in init.origin:
                cfg, init = self._continue(cfg, init)
        else:
            rows = "tokenizer"
        cfg = dataclasses.replace(cfg, init=init)
        if rows is not None and "softmax_rows" not in cfg.model.overrides:
            # unset: the source's (a continued run computes its loss as it was computed)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(
                cfg.model, overrides={**cfg.model.overrides, "softmax_rows": rows}))
        self.model_cfg = cfg.model_config(self.dataset.vocab_size)
        return cfg

    def _continue(self, cfg: RunConfig, init: InitSection) -> tuple[RunConfig, InitSection]:
        """A run continuing its origin's trainer state (`init.trainer_state`): its data seed
        the source's unless `data.seed` says otherwise, its first global batch where the
        source's data position lies in the run's stream, its steps past the source's."""
        t = init.origin["trainer"]
        seed = t.get("data_seed")
        if cfg.data.seed is None and seed is not None:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seed=seed))
        elif seed is not None and cfg.data_seed != seed:
            warn(f"config key 'data.seed': {cfg.data_seed} is not the data seed of the run "
                 f"init.trainer_state continues ({seed}): its data order is not the source's")
        if cfg.train.max_steps <= t["step"]:
            raise ConfigError(f"config key 'train.max_steps': got {cfg.train.max_steps}, but "
                              f"init.trainer_state continues from step {t['step']}; expected "
                              "more (steps count on from the source's)")
        n = self.dataset.split("train").num_instances(cfg.seq_len)
        stream = Stream(cfg.data.order, n, cfg.train.global_batch, cfg.seq_len)
        return cfg, dataclasses.replace(init, origin=continue_at(init.origin, stream))

    def _prepare_run_dir(self) -> None:
        """Create or reopen the run directory, with the run's settled config."""
        os.makedirs(self.cfg.run_dir, exist_ok=True)
        self.catalogue.last_committed = self.start
        debris = self.store.sweep()
        if debris:
            warn(f"deleted what earlier failed or interrupted saves left in "
                 f"{storage.redact(self.store.url)}: {', '.join(debris)}")
        with open(os.path.join(self.cfg.run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(self.cfg.to_dict(), f, sort_keys=False)

    # ---- checkpoints -----------------------------------------------------------------------
    def _save(self, step: int) -> float:
        """Every writer starts its part of checkpoint `step` (copied to host memory now,
        written in the background); the seconds the copy took."""
        parts = self.recovery.save_parts()
        t0 = time.perf_counter()
        attempt = secrets.token_hex(8)

        def save(part: str) -> WorkerCall:
            return lambda w: w.save(step, part, attempt)

        self.engine.call({wid: save(part) for wid, part in parts.items()},
                         self.cfg.runtime.call_timeout)
        self.catalogue.expect(step, set(parts.values()), attempt)
        if not self.cfg.checkpoint.async_write:
            self._finish_writes(wait=0.0)
        return time.perf_counter() - t0

    def _preempt(self, step: int) -> Preempted:
        """At a notice, `step` the last completed step: its state, in the workers' memory,
        saved (unless a checkpoint of it is committed or being written) and every write
        committed within what is left of the grace (past it the notice stops the run at once);
        what was saved, as the exception that stops the run."""
        catalogue = self.catalogue
        t0 = time.monotonic()
        if step > catalogue.last_committed and all(p.step != step for p in catalogue.pending):
            self._save(step)
        self._finish_writes(wait=max(self.notice.left() - 1.0, 0.0))
        if step == self.start:
            return self._preempted(step, "nothing was trained")
        if catalogue.last_committed == step:
            return self._preempted(step, f"checkpoint step {step} committed in "
                                         f"{time.monotonic() - t0:.1f}s")
        return self._preempted(step, f"the state of step {step} could not be committed; the "
                                     f"newest checkpoint is step {catalogue.last_committed}")

    def _preempted(self, step: int, saved: str) -> Preempted:
        """The one line saying what a notice's stop saved, as the exception that stops the
        run (the notice keeps it, should the shutdown outlast the grace)."""
        name = signal.Signals(self.notice.signum).name
        self.notice.saved = (f"preempted by {name} after step {step}: {saved} "
                             f"({storage.redact(self.store.url)}); run the same command to "
                             "resume")
        return Preempted(self.notice.saved)

    def _stop_at_once(self) -> str:
        """For the notice's stop at once (a second signal, the grace spent): every worker
        process on this host killed (on other nodes Ray ends the actors of a driver that is
        gone); the newest checkpoint, for the last line."""
        for process in self.engine.processes():
            kill_local(process)
        return f"the newest checkpoint is step {self.catalogue.last_committed}"

    def _finish_writes(self, wait: float) -> None:
        """Wait for every checkpoint write and commit what is complete; commits deferred by
        unavailable storage are retried for up to `wait` seconds."""
        writers = list(self.recovery.save_parts())
        done = self.engine.call_all(writers, lambda w: w.flush_writes(),
                                    self.cfg.runtime.call_timeout)
        reports = [w for ws in done.values() for w in ws]
        if wait:
            self.catalogue.finish(reports, wait)
        else:
            self.catalogue.record(reports)

    def _saves_failed(self, step: int) -> None:
        """Say, loudly, what each failed save leaves unsaved, `step` being trained: a warning,
        a metrics record and the progress bar."""
        newest = self.catalogue.last_committed
        for failed in self.catalogue.take_failures():
            unsaved = step - newest
            warn(f"checkpoint step {failed.step} was not saved: {unsaved} steps are unsaved "
                 f"since the newest committed checkpoint (step {newest})")
            self.reporter.unsaved(step, failed.step, unsaved, newest, failed.error)

    def _save_now(self, step: int) -> None:
        """Every write finished and committed where it can be; then, unless that committed
        `step`, a save of the workers' state at `step`, waited for."""
        self._finish_writes(wait=STORAGE_WAIT_S)
        if self.catalogue.last_committed < step:
            self._save(step)
            self._finish_writes(wait=STORAGE_WAIT_S)
        self._saves_failed(step)

    def _limit_unsaved(self, step: int) -> None:
        """checkpoint.max_unsaved_steps: past it, one last attempt to save, then the stop."""
        limit = self.cfg.max_unsaved_steps
        if not limit or step - self.catalogue.last_committed <= limit:
            return
        warn(f"step {step}: {step - self.catalogue.last_committed} steps are unsaved, over "
             f"checkpoint.max_unsaved_steps={limit}; a last attempt to save step {step}")
        self._save_now(step)
        newest = self.catalogue.last_committed
        if step - newest > limit:
            raise WorkNotSaved(
                f"stopped at step {step}: steps {newest + 1}..{step} ({step - newest}) are not "
                f"saved, over checkpoint.max_unsaved_steps={limit}, and the last attempt failed;"
                f" the newest committed checkpoint is step {newest} in "
                f"{storage.redact(self.store.url)} (free or fix the storage, then run again to "
                "resume from it)")

    def _final_save(self, step: int) -> None:
        """The final state committed: its save tried again from the workers' memory, which
        still holds it, FINAL_SAVE_TRIES times; `WorkNotSaved` if it never commits."""
        self._saves_failed(step)
        for attempt in range(FINAL_SAVE_TRIES):
            if self.catalogue.last_committed >= step:
                return
            warn(f"the final checkpoint (step {step}) is not committed; saving it again from "
                 f"memory ({attempt + 1}/{FINAL_SAVE_TRIES})")
            self._save_now(step)
        newest = self.catalogue.last_committed
        if newest < step:
            raise WorkNotSaved(
                f"the final checkpoint (step {step}) could not be committed after "
                f"{FINAL_SAVE_TRIES + 1} attempts: steps {newest + 1}..{step} "
                f"({step - newest}) are not saved; the newest committed checkpoint is step "
                f"{newest} in {storage.redact(self.store.url)} (free or fix the storage, then "
                "run again to resume from it)")

    def _manifest_meta(self, step: int) -> dict[str, Any]:
        return {"model": self.model_cfg.to_dict(), "config": self.cfg.to_dict(),
                **{k: {"backend": c.backend, "key": c.key} for k, c in self.backends.items()},
                # the global batch the next step trains on: the run's data position
                "data": {"batch_index": step + self.cfg.batch_offset,
                         "fingerprint": self.dataset.fingerprint,
                         "n_instances": self.n_train, "seq_len": self.cfg.seq_len},
                # Nothing draws from global RNG state: init derives from (seed, purpose), the
                # data order from (data seed, epoch), so the two seeds are the whole RNG state.
                "rng": {"seed": self.cfg.seed, "data_seed": self.cfg.data_seed},
                # where step 0's state came from (`init.from`); None: the seed
                "init": self.cfg.init.origin,
                **({} if self.skip_window is None
                   else {"skip_window": self.skip_window.saved(step)}),
                "topology": {"dp": self.cfg.parallel.dp, "fsdp": self.cfg.parallel.fsdp,
                             "pp": self.cfg.parallel.pp, "cp": self.cfg.parallel.cp,
                             "shard_over_cp": self.cfg.parallel.shard_over_cp,
                             "fsdp_param_dtype": self._gathers()}}

    def _gathers(self) -> str | None:
        """The dtype the workers gather parameters in, `parallel.fsdp_param_dtype` resolved on
        the run's device as train/state.py resolves it (config.yaml keeps the setting, `auto`
        included); None unsharded."""
        cfg = self.cfg
        if cfg.parallel.shards == 1:
            return None
        return gather_dtype(cfg.parallel.fsdp_param_dtype, pick_device(cfg.train.device).type,
                            cfg.determinism == "exact")

    # ---- fault injection -------------------------------------------------------------------
    def _inject(self, first: int, last: int) -> None:
        """Deliver the planned faults of steps first .. last."""
        for fault in self.faults.due(first, last, ("fail_checkpoint",)):
            self.faults.block_checkpoint(self.store.url, fault.step)
        for fault in self.faults.due(first, last, ("storage_outage",)):
            seconds = self.cfg.faults.storage_outage_seconds
            if self.faults.storage_outage(self.store.url, seconds):
                warn(f"step {fault.step}: injected storage outage: {self.store.url} is "
                     f"unavailable for {seconds:g}s")
        for fault in self.faults.due(first, last, ("disk_full",)):
            quota = start_disk_full(self.store.url)
            warn(f"step {fault.step}: injected full disk: {self.store.url} may hold no more "
                 f"than {quota} bytes")
        members = self.recovery.members
        for fault in self.faults.due(first, last, ("kill", "hang", "slow", "raise")):
            wid = members[fault.rank % len(members)]
            if fault.kind == "raise":
                self.engine.call_all([wid], lambda w, s=fault.step: w.arm_fault(s),
                                     self.cfg.runtime.call_timeout)
                self.faults.fired_at[self.engine.pid(wid)] = time.time()
            else:
                self.faults.signal_later(self.engine.pid(wid), fault.kind)

