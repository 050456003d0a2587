"""Membership, recovery and elasticity: which workers form the run, and what happens when one
fails (docs/RECOVERY.md).

The workers of a run form a *generation*: one process-group layout, joined through a fresh
rendezvous. A failure ends the generation; `recover` is the one entry point. It names what
failed, replaces it with a worker that is up already (a warm spare, the standby) or else goes
on at once on the largest valid layout the survivors form, forms the next generation and
restores the newest consistent state: every survivor's in-memory snapshot if each stage still
has one, else the newest committed checkpoint. No survivor waits for a process to start unless
no smaller layout exists. Replacements start in the background meanwhile; `maybe_grow` adds them
at a step boundary once they are up, for up to `elastic.replace_timeout` after the failure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from relaytrain.config.sections import RunConfig
from relaytrain.errors import warn
from relaytrain.parallel.groups import (
    Placement,
    placements,
    replica_shards,
    shard_size,
    stage_members,
)
from relaytrain.parallel.pipeline.schedules import asynchronous
from relaytrain.parallel.shards import misaligned, parameter_shapes
from relaytrain.runtime import rendezvous
from relaytrain.runtime.catalogue import STORAGE_WAIT_S, CheckpointCatalogue
from relaytrain.runtime.engines.base import Engine, WorkerCall
from relaytrain.runtime.failures import (
    RecoveryLimitExceeded,
    WorkerFailure,
    WorkerRaised,
)
from relaytrain.runtime.faults import FaultInjector
from relaytrain.runtime.kvstore import Server
from relaytrain.runtime.reporter import StepReporter


@dataclass
class Restore:
    """Where the state after a failure comes from."""

    step: int
    source: str  # "memory" (survivors' snapshots) or "checkpoint"


def _rows_of(step: int, p: Placement) -> WorkerCall:
    """A holder's pieces of the rows a worker placed at `p` holds of the sharded state."""
    return lambda w: w.snapshot_rows(step, p.shards, p.shard)


