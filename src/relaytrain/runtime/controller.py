"""The controller: one process that drives the workers through the step loop.

It owns the run directory (config, metrics, ledger), the checkpoint catalogue (it commits a
checkpoint once every writer reported its part), held-out evaluation and the alarms, and it
decides what happens on a failure. Workers only compute.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import yaml

from relaytrain import storage
from relaytrain.checkpoint.store import CheckpointStore, CheckpointWarning
from relaytrain.config import RunConfig, load_config
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.ledger import (
    LedgerWriter,
    header_record,
    read_ledger,
    rollback_record,
    step_record,
)
from relaytrain.data.order import heldout_ids
from relaytrain.errors import CheckpointError, ConfigError, UserError
from relaytrain.model.accounting import flops_per_token
from relaytrain.runtime.engines.base import Engine
from relaytrain.runtime.failures import (
    NodeLost,
    RecoveryLimitExceeded,
    WorkerDied,
    WorkerFailure,
    WorkerHung,
    WorkerRaised,
)
from relaytrain.runtime.faults import FaultInjector, end_storage_outage, plan_faults
from relaytrain.runtime.worker import Placement, pick_device
from relaytrain.train.evaluate import mean_loss
from relaytrain.train.metrics import (
    MemorisationAlarm,
    MetricsLog,
    SpikeDetector,
    TensorBoard,
    peak_flops,
    warn,
)
from relaytrain.train.optim import lr_at

# Keys that may change when a run is resumed; anything else must match the checkpoint.
RESUMABLE_CHANGES = ("train.max_steps", "train.device", "train.log_every", "train.spike_factor",
                     "parallel.", "runtime.", "elastic.", "faults.", "log.", "checkpoint.",
                     "eval.", "data.prefetch", "data.path", "run_dir", "model.attention",
                     "model.checkpointing", "model.compile", "model.matmul")


ASYNC_SCHEDULES = ("pipedream", "paci")

# How long the end of a run (deferred commits) and a restore from checkpoints wait for storage
# that is unavailable.
STORAGE_WAIT_S = 30.0


class TrainingStopped(Exception):
    """The run stopped on purpose (divergence, memorisation alarm with stop_on_alarm)."""


@dataclass
class PendingCheckpoint:
    step: int
    parts: dict[str, dict] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)
    failed: bool = False
    deferred: bool = False  # its commit met unavailable storage and is retried


def make_engine(cfg: RunConfig) -> Engine:
    if cfg.runtime.engine == "ray":
        from relaytrain.runtime.engines.ray import RayEngine

        return RayEngine(cfg)
    from relaytrain.runtime.engines.inline import InlineEngine

    return InlineEngine()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "overrides":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_compatible(saved: dict[str, Any], cfg: RunConfig) -> None:
    """A resumed run must keep what defines its curve: model, data order, optimizer, seed."""
    old, new = _flat(saved), _flat(cfg.to_dict())
    for key in sorted(set(old) | set(new)):
        if key.startswith(RESUMABLE_CHANGES) or key in RESUMABLE_CHANGES:
            continue
        if old.get(key) != new.get(key):
            raise ConfigError(
                f"config key '{key}': the run directory's checkpoints were trained with "
                f"{old.get(key)!r}, got {new.get(key)!r}; only train.max_steps, parallel.*, "
                "runtime.*, eval.*, checkpoint.*, elastic.*, faults.* and log.* may change on "
                "resume (or use a new run_dir)")


class Controller:
    def __init__(self, cfg: RunConfig, quiet: bool = False):
        if not cfg.run_dir:
            raise ConfigError("config key 'run_dir' is empty; give a directory for the run's "
                              "metrics, ledger and checkpoints (e.g. run_dir=runs/demo)")
        if not cfg.data.path:
            raise ConfigError("config key 'data.path' is empty; give a directory written by "
                              "`relaytrain data prepare`")
        self.cfg = cfg
        self.quiet = quiet
        self.dataset = TokenDataset.open(cfg.data.path)
        self.model_cfg = cfg.model_config(self.dataset.vocab_size)
        n_train = self.dataset.split("train").num_instances(cfg.seq_len)
        if n_train < cfg.train.global_batch:
            raise UserError(f"data.path {cfg.data.path!r} has {n_train} training instances of "
                            f"data.seq_len={cfg.seq_len}; train.global_batch="
                            f"{cfg.train.global_batch} needs at least that many")
        self.n_train = n_train
        n_held = self.dataset.split("heldout").num_instances(cfg.seq_len)
        self.eval_ids = [int(i) for i in heldout_ids(n_held, cfg.eval.instances)] \
            if cfg.eval.every > 0 else []
        self.store = CheckpointStore(cfg.checkpoint.url or
                                     os.path.join(cfg.run_dir, "checkpoints"),
                                     keep_last=cfg.checkpoint.keep_last)
        self.engine: Engine | None = None
        self.members: list[int] = []  # worker id of each rank
        self.dp = self.target_dp = cfg.parallel.dp
        self.generation = -1
        self.faults = FaultInjector(plan_faults(cfg.faults, cfg.seed, cfg.train.max_steps,
                                                cfg.world_size), cfg.faults.slow_seconds)
        self.blockers: list[str] = []
        self.recovery_times: list[float] = []
        self.recovery_log: list[dict[str, Any]] = []
        self._pending_recovery: dict[str, Any] | None = None
        self.productive_s = 0.0
        self.pending: list[PendingCheckpoint] = []
        self.last_committed = 0
        self.spikes = SpikeDetector(cfg.train.spike_factor)
        self.alarm = MemorisationAlarm(cfg.eval.memo_gap, cfg.eval.memo_patience)
        self.recent_losses: list[float] = []
        self.tokens_per_step = cfg.train.global_batch * cfg.seq_len

    # ---- run directory ---------------------------------------------------------------------
    def _prepare_run_dir(self) -> int:
        """Create or reopen the run directory; the step to resume from (0: a fresh run)."""
        os.makedirs(self.cfg.run_dir, exist_ok=True)
        if storage.scheme(self.store.url) == "file" and end_storage_outage(self.store.url):
            warn(f"{self.store.url} was left unavailable by an injected storage outage of a "
                 "run that was killed; restored it")
        start = 0
        manifest = self._newest_good_manifest()
        if manifest is not None:
            if manifest.get("config"):
                check_resume_compatible(manifest["config"], self.cfg)
            fp = manifest.get("data", {}).get("fingerprint")
            if fp and fp != self.dataset.fingerprint:
                raise UserError(f"data.path {self.cfg.data.path!r} is not the data this run was "
                                f"trained on (fingerprint {self.dataset.fingerprint[:12]} != "
                                f"{fp[:12]}); point data.path at the original prepared data")
            start = int(manifest["step"])
            if start >= self.cfg.train.max_steps:
                raise UserError(f"run_dir {self.cfg.run_dir!r} already reached step {start}; "
                                f"raise train.max_steps above {start} to continue")
        self.last_committed = start
        with open(os.path.join(self.cfg.run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(self.cfg.to_dict(), f, sort_keys=False)
        return start

    def _newest_good_manifest(self) -> dict[str, Any] | None:
        """The newest committed checkpoint whose files all verify; broken ones are skipped
        with a warning naming the file."""
        for step in reversed(self.store.committed_steps()):
            try:
                return self.store.verify(step)
            except CheckpointError as e:
                warnings.warn(f"skipping checkpoint step {step}: {e}", CheckpointWarning,
                              stacklevel=2)
        return None

    @staticmethod
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

    # ---- layout ----------------------------------------------------------------------------
    def placements(self) -> dict[int, Placement]:
        """Worker id -> its place: rank r is DP rank r % dp of stage r // dp."""
        dp, pp = self.dp, self.cfg.parallel.pp
        return {wid: Placement(rank=r, world=dp * pp, dp_rank=r % dp, dp=dp, stage=r // dp,
                               pp=pp) for r, wid in enumerate(self.members)}

    def writer_parts(self) -> dict[int, str]:
        """Worker id -> checkpoint part: DP rank 0 of every stage writes its stage's tensors."""
        return {w: f"stage{p.stage}" for w, p in self.placements().items() if p.dp_rank == 0}

    def _span(self, step: int) -> int:
        """Steps per dispatch: one, or for asynchronous pipeline schedules a span that ends at
        the next evaluation, checkpoint or fault (the pipeline drains at span ends)."""
        cfg = self.cfg
        if cfg.parallel.pp == 1 or cfg.parallel.schedule not in ASYNC_SCHEDULES:
            return 1
        end = min(step + cfg.parallel.span, cfg.train.max_steps)
        for every in (cfg.eval.every, cfg.checkpoint.every):
            if every:
                end = min(end, (step // every + 1) * every)
        return max(1, end - step)

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        start = self._prepare_run_dir()
        self.metrics = metrics = MetricsLog(os.path.join(cfg.run_dir, "metrics.jsonl"))
        tb = TensorBoard(os.path.join(cfg.run_dir, "tensorboard")) if cfg.log.tensorboard \
            else None
        ledger_path = os.path.join(cfg.run_dir, "ledger.jsonl")
        ledger_last = self._ledger_last_step(ledger_path)
        self.ledger = ledger = LedgerWriter(cfg.run_dir)
        if ledger_last > start:
            ledger.write(rollback_record(range(start + 1, ledger_last + 1), start))
        self._ledger_header(start)
        if start > 0:
            metrics.write("restart", step=start)
        self.engine = make_engine(cfg)
        bar = None
        t_run = time.perf_counter()
        try:
            args = self._worker_args()
            self.members = self.engine.spawn_many(cfg.world_size, args,
                                                  cfg.runtime.setup_timeout)
            self.initial_pids = {w: self.engine.pid(w) for w in self.members}
            self._form_generation(start)
            setup_s = time.perf_counter() - t_run
            device = pick_device(cfg.train.device)
            peak, peak_src = peak_flops(device, cfg.runtime.threads_per_worker)
            peak *= cfg.world_size
            fpt = flops_per_token(self.model_cfg, cfg.seq_len)
            if cfg.log.progress and not self.quiet:
                from tqdm import tqdm

                bar = tqdm(total=cfg.train.max_steps, initial=start, unit="step",
                           dynamic_ncols=True, file=sys.stderr, desc="train")
            last: dict[str, Any] = {"loss": math.nan}
            heldout = math.nan
            step = start
            while step < cfg.train.max_steps:
                count = self._span(step)
                t0 = time.perf_counter()
                try:
                    self._inject(step + 1, step + count)
                    results = self.engine.call_all(self.members, "run_steps", step + 1, count,
                                                   timeout=cfg.runtime.call_timeout * count)
                except WorkerFailure as failure:
                    step = self._recover(failure, step, count)
                    if bar is not None:
                        bar.n = step
                    continue
                elapsed = (time.perf_counter() - t0) / count
                steps = []
                for i in range(count):
                    per = {w: r[i] for w, r in results.items()}
                    rec = self._combine(step + 1 + i, per)
                    if not rec.pop("finite"):
                        ledger.write(step_record(step + 1 + i, self._parts(per)))
                        metrics.write("nan", step=step + 1 + i, message="non-finite "
                                      f"loss/gradient: loss={rec['loss']} "
                                      f"grad_norm={rec['grad_norm']}")
                        raise TrainingStopped(
                            f"training diverged at step {step + 1 + i} (loss {rec['loss']}, "
                            f"grad norm {rec['grad_norm']}); the update was skipped and the "
                            f"last good checkpoint (step {self.last_committed}) is intact")
                    steps.append((per, rec))
                self._absorb_writes(results)
                t_ckpt = 0.0
                end = step + count
                if (cfg.checkpoint.every and end % cfg.checkpoint.every == 0) \
                        or end == cfg.train.max_steps:
                    try:
                        t_ckpt = self._save(end)
                    except WorkerFailure as failure:  # the span is lost with the snapshot
                        step = self._recover(failure, step, count)
                        continue
                for i, (per, rec) in enumerate(steps):
                    step += 1
                    ledger.write(step_record(step, self._parts(per)))
                    tps = self.tokens_per_step / elapsed
                    last = metrics.write(
                        "step", step=step, **rec, tokens=step * self.tokens_per_step,
                        tokens_per_s=tps, mfu=(tps * fpt / peak) if peak else 0.0,
                        time_data=max(r["time_data"] for r in per.values()),
                        time_compute=max(r["time_compute"] for r in per.values()),
                        time_checkpoint=t_ckpt if i == count - 1 else 0.0,
                        **self._pipeline(per))
                    self.productive_s += elapsed
                    if tb:
                        tb.write(last)
                    spike = self.spikes.check(rec["loss"])
                    if spike:
                        metrics.write("spike", step=step, message=spike)
                        warn(f"step {step}: {spike}")
                    self.recent_losses.append(rec["loss"])
                self._recovered(step)
                try:
                    if self.eval_ids and (step % cfg.eval.every == 0
                                          or step == cfg.train.max_steps):
                        heldout = self._evaluate(step, metrics, tb)
                    self._maybe_grow(step)
                except WorkerFailure as failure:
                    step = self._recover(failure, step)
                if bar is not None:
                    bar.set_postfix(loss=f"{last['loss']:.3f}", heldout=f"{heldout:.3f}",
                                    tok_s=f"{last.get('tokens_per_s', 0):,.0f}", refresh=False)
                    bar.n = step
                    bar.refresh()
            self._finish_writes(wait_storage=STORAGE_WAIT_S)
            wall = time.perf_counter() - t_run
            pids = {w: self.engine.pid(w) for w in self.members}
            return {"run_dir": cfg.run_dir, "steps": cfg.train.max_steps,
                    "resumed_from": start, "final_loss": last.get("loss"),
                    "final_heldout_loss": heldout, "checkpoint_step": self.last_committed,
                    "setup_s": setup_s, "peak_flops": peak, "peak_source": peak_src,
                    "recoveries": self.recovery_log, "goodput": self.productive_s / wall,
                    "wall_s": wall, "dp": self.dp, "generation": self.generation,
                    "pids": pids, "initial_pids": self.initial_pids,
                    "metrics": os.path.join(cfg.run_dir, "metrics.jsonl"),
                    "checkpoints": self.store.url}
        finally:
            self.faults.cancel()
            if bar is not None:
                bar.close()
            metrics.close()
            ledger.close()
            if tb:
                tb.close()
            self.engine.shutdown()

    def _worker_args(self) -> tuple:
        return (self.cfg.to_dict(), self.dataset.vocab_size)

    def _ledger_header(self, start: int) -> None:
        """At every start, resume and resize: the facts the audit recomputes the order from."""
        cfg = self.cfg
        self.ledger.write(header_record(
            seed=cfg.seed, global_batch=cfg.train.global_batch, micro_batch=cfg.train.micro_batch,
            seq_len=cfg.seq_len, n_instances=self.n_train, fingerprint=self.dataset.fingerprint,
            data_path=os.path.abspath(cfg.data.path), dp=self.dp))

    def _latest_step_readable(self) -> int:
        """The newest committed step (0 if none), after committing what is complete; while
        storage is unavailable (a transient error) it is waited for, up to STORAGE_WAIT_S,
        since restoring needs it and a deferred commit may hold the newest state."""
        deadline = time.monotonic() + STORAGE_WAIT_S
        warned = False
        while True:
            try:
                self._commit_ready()
                return self.store.latest_step() or 0
            except Exception as e:
                if not storage.is_transient(e) or time.monotonic() > deadline:
                    raise
                if not warned:
                    warn(f"checkpoint storage {storage.redact(self.store.url)} is unavailable "
                         f"({type(e).__name__}); waiting up to {STORAGE_WAIT_S:g}s to restore")
                    warned = True
                time.sleep(0.5)

    def _form_generation(self, step: int,
                         tensors: dict[int, dict[str, Any]] | None = None) -> float:
        """Join every member into a new process-group generation holding the state of `step`.

        `tensors` gives a state to some workers (replacements pulling a peer's snapshot); the
        others restore their own snapshot of `step`, or the checkpoint. Returns when the
        groups were formed (the rest is restoring state)."""
        assert self.engine is not None
        self.generation += 1
        timeout = self.cfg.runtime.setup_timeout
        host, port = self.engine.store_host(), None
        if len(self.members) > 1:
            import torch.distributed as dist

            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = self._store.port
        self.engine.call({w: ("setup", (self.generation, p, host, port,
                                        self.cfg.runtime.collective_timeout))
                          for w, p in self.placements().items()}, timeout)
        formed = time.time()
        self.engine.call({w: ("build", (step, (tensors or {}).get(w)))
                          for w in self.members}, timeout)
        return formed

    # ---- faults and recovery ---------------------------------------------------------------
    def _inject(self, first: int, last: int) -> None:
        assert self.engine is not None
        for fault in self.faults.due(first, last, ("fail_checkpoint",)):
            blocker = FaultInjector.block_checkpoint_dir(self.store.url, fault.step)
            if blocker:
                self.blockers.append(blocker)
        for fault in self.faults.due(first, last, ("storage_outage",)):
            seconds = self.cfg.faults.storage_outage_seconds
            if self.faults.storage_outage(self.store.url, seconds):
                warn(f"step {fault.step}: injected storage outage: {self.store.url} is "
                     f"unavailable for {seconds:g}s")
        for fault in self.faults.due(first, last, ("kill", "hang", "slow", "raise")):
            wid = self.members[fault.rank % len(self.members)]
            if fault.kind == "raise":
                self.engine.call({wid: ("arm_fault", (fault.step,))},
                                 self.cfg.runtime.call_timeout)
                self.faults.fired_at[self.engine.pid(wid)] = time.time()
            else:
                self.faults.signal_later(self.engine.pid(wid), fault.kind)

    def _recover(self, failure: WorkerFailure, done: int, in_flight: int = 1) -> int:
        """Replace what failed, re-form, restore the newest consistent state; the step to
        continue from (DESIGN.md "Recovery protocol"). `in_flight`: the steps of the failed
        dispatch (a whole span for an asynchronous pipeline), lost with it."""
        assert self.engine is not None
        t_detect = time.time()
        cfg = self.cfg
        pids = {w: self.engine.pid(w) for w in self.members}
        self.recovery_times.append(t_detect)
        window = [t for t in self.recovery_times if t > t_detect - cfg.elastic.recovery_window]
        if len(window) > cfg.elastic.max_recoveries:
            raise RecoveryLimitExceeded(
                f"{len(window)} recoveries within {cfg.elastic.recovery_window:.0f}s exceed "
                f"elastic.max_recoveries={cfg.elastic.max_recoveries}: stopping a crash loop "
                f"(last failure: {failure})")
        t_replace0 = time.time()
        failed: set[int] = set()
        if cfg.faults.hold_capacity_s > 0:  # taken before the failed worker's slot frees
            self.engine.hold_capacity(cfg.faults.hold_capacity_s)
        if not isinstance(failure, WorkerRaised):
            failed.add(failure.wid)
            self.engine.kill(failure.wid)  # a hung peer must go before its partners unblock
        # Abort the generation's collectives on every survivor now (runtime/abort.py), so none
        # waits for runtime.collective_timeout (the last resort); a replacement starts meanwhile.
        self.engine.abort([w for w in self.members if w not in failed], self.generation)
        self.engine.prestart()
        settled = self.engine.settle(cfg.runtime.collective_timeout + 5)
        failed |= {w for w, e in settled.items() if isinstance(e, WorkerDied | WorkerHung
                                                                  | NodeLost)}
        if not failed:  # only exceptions: the worker that raised first is the failure
            failed.add(failure.wid)
        elif isinstance(failure, WorkerRaised):
            # A collective error is collateral: name the worker that died or hung.
            failure = next(settled[w] for w in sorted(failed) if w in settled)
        rank = self.members.index(failure.wid) if failure.wid in self.members else -1
        fired = self.faults.fired_at.get(pids.get(failure.wid, -1))
        warn(f"step {done + 1}: worker rank {rank} (pid {pids.get(failure.wid, '?')}) "
             f"{failure.kind}: {failure.message}")
        for wid in failed:
            self.engine.kill(wid)
        survivors = [w for w in self.members if w not in failed]
        old = self.placements()
        # The newest consistent state: every survivor's snapshot of the last completed step
        # (taken at the start of the failed step), if each stage still has one; else storage.
        snaps = self.engine.call_all(survivors, "snapshot_step",
                                     timeout=cfg.runtime.call_timeout) if survivors else {}
        stages_left = {old[w].stage for w in survivors}
        memory_ok = (len(set(snaps.values())) == 1 and None not in snaps.values()
                     and stages_left == set(range(cfg.parallel.pp)))
        restore_step = next(iter(snaps.values())) if memory_ok else self._latest_step_readable()
        source = "memory" if memory_ok else "checkpoint"
        if not memory_ok:
            warn(f"no complete in-memory snapshot survived; restoring checkpoint step "
                 f"{restore_step} from {self.store.url}")
        new_members = list(self.members)
        replaced: dict[int, int] = {}  # new wid -> the old wid whose rank it takes
        shrunk = False
        for wid in [w for w in self.members if w in failed]:
            try:
                new = self.engine.spawn(self._worker_args(), cfg.elastic.replace_timeout)
            except WorkerFailure:
                shrunk = True
                break
            new_members[new_members.index(wid)] = new
            replaced[new] = wid
        if shrunk:
            for new in replaced:
                self.engine.kill(new)
            new_members, replaced = self._shrink(survivors), {}
        self.members = new_members
        tensors: dict[int, dict[str, Any]] = {}
        if memory_ok:
            for new, wid in replaced.items():
                donor = next(w for w in survivors if old[w].stage == old[wid].stage)
                tensors[new] = self.engine.call({donor: ("snapshot_tensors", (restore_step,))},
                                                cfg.runtime.call_timeout)[donor]
        t_reform0 = time.time()
        t_restore0 = self._form_generation(restore_step, tensors)
        t_done = time.time()
        lost = list(range(restore_step + 1, done + 1))
        if lost:
            self.ledger.write(rollback_record(lost, restore_step))
        if shrunk:
            self._ledger_header(restore_step)
        self.pending = [p for p in self.pending if p.step <= restore_step]
        self._pending_recovery = {
            "failed_step": done + 1, "rank": rank, "cause": failure.kind,
            "message": failure.message, "source": source, "dp": self.dp,
            "lost_steps": len(lost) + in_flight, "restored_step": restore_step,
            # detect: fault -> exception; replace: settle, kill, start replacements, pull
            # the snapshot; reform: new process groups; restore: rebuild from the state.
            "phases": {"detect": t_detect - fired if fired else None,
                       "replace": t_reform0 - t_replace0, "reform": t_restore0 - t_reform0,
                       "restore": t_done - t_restore0},
            "t_fault": fired or t_detect, "t_ready": t_done}
        return restore_step

    def _recovered(self, step: int) -> None:
        """After the first step following a recovery: record its timeline."""
        rec, self._pending_recovery = self._pending_recovery, None
        if rec is None:
            return
        now = time.time()
        rec["phases"]["first_step"] = now - rec.pop("t_ready")
        rec["total_s"] = now - rec.pop("t_fault")
        self.recovery_log.append(self.metrics.write("recovery", step=step, **rec))
        assert self.engine is not None
        self.engine.refill()

    def _shrink(self, survivors: list[int]) -> list[int]:
        """Continue on fewer workers with the same global batch: the largest DP size the
        survivors allow that splits the micro-batches evenly."""
        cfg = self.cfg
        if cfg.parallel.pp > 1:
            raise RecoveryLimitExceeded("no replacement could be placed within "
                                        f"elastic.replace_timeout={cfg.elastic.replace_timeout}s"
                                        " and a pipeline cannot run with a stage missing")
        fits = [d for d in range(len(survivors), 0, -1)
                if cfg.micro_batches % d == 0 and d >= cfg.elastic.min_workers]
        if not fits:
            raise RecoveryLimitExceeded(
                f"only {len(survivors)} worker(s) left and no replacement within "
                f"elastic.replace_timeout={cfg.elastic.replace_timeout}s; elastic.min_workers="
                f"{cfg.elastic.min_workers}")
        keep, extra = survivors[: fits[0]], survivors[fits[0]:]
        for wid in extra:
            self.engine.kill(wid)
        warn(f"no replacement within {cfg.elastic.replace_timeout:.0f}s: continuing on "
             f"{fits[0]} worker(s) with the same global batch")
        self.dp = fits[0]
        return keep

    def _maybe_grow(self, step: int) -> None:
        """Grow back to the configured DP size at a step boundary once capacity returns."""
        assert self.engine is not None
        if self.dp >= self.target_dp or step >= self.cfg.train.max_steps:
            return
        if not self.engine.has_capacity(0.2):
            return
        t0 = time.time()
        self.engine.call_all(self.members, "take_snapshot", step,
                             timeout=self.cfg.runtime.call_timeout)
        donor = self.members[0]
        state = self.engine.call({donor: ("snapshot_tensors", (step,))},
                                 self.cfg.runtime.call_timeout)[donor]
        added = []
        while len(self.members) + len(added) < self.target_dp * self.cfg.parallel.pp:
            try:
                added.append(self.engine.spawn(self._worker_args(), 0.2))
            except WorkerFailure:
                break
        d = max(x for x in range(1, len(self.members) + len(added) + 1)
                if self.cfg.micro_batches % x == 0)
        for wid in added[d - len(self.members):]:
            self.engine.kill(wid)
        added = added[: d - len(self.members)]
        if not added:
            return
        self.members += added
        self.dp = d
        self._form_generation(step, {w: state for w in added})
        self._ledger_header(step)
        self.metrics.write("resize", step=step, dp=self.dp, seconds=time.time() - t0)

    def _combine(self, step: int, results: dict[int, dict]) -> dict[str, Any]:
        """Step loss from every micro-batch's loss, summed in micro-batch order so the number
        does not depend on how micro-batches were split over ranks."""
        losses: dict[int, tuple[float, float, float]] = {}
        for r in results.values():
            losses.update({int(k): v for k, v in r["losses"].items()})
        m = self.cfg.micro_batches
        order = [losses[j] for j in range(m)]
        total = math.fsum(v[0] for v in order) / m
        ce = math.fsum(v[1] for v in order) / m
        z = math.fsum(v[2] for v in order) / m
        last_stage = [w for w, p in self.placements().items()
                      if p.stage == self.cfg.parallel.pp - 1]
        first = results[last_stage[0]]
        return {"loss": total, "ce_loss": ce, "z_loss": z, "grad_norm": first["grad_norm"],
                "lr": lr_at(step, self.cfg.optim, self.cfg.train.max_steps),
                "finite": all(r["finite"] for r in results.values())}

    def _parts(self, results: dict[int, dict]) -> list[list[int]]:
        parts: dict[int, list[int]] = {}
        for w, p in self.placements().items():
            if p.stage == 0:
                parts[p.dp_rank] = results[w]["ids"]
        return [parts[i] for i in range(self.dp)]

    def _pipeline(self, results: dict[int, dict]) -> dict[str, Any]:
        """pp > 1: every stage's pipeline measurements (its DP rank 0's) for the step record."""
        if self.cfg.parallel.pp == 1:
            return {}
        return {"pipeline": {str(p.stage): results[w]["pipeline"]
                             for w, p in self.placements().items() if p.dp_rank == 0}}

    # ---- checkpoints -----------------------------------------------------------------------
    def _save(self, step: int) -> float:
        assert self.engine is not None
        writers = self.writer_parts()
        t0 = time.perf_counter()
        self.engine.call({r: ("save", (step, part)) for r, part in writers.items()},
                         self.cfg.runtime.call_timeout)
        self.pending.append(PendingCheckpoint(step, expected=set(writers.values())))
        if not self.cfg.checkpoint.async_write:
            self._finish_writes()
        return time.perf_counter() - t0

    def _absorb_writes(self, results: dict[int, list[dict]]) -> None:
        for r in results.values():
            for w in r[-1]["written"]:
                self._record_write(w)
        self._commit_ready()

    def _record_write(self, w: dict[str, Any]) -> None:
        for p in self.pending:
            if p.step == w["step"]:
                if "error" in w:
                    p.failed = True
                    self._unblock(p.step)
                    warn(f"checkpoint step {p.step}: writing part {w['part']} failed "
                         f"({w['error']}); it will not be committed")
                else:
                    p.parts[w["part"]] = w["info"]

    def _unblock(self, step: int) -> None:
        """Remove an injected checkpoint-write fault once it has done its job."""
        for path in [b for b in self.blockers if b.endswith(f"step_{step:08d}")]:
            os.remove(path)
            self.blockers.remove(path)

    def _commit_ready(self) -> None:
        """Commit every checkpoint whose parts are all written. A commit that meets
        unavailable storage (a transient error: nothing was committed) stays pending and is
        tried again after the next step, so training does not wait for storage."""
        keep = []
        for p in self.pending:
            if p.failed:
                continue
            if set(p.parts) == p.expected:
                try:
                    self.store.commit(p.step, p.parts, self._manifest_meta(p.step))
                except Exception as e:
                    if not storage.is_transient(e):
                        raise
                    if not p.deferred:
                        warn(f"checkpoint step {p.step}: storage unavailable "
                             f"({type(e).__name__}: {storage.redact(str(e))}); the commit is "
                             "retried after the next step")
                    p.deferred = True
                    keep.append(p)
                    continue
                self.last_committed = p.step
            else:
                keep.append(p)
        self.pending = keep

    def _finish_writes(self, wait_storage: float = 0.0) -> None:
        """Wait for every checkpoint write and commit what is complete; commits deferred by
        unavailable storage are retried for up to `wait_storage` seconds."""
        assert self.engine is not None
        writers = list(self.writer_parts())
        done = self.engine.call_all(writers, "flush_writes", timeout=self.cfg.runtime.call_timeout)
        for ws in done.values():
            for w in ws:
                self._record_write(w)
        self._commit_ready()
        deadline = time.monotonic() + wait_storage
        while any(p.deferred for p in self.pending) and time.monotonic() < deadline:
            time.sleep(0.5)
            self._commit_ready()
        if not wait_storage:
            return
        for p in self.pending:
            if p.deferred:
                warn(f"checkpoint step {p.step}: storage still unavailable after "
                     f"{wait_storage:g}s; it was not committed")
            else:  # every write has returned: the missing parts went with a failed worker
                warn(f"checkpoint step {p.step}: parts {sorted(p.expected - set(p.parts))} "
                     "were lost with a failed worker; it was not committed")

    def _manifest_meta(self, step: int) -> dict[str, Any]:
        return {"model": self.model_cfg.to_dict(), "config": self.cfg.to_dict(),
                "data": {"batch_index": step, "fingerprint": self.dataset.fingerprint,
                         "n_instances": self.n_train, "seq_len": self.cfg.seq_len},
                # Nothing draws from global RNG state: init, data order and evaluation derive
                # from (seed, purpose, step), so the seed is the whole RNG state.
                "rng": {"seed": self.cfg.seed},
                "topology": {"dp": self.cfg.parallel.dp, "pp": self.cfg.parallel.pp}}

    # ---- evaluation ------------------------------------------------------------------------
    def _evaluate(self, step: int, metrics: MetricsLog, tb: TensorBoard | None) -> float:
        assert self.engine is not None
        results = self.engine.call_all(self.members, "evaluate", self.eval_ids,
                                       timeout=self.cfg.runtime.call_timeout)
        losses: dict[int, float] = {}
        for r in results.values():
            losses.update({int(k): v for k, v in r.items()})
        heldout = mean_loss(losses, self.eval_ids)
        recent = self.recent_losses[-max(1, self.cfg.eval.every):]
        train_loss = math.fsum(recent) / len(recent)
        rec = metrics.write("eval", step=step, tokens=step * self.tokens_per_step,
                            heldout_loss=heldout, heldout_ppl=math.exp(min(heldout, 50.0)),
                            train_loss=train_loss)
        if tb:
            tb.write(rec)
        message = self.alarm.update(train_loss, heldout)
        if message:
            metrics.write("alarm", step=step, message=message)
            warn(message)
            if self.cfg.eval.stop_on_alarm:
                raise TrainingStopped(f"stopped at step {step}: {message}")
        return heldout


def cli_train(args: Any) -> int:
    cfg = load_config(args.config, args.overrides)
    try:
        summary = Controller(cfg, quiet=args.json).run()
    except (TrainingStopped, RecoveryLimitExceeded) as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
              f"held-out loss {summary['final_heldout_loss']:.4f}")
        print(f"  metrics:     {summary['metrics']}")
        print(f"  checkpoints: {summary['checkpoints']} (step {summary['checkpoint_step']})")
        print(f"  plot:        relaytrain plot {cfg.run_dir}")
    return 0
