"""The controller: one process that drives the workers through the step loop.

It owns the run directory and decides when things happen; each concern is a part of its own:
the checkpoint catalogue (runtime/catalogue.py), membership and recovery (runtime/recovery.py)
and the step reporter (runtime/reporter.py). Workers only compute.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from typing import Any

import yaml

from relaytrain import storage
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.config import check_resume_compatible, init_section
from relaytrain.config.sections import RunConfig
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.eval_sets import eval_ids, open_eval_sets
from relaytrain.data.loader import check_order
from relaytrain.errors import ConfigError, UserError, warn
from relaytrain.model.accounting import flops_per_token
from relaytrain.parallel.pipeline.schedules import asynchronous
from relaytrain.parallel.precision import gather_dtype
from relaytrain.runtime.catalogue import STORAGE_WAIT_S, CheckpointCatalogue
from relaytrain.runtime.engines.base import Engine, WorkerCall
from relaytrain.runtime.failures import WorkerFailure
from relaytrain.runtime.faults import FaultInjector, end_storage_outage, plan_faults
from relaytrain.runtime.recovery import Recovery
from relaytrain.runtime.reporter import StepReporter, TrainingStopped
from relaytrain.runtime.summary import RunSummary
from relaytrain.train.auto_backends import settle_backends
from relaytrain.train.execution import pick_device
from relaytrain.train.init_from import resolve as resolve_init
from relaytrain.train.metrics import peak_flops
from relaytrain.train.skip_step import SkipRule, SkipWindow

__all__ = ["Controller", "TrainingStopped"]


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
    def __init__(self, cfg: RunConfig, quiet: bool = False, engine: Engine | None = None):
        """`engine`: one to run on instead of runtime.engine's (the control-plane benchmark's
        simulated workers, runtime/engines/simulated.py)."""
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
        resume = self._resume_manifest(cfg)
        self.start = 0 if resume is None else int(resume["step"])
        cfg = self._settle_init(cfg, resume)
        # The run's config is settled once, here, before anything reads it: `auto` replaced by
        # the backends chosen for the run (those the checkpoint recorded, where its host chose
        # them), which every worker runs; the fused kernels are built (once per host) here.
        cfg, self.backends = settle_backends(cfg, self.model_cfg, resume)
        self.cfg = cfg
        # optim.skip_spikes' window of earlier steps: from the checkpoint resumed, kept here
        rule = SkipRule.from_config(cfg)
        self.skip_window = None if rule is None else \
            SkipWindow(rule, (resume or {}).get("skip_window"))
        n_train = self.dataset.split("train").num_instances(cfg.seq_len)
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
        self.engine: Engine | None = engine  # else started by run()
        self._results_at = 0.0  # when the last step's results came
        self.recovery: Recovery | None = None  # needs the engine

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Train to train.max_steps, recovering from worker failures; the run's summary."""
        t_run = time.perf_counter()
        cfg, start = self.cfg, self.start
        if self.engine is None:  # first: a cluster that cannot be joined writes nothing
            self.engine = make_engine(cfg)
        try:
            self._prepare_run_dir()
            self.reporter.open(start, cfg.data_parallel)
            self.recovery = Recovery(cfg, self.engine, (cfg, self.dataset.vocab_size),
                                     self.catalogue, self.reporter, self.faults)
            self.recovery.start(start)
            setup_s = time.perf_counter() - t_run
            peak, peak_src = peak_flops(pick_device(cfg.train.device),
                                        cfg.runtime.threads_per_worker)
            self.reporter.start_progress(start, flops_per_token(self.model_cfg, cfg.seq_len),
                                         peak * cfg.world_size)
            step, ahead = start, None
            while step < cfg.train.max_steps:
                count = self._span(step)
                done, in_flight = step, count
                try:
                    current, ahead = ahead or self._dispatch(step, count), None
                    ahead = self._dispatch_ahead(step + count)
                    self._train(current)
                    done, in_flight = step + count, 0
                    self._between_steps(done)
                except WorkerFailure as failure:
                    done = self.recovery.recover(failure, done, in_flight,
                                                 ahead=ahead.count if ahead else 0)
                    ahead = None
                step = done
                self.reporter.progress(step)
            self._finish_writes(wait=STORAGE_WAIT_S)
            return self._summary(start, setup_s, peak * cfg.world_size, peak_src,
                                 time.perf_counter() - t_run)
        finally:
            self.faults.cancel()
            self.reporter.close()
            if self.recovery is not None:
                self.recovery.close()
            self.engine.shutdown()

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
        configured size), the end of the run, an injected fault due next (delivered, as ever,
        when its step is dispatched), or optim.skip_spikes (each step compares itself with
        the results of the steps before it)."""
        cfg = self.cfg
        every = [e for e in (cfg.checkpoint.every, cfg.eval.every if self.eval_ids else 0) if e]
        if (not cfg.runtime.dispatch_ahead or step >= cfg.train.max_steps
                or self.skip_window is not None
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
        self.catalogue.record([w for r in results.values() for w in r[-1].written])
        t_ckpt = 0.0
        if (cfg.checkpoint.every and end % cfg.checkpoint.every == 0) \
                or end == cfg.train.max_steps:
            t_ckpt = self._save(end)  # a failure here loses the span with the snapshot
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
        if storage.scheme(self.store.url) == "file" and end_storage_outage(self.store.url):
            warn(f"{self.store.url} was left unavailable by an injected storage outage of a "
                 "run that was killed; restored it")
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
        resumed run keeps the origin its checkpoint recorded, and ignores `init.from`."""
        init = dataclasses.replace(cfg.init, origin=None)
        if resume is not None:
            if init.from_ is not None:
                warn(f"config key 'init.from' is ignored: run_dir {cfg.run_dir!r} resumes its "
                     f"own checkpoint step {self.start}")
            init = init_section(resume.get("config") or {})
        elif init.from_ is not None:
            init = dataclasses.replace(init, origin=resolve_init(init, self.model_cfg))
        return dataclasses.replace(cfg, init=init)

    def _prepare_run_dir(self) -> None:
        """Create or reopen the run directory, with the run's settled config."""
        os.makedirs(self.cfg.run_dir, exist_ok=True)
        self.catalogue.last_committed = self.start
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

    def _manifest_meta(self, step: int) -> dict[str, Any]:
        return {"model": self.model_cfg.to_dict(), "config": self.cfg.to_dict(),
                **{k: {"backend": c.backend, "key": c.key} for k, c in self.backends.items()},
                "data": {"batch_index": step, "fingerprint": self.dataset.fingerprint,
                         "n_instances": self.n_train, "seq_len": self.cfg.seq_len},
                # Nothing draws from global RNG state: init derives from (seed, purpose), the
                # data order from (data seed, epoch), so the two seeds are the whole RNG state.
                "rng": {"seed": self.cfg.seed, "data_seed": self.cfg.data_seed},
                # where step 0's state came from (`init.from`); None: the seed
                "init": self.cfg.init.origin,
                **({} if self.skip_window is None
                   else {"skip_window": self.skip_window.saved(step)}),
                "topology": {"dp": self.cfg.parallel.dp, "fsdp": self.cfg.parallel.fsdp,
                             "pp": self.cfg.parallel.pp, "fsdp_param_dtype": self._gathers()}}

    def _gathers(self) -> str | None:
        """The dtype the workers gather parameters in, `parallel.fsdp_param_dtype` resolved on
        the run's device as train/state.py resolves it (config.yaml keeps the setting, `auto`
        included); None unsharded."""
        cfg = self.cfg
        if cfg.parallel.fsdp == 1:
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
        members = self.recovery.members
        for fault in self.faults.due(first, last, ("kill", "hang", "slow", "raise")):
            wid = members[fault.rank % len(members)]
            if fault.kind == "raise":
                self.engine.call_all([wid], lambda w, s=fault.step: w.arm_fault(s),
                                     self.cfg.runtime.call_timeout)
                self.faults.fired_at[self.engine.pid(wid)] = time.time()
            else:
                self.faults.signal_later(self.engine.pid(wid), fault.kind)