class Recovery:
    def __init__(self, cfg: RunConfig, engine: Engine, worker_args: tuple,
                 catalogue: CheckpointCatalogue, reporter: StepReporter, faults: FaultInjector):
        self.cfg = cfg
        self.engine = engine
        self.worker_args = worker_args
        self.catalogue = catalogue
        self.reporter = reporter
        self.faults = faults
        self.members: list[int] = []  # worker id of each rank
        self.dp = self.target_dp = cfg.data_parallel  # data-parallel ranks: replicas x shards
        self.generation = -1
        self.initial_pids: dict[int, int] = {}
        self.recovery_times: list[float] = []
        self.log: list[dict[str, Any]] = []  # the recovery records written so far
        self._pending: dict[str, Any] | None = None  # completed by the next step
        self._store: Server | None = None  # this generation's rendezvous store
        self._layout: tuple[tuple, dict[int, Placement]] | None = None  # see placements()
        self._places: dict[int, tuple[Placement, ...]] = {}  # per DP size: each rank's place
        # each worker's place in the last generation it joined (a survivor that keeps it is
        # sent no other)
        self._joined: dict[int, Placement] = {}
        self._joining: list[int] = []  # workers up, not yet members (`maybe_grow`)
        self._grow_until = 0.0  # when the run stops trying to grow back (replace_timeout)
        self._shrunk_at: float | None = None  # the fault that took the run below its size

    # ---- layout ----------------------------------------------------------------------------
    def placements(self) -> dict[int, Placement]:
        """Worker id -> its place in the current generation (`parallel.groups.placements`);
        the same dict until the members or the DP size change (asked every step), and the same
        `Placement` objects for a rank until the DP size changes: a replacement in a failed
        worker's rank costs a recovery no new placements (at 1,024 workers, forming them took
        the controller a millisecond), and a survivor whose place is the same object kept it.
        Not to be modified."""
        key = (tuple(self.members), self.dp)
        if self._layout is None or self._layout[0] != key:
            if self.dp not in self._places:
                p = self.cfg.parallel
                ranks = range(len(self.members))
                self._places[self.dp] = tuple(placements(
                    ranks, self.dp, p.pp, shard_size(self.dp, p.fsdp), p.cp,
                    p.shard_over_cp).values())
            self._layout = key, dict(zip(self.members, self._places[self.dp], strict=True))
        return self._layout[1]

    def save_parts(self) -> dict[int, str]:
        """Worker id -> the checkpoint part it writes: DP rank 0 of every stage writes its
        stage's tensors (its cp rank 0: cp ranks hold the same); under sharding every shard of
        the first replica (its cp ranks' too) writes its own, all at once."""
        return {w: f"stage{p.stage}" + (f"-shard{p.shard}" if p.shards > 1 else "")
                for w, p in self.placements().items()
                if p.replica == 0 and (p.shards > 1 or p.cp_rank == 0)}

    # ---- generations -----------------------------------------------------------------------
    def start(self, step: int) -> None:
        """The run's first workers, holding the state after `step`."""
        self.members = self.engine.spawn_many(self.cfg.world_size, self.worker_args,
                                              self.cfg.runtime.setup_timeout)
        self.initial_pids = {w: self.engine.pid(w) for w in self.members}
        self.form_generation(step)

    def form_generation(self, step: int, tensors: dict[int, Any] | None = None) -> float:
        """Join every member into a new process-group generation holding the state of `step`.

        A member whose place is the one it joined the last generation at (a survivor of a
        failure replaced in its rank) is sent the same small call as every other such member,
        the new generation, its store and the step (one call object: checked once, pickled
        once by an engine that sends a call to many at once): it joins and restores its own
        state in that one call (`rejoin`; building takes no collective, so it need not wait
        for the others) and answers nothing new: the controller records the process it knows
        (the same worker id is the same process). The others are sent their place, report
        their process, and build in a second round, once all have joined.
        `tensors` gives a state to some workers (replacements pulling a peer's snapshot); the
        others restore their own snapshot of `step`, or the checkpoint. Returns when the
        groups were formed (the kept members' state restored too; the rest is restoring the
        others' state)."""
        self.generation += 1
        timeout = self.cfg.runtime.setup_timeout
        self.close()  # the previous generation's store: its keys are of no use to this one
        if len(self.members) > 1:
            self._store = rendezvous.serve(self.engine.store_host())
        store = self._store.access if self._store is not None else None
        generation, collective_timeout = self.generation, self.cfg.runtime.collective_timeout

        def setup(p: Placement | None) -> WorkerCall:
            return lambda w: w.setup(generation, p, store, collective_timeout)

        def build(t: dict[str, Any] | None) -> WorkerCall:
            return lambda w: w.build(step, t)

        tensors = tensors or {}
        placements, kept = self.placements(), self._joined
        placed = [w for w, p in placements.items() if kept.get(w) is not p]
        self._joined = {}  # until every member has joined this generation
        joined = self.engine.call({
            **dict.fromkeys(placements, lambda w: w.rejoin(generation, store,
                                                           collective_timeout, step)),
            **dict.fromkeys(tensors, setup(None)),
            **{w: setup(placements[w]) for w in placed}}, timeout)
        formed = time.time()
        self._joined = placements
        # Each rank's process as it reported itself: who survived a recovery can be checked. A
        # member that kept its place kept its rank in a world of the same size: the record
        # names the ranks joined anew, and the generation whose processes the others are
        # (`same_as`; at 1,024 workers re-writing them all cost a recovery a millisecond).
        ranks = {str(placements[w].rank): joined[w].process for w in placed}
        self.reporter.write("generation", generation=self.generation, step=step,
                            workers={r: {"pid": p.pid, "start": p.start}
                                     for r, p in ranks.items()},
                            same_as=self.generation - 1 if len(placed) < len(placements)
                            else None)
        # the others build once every member has joined: one call for those placed anew that
        # restore their own state
        self.engine.call({**dict.fromkeys(placed, build(None)),
                          **{w: build(t) for w, t in tensors.items()}}, timeout)
        return formed

    def close(self) -> None:
        """Close the current generation's rendezvous store (a worker still on it fails)."""
        if self._store is not None:
            self._store.close()
            self._store = None

    # ---- failures --------------------------------------------------------------------------
    def recover(self, failure: WorkerFailure, done: int, in_flight: int, ahead: int = 0) -> int:
        """Replace what failed, re-form, restore the newest consistent state; the step to
        continue from. `done`: the last step recorded; `in_flight`: the steps of the failed
        dispatch (a whole span for an asynchronous pipeline), lost with it; `ahead`: the
        steps dispatched after it (runtime/controller.py, dispatch ahead), discarded too."""
        t_detect, cpu0 = time.time(), time.process_time()
        self._check_limit(failure, t_detect)
        failed, failure = self._settle(failure)
        rank = self.members.index(failure.wid) if failure.wid in self.members else -1
        pid = self.engine.pid(failure.wid) if rank >= 0 else None
        fired = self.faults.fired_at.get(pid)
        warn(f"step {done + 1}: worker rank {rank} (pid {pid or '?'}) "
             f"{failure.kind}: {failure.message}")
        for wid in failed:
            self.engine.kill(wid)
        survivors = [w for w in self.members if w not in failed]
        old = self.placements()
        restore = self._restore_point(survivors, old)
        t_replace0 = time.time()
        replaced, shrunk, waited = self._replace(failed, t_detect)
        t_replaced = time.time()
        tensors = self._donations(replaced, survivors, old, restore)
        t_reform0 = time.time()
        t_restore0 = self.form_generation(restore.step, tensors)
        t_done = time.time()
        lost = range(restore.step + 1, done + 1)
        self.reporter.rollback(lost, restore.step)
        if shrunk:
            self.reporter.header(restore.step, self.dp)
            self._shrunk_at = self._shrunk_at or fired or t_detect
            self._grow_until = t_detect + self.cfg.elastic.replace_timeout
        self.catalogue.forget_after(restore.step)
        self._pending = {
            "failed_step": done + 1, "rank": rank, "cause": failure.kind,
            "message": failure.message, "source": restore.source, "dp": self.dp,
            "lost_steps": len(lost) + in_flight, "restored_step": restore.step,
            "discarded_ahead": ahead, "continued_on": len(self.members),
            # failed workers replaced: by workers up already, by ones waited for (`waited`)
            "replaced": len(replaced),
            # why the survivors waited for a process to start (None: they did not)
            "waited_for_replacement": waited,
            # detect: fault -> exception; replace: settle, kill, take replacements that are
            # up (or shrink), pull the snapshot; wait_replacement: of it, waiting for a process
            # to start; reform: new process groups; restore: rebuild from the state.
            "phases": {"detect": t_detect - fired if fired else None,
                       "replace": t_reform0 - t_detect,
                       "wait_replacement": t_replaced - t_replace0 if waited else 0.0,
                       "reform": t_restore0 - t_reform0, "restore": t_done - t_restore0},
            # the controller process's own CPU time in the recovery (detect to ready)
            "controller_cpu_s": time.process_time() - cpu0,
            "t_fault": fired or t_detect, "t_ready": t_done}
        return restore.step

    def _check_limit(self, failure: WorkerFailure, now: float) -> None:
        """Too many recoveries within elastic.recovery_window is a crash loop: stop."""
        el = self.cfg.elastic
        self.recovery_times.append(now)
        window = [t for t in self.recovery_times if t > now - el.recovery_window]
        if len(window) > el.max_recoveries:
            raise RecoveryLimitExceeded(
                f"{len(window)} recoveries within {el.recovery_window:.0f}s exceed "
                f"elastic.max_recoveries={el.max_recoveries}: stopping a crash loop "
                f"(last failure: {failure})")

    def _settle(self, failure: WorkerFailure) -> tuple[set[int], WorkerFailure]:
        """The workers that failed, and the failure to report: a collective error that a
        peer's death caused is collateral, the dead or hung peer is named instead."""
        failed: set[int] = set()
        if self.cfg.faults.hold_capacity_s > 0:  # the failed worker's slot, once it is killed
            self.engine.hold_capacity(failure.wid, self.cfg.faults.hold_capacity_s)
        if not isinstance(failure, WorkerRaised):
            failed.add(failure.wid)
            self.engine.retire(failure.wid)  # a hung peer must go before its partners unblock
        # Abort the generation's collectives on every survivor now (runtime/abort.py), so none
        # waits for runtime.collective_timeout (the last resort); a replacement starts meanwhile.
        self.engine.abort([w for w in self.members if w not in failed], self.generation)
        self.engine.prestart()
        gone = self.engine.settle(self.cfg.runtime.collective_timeout + 5)
        failed |= gone.keys()
        if not failed:  # only exceptions: the worker that raised first is the failure
            failed.add(failure.wid)
        elif isinstance(failure, WorkerRaised):
            failure = gone[min(gone)]
        return failed, failure

    def _restore_point(self, survivors: list[int], old: dict[int, Placement]) -> Restore:
        """Every survivor's snapshot of the last completed step, if every (stage, shard) still
        has one and they agree; else the newest checkpoint, once the survivors' writes in
        progress are done. A survivor whose failed step call carried its snapshot step
        (`Engine.carried_snapshots`) is not asked."""
        carried = self.engine.carried_snapshots()
        snaps = {w: carried[w] for w in survivors if w in carried}
        asked = [w for w in survivors if w not in snaps]
        if asked:
            snaps |= self.engine.call_all(asked, lambda w: w.snapshot_step(),
                                          self.cfg.runtime.call_timeout)
        # A stage's shard's rows: the same shard of the stage's other replicas holds them.
        missing = {(s, k) for s in range(self.cfg.parallel.pp)
                   for k in range(next(iter(old.values())).shards)}
        for w in survivors:  # until each is found: at once where there are many of each
            missing.discard((old[w].stage, old[w].shard))
            if not missing:
                break
        if len(set(snaps.values())) == 1 and None not in snaps.values() and not missing:
            return Restore(next(iter(snaps.values())), "memory")
        # The survivors' writes still in progress may complete the newest checkpoint (a failed
        # writer's finished part counts by its record): wait for them, as long as for storage
        # (a write stuck on unresponsive storage must not make its worker look hung).
        alive = set(survivors)
        writers = [w for w in self.save_parts() if w in alive]
        done = self.engine.call_all(writers, lambda w: w.flush_writes(STORAGE_WAIT_S),
                                    self.cfg.runtime.call_timeout)
        self.catalogue.record([r for reports in done.values() for r in reports])
        step = self.catalogue.latest_readable_step()
        warn(f"no complete in-memory snapshot survived; restoring checkpoint step {step} from "
             f"{self.catalogue.store.url}")
        return Restore(step, "checkpoint")

    def _replace(self, failed: set[int], t_detect: float
                 ) -> tuple[dict[int, int], bool, str | None]:
        """A worker that is up already in each failed worker's rank ({new: old}); short of
        that, the survivors (with the replacements that were up) go on at once on the largest
        valid layout they form (True), those it leaves out kept to join first and the others
        starting in the background for `maybe_grow`;
        where none exists, the replacements waited for until the failure's detection +
        elastic.replace_timeout, and why (the third value)."""
        members = list(self.members)
        replaced: dict[int, int] = {}
        for wid in [w for w in self.members if w in failed]:
            new = self._take_ready()
            if new is None:
                break
            members[members.index(wid)] = new
            replaced[new] = wid
        missing = [w for w in members if w in failed]
        if not missing:
            self.members = members
            return replaced, False, None
        # each stage's workers left, in rank order (a stage is dp x cp ranks)
        stages = [[w for w in stage if w not in failed] for stage in stage_members(
            members, self.dp, self.cfg.parallel.pp, self.cfg.parallel.cp)]
        why = self._why_not_shrink(min(map(len, stages)))
        if why is None:
            self.members = self._shrink(stages)
            kept = set(self.members)
            # those the layout leaves out (survivors, replacements that were up) are warm
            # processes: they wait to join, and growing back takes them first
            self._joining += [w for stage in stages for w in stage if w not in kept]
            self.engine.prestart(self.target_dp * self.cfg.parallel.pp - len(self.members)
                                 - len(self._joining))
            return {n: o for n, o in replaced.items() if n in kept}, True, None
        warn(f"waiting for a replacement: {why}")
        deadline = t_detect + self.cfg.elastic.replace_timeout
        for wid in missing:
            try:
                new = self.engine.spawn(self.worker_args, max(deadline - time.time(), 0.0))
            except WorkerFailure as e:
                for w in replaced:
                    self.engine.kill(w)
                raise RecoveryLimitExceeded(
                    f"no replacement could be placed within elastic.replace_timeout="
                    f"{self.cfg.elastic.replace_timeout}s ({e}), and {why}") from e
            members[members.index(wid)] = new
            replaced[new] = wid
        self.members = members
        return replaced, False, why

    def _take_ready(self) -> int | None:
        """A worker up now: one that came up for a growth still to be made, else the
        engine's (`Engine.spawn_ready`)."""
        if self._joining:
            return self._joining.pop(0)
        return self.engine.spawn_ready(self.worker_args)

    def _donations(self, replaced: dict[int, int], survivors: list[int],
                   old: dict[int, Placement], restore: Restore) -> dict[int, Any]:
        """From memory, each replacement loads a surviving peer's snapshot of its stage; in a
        sharded run, every worker whose rows changed pulls them (`_pull_rows`)."""
        if restore.source != "memory":
            return {}
        if self.cfg.parallel.shards > 1:
            return self._pull_rows(restore.step, survivors, old)
        out = {}
        for new, wid in replaced.items():
            donor = next(w for w in survivors if old[w].stage == old[wid].stage)
            out[new] = self.engine.call({donor: lambda w: w.snapshot_tensors(restore.step)},
                                        self.cfg.runtime.call_timeout)[donor]
        return out

    def _pull_rows(self, step: int, holders: list[int], old: dict[int, Placement]
                   ) -> dict[int, list[dict[str, Any]]]:
        """For each worker of the new layout whose rows of the sharded state changed (a
        replacement, or a survivor given another shard by a resize): the pieces of them in
        the snapshots of `step` that `holders` took under the `old` layout, one holder of each
        old shard of its stage asked (checkpoint/pieces.py; the worker assembles them)."""
        by_shard: dict[tuple[int, int], int] = {}
        for w in holders:
            by_shard.setdefault((old[w].stage, old[w].shard), w)
        held, out = set(holders), {}
        for w, p in self.placements().items():
            if w in held and (old[w].shards, old[w].shard) == (p.shards, p.shard):
                continue  # restores its own snapshot
            asked = [h for (stage, _), h in by_shard.items() if stage == p.stage]
            got = self.engine.call({h: _rows_of(step, p) for h in asked},
                                   self.cfg.runtime.call_timeout)
            out[w] = list(got.values())
        return out

    def recovered(self, step: int) -> None:
        """After the first step following a recovery: record its timeline."""
        rec, self._pending = self._pending, None
        if rec is None:
            return
        now = time.time()
        rec["phases"]["first_step"] = now - rec.pop("t_ready")
        rec["total_s"] = now - rec.pop("t_fault")
        self.log.append(self.reporter.write("recovery", step=step, **rec))
        self.engine.refill()

    # ---- elasticity ------------------------------------------------------------------------
    def _why_not_shrink(self, n: int) -> str | None:
        """Why `n` survivors of each stage form no smaller valid layout (None: they do)."""
        cfg = self.cfg
        pp = cfg.parallel.pp
        if pp > 1 and n == 0:
            return "a pipeline cannot run with a stage missing"
        if pp > 1 and cfg.parallel.fsdp > 1:
            return "a sharded pipeline's stages do not reshard"
        if cfg.parallel.cp > 1:
            return "a context-parallel run cannot run with part of its sequences"
        sizes = self._sizes(n)
        if pp > 1 and asynchronous(cfg.parallel.schedule) and not sizes:
            return (f"schedule {cfg.parallel.schedule} updates on each data-parallel rank's own "
                    "micro-batches: on fewer ranks its updates would change (it resizes only as "
                    "paci with parallel.paci.flush=true and an update per global batch)")
        if not any(d * pp >= cfg.elastic.min_workers for d in sizes):
            return (f"{n} worker(s) left" + (" of each stage" if pp > 1 else "") + " form no "
                    f"data-parallel size that splits the {cfg.micro_batches} micro-batches "
                    f"evenly with elastic.min_workers={cfg.elastic.min_workers}")
        return None

    def _shrink(self, stages: list[list[int]]) -> list[int]:
        """Continue on fewer workers with the same global batch: the largest DP size the
        survivors of every stage allow that splits the micro-batches evenly (a sharded run
        reshards onto them: `shard_size`; a pipeline drops the replicas it cannot fill);
        `_why_not_shrink` said there is one. The members, stage by stage."""
        pp = self.cfg.parallel.pp
        d = next(d for d in self._sizes(min(map(len, stages)))
                 if d * pp >= self.cfg.elastic.min_workers)
        warn(f"continuing at once on {d * pp} worker(s) with the same global batch; "
             f"replacements start in the background (for up to elastic.replace_timeout="
             f"{self.cfg.elastic.replace_timeout:g}s)")
        self.dp = d
        return [w for stage in stages for w in stage[:d]]  # the others wait to join

    def _sizes(self, n: int) -> list[int]:
        """Data-parallel sizes up to `n`, largest first, that split the micro-batches evenly,
        for a sharded run in exact mode shard into whole vectors (`misaligned`), and leave an
        asynchronous pipeline's updates as they were: each takes `a` backwards of a DP rank's
        micro-batches, so only one per global batch (paci with flush) is the same on any
        size."""
        cfg = self.cfg
        sizes = [d for d in range(n, 0, -1) if cfg.micro_batches % d == 0]
        p = cfg.parallel
        if p.schedule == "interleaved-1f1b" and p.pp > 1:
            sizes = [d for d in sizes if cfg.micro_batches // d % p.pp == 0]
        if asynchronous(p.schedule) and p.pp > 1:  # an update takes `a` of a DP rank's backwards
            sizes = [d for d in sizes if p.schedule == "paci" and p.paci.flush
                     and p.paci.a >= cfg.micro_batches // d]
        if cfg.determinism == "exact" and p.shards > 1:
            shapes = parameter_shapes(cfg.model_config())
            sizes = [d for d in sizes if misaligned(
                shapes, replica_shards(shard_size(d, p.fsdp), p.cp, p.shard_over_cp)) is None]
        return sizes

    def maybe_grow(self, step: int) -> None:
        """Below the configured size, at a step boundary: the replacements that are up join,
        once they make a larger valid DP size, their state taken from the members' snapshots
        of `step`; more are started in the background. Past elastic.replace_timeout after the
        failure, the run stops trying and goes on at its size."""
        cfg = self.cfg
        if self.dp >= self.target_dp or step >= cfg.train.max_steps:
            return
        want = self.target_dp * cfg.parallel.pp - len(self.members)
        while len(self._joining) < want and \
                (new := self.engine.spawn_ready(self.worker_args)) is not None:
            self._joining.append(new)
        pp = cfg.parallel.pp
        d = self._sizes((len(self.members) + len(self._joining)) // pp)[0]
        if d == self.dp:
            if time.time() > self._grow_until:
                self._give_up(step)
            else:
                self.engine.prestart(want - len(self._joining))
            return
        t0 = time.time()
        timeout = cfg.runtime.call_timeout
        self.engine.call_all(self.members, lambda w: w.take_snapshot(step), timeout)
        holders, old, dp = list(self.members), self.placements(), self.dp
        if cfg.parallel.shards == 1:  # each stage's first member gives its stage's state
            donors = [holders[s * dp] for s in range(pp)]
            state = self.engine.call_all(donors, lambda w: w.snapshot_tensors(step), timeout)
        grow = d - dp  # new DP ranks, on every stage
        added, self._joining = self._joining[:grow * pp], self._joining[grow * pp:]
        new = [added[s * grow:(s + 1) * grow] for s in range(pp)]
        self.members = [w for s in range(pp) for w in holders[s * dp:(s + 1) * dp] + new[s]]
        self.dp = d
        self.form_generation(step, self._pull_rows(step, holders, old) if cfg.parallel.shards > 1
                             else {w: state[donors[s]] for s in range(pp) for w in new[s]})
        self.reporter.header(step, self.dp)
        back = self.dp == self.target_dp and self._shrunk_at is not None
        # since_failure_s: from the fault that shrank the run until it is back at full size
        self.reporter.write("resize", step=step, dp=self.dp, seconds=time.time() - t0,
                            since_failure_s=time.time() - self._shrunk_at if back else None)
        if back:
            self._shrunk_at = None
        # the standby a growth took is started again now, as after a recovery: else the next
        # failure finds none and goes on shrunk while a process starts beside the survivors
        self.engine.refill()

    def _give_up(self, step: int) -> None:
        """elastic.replace_timeout passed without the run back at its size: the workers
        starting are let go, and the run goes on at its size."""
        for wid in self._joining:
            self.engine.kill(wid)
        self._joining = []
        self.engine.cancel_starts()
        warn(f"step {step}: no replacement came up within elastic.replace_timeout="
             f"{self.cfg.elastic.replace_timeout:g}s of the failure; continuing on "
             f"{len(self.members)} worker(s) for the rest of the run")
        self.target_dp = self.dp
        self._shrunk_at = None
