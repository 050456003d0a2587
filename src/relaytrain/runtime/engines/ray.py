"""The Ray engine: one Ray actor per worker, placed with a placement group, `max_restarts=0`.

Ray is only the transport and the process manager here: the controller decides what to replace
(Ray Train's trainer loop would restart the whole group). With no address, a private local
cluster is started without a dashboard and with token authentication, every process of it
listening on loopback only, and shut down at the end; with `runtime.address` the same code joins
an existing cluster.

It stays one file past ~550 lines because it is one thing, the `Engine` protocol in Ray's terms
(actors, placement groups, object refs, Ray's exceptions mapped to typed failures, the heartbeat
that pings the actors), whose helpers exist for `RayEngine` alone.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relaytrain.config.sections import RunConfig
from relaytrain.errors import ConfigError
from relaytrain.runtime.engines.base import Engine, Invocation, invocation
from relaytrain.runtime.engines.ray_join import check_join
from relaytrain.runtime.failures import (
    GONE,
    NodeLost,
    WorkerDied,
    WorkerFailure,
    WorkerHung,
    WorkerRaised,
    carried_snapshot,
)
from relaytrain.runtime.liveness import ProcessIdentity, cpu_ticks
from relaytrain.runtime.wire import SkipHistory, steps_from_wire, steps_to_wire
from relaytrain.runtime.worker import Worker

PING_TIMEOUT = 2.0  # a worker that leaves a ping unanswered this long is hung
STARVED_GRACE = 8.0  # ... unless it runs on this host and its CPU time grows: this long more
HEARTBEAT_S = 0.5  # a call running longer than this pings its workers this often
LOOPBACK = "127.0.0.1"
# The calls the heartbeat watches: steps, where a run spends its time. The others end at their
# deadline: a first build on a loaded machine can keep a worker from answering for seconds.
WATCHED = frozenset({"run_steps"})
CONTROL = "control"  # the actors' concurrency group of ping() and abort()


class _RankedWorker(Worker):
    """The worker as a Ray actor; Ray prefixes its log lines with this repr (id and rank)."""

    def __init__(self, wid: int, *args: Any):
        self.wid = wid
        super().__init__(*args)

    def __repr__(self) -> str:
        membership = getattr(self, "membership", None)
        placement = membership.placement if membership else None
        return f"Worker(id={self.wid}, rank={placement.rank if placement else '?'})"

    def run_steps(self, first: int, count: int, history: SkipHistory | None = None
                  ) -> list[tuple]:
        """`Worker.run_steps`'s results in their wire form (runtime/wire.py)."""
        return steps_to_wire(super().run_steps(first, count, history))


class _control:  # noqa: N801 (used as a function: `_control(actor).ping.remote()`)
    """An actor's methods on its control thread: ping() and abort() are answered there even
    while a step runs (or waits in a collective) on the other."""

    def __init__(self, actor: Any):
        self.actor = actor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.actor, name).options(concurrency_group=CONTROL)


def _import_ray(private_cluster: bool) -> None:
    """Import Ray, first enabling token authentication and loopback for a private cluster.

    Ray reads RAY_AUTH_MODE when it is imported, so the secret (fresh per cluster, inherited by
    the processes Ray starts, never printed) must be in the environment before that; a cluster
    given by address keeps whatever its operator configured. Ray also decides at import whether
    a node on 127.0.0.1 really stays there (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`): otherwise it
    swaps in the machine's external address, and its servers then listen on every interface.
    Where Ray was imported already (and no cluster is up), its cached mode and token are read
    again: else a token it loaded earlier (or none) would not be the one the new cluster's
    processes inherit, and the driver would be refused by its own cluster."""
    global ray, placement_group, remove_placement_group, PlacementGroupSchedulingStrategy
    imported = sys.modules.get("ray")
    if private_cluster and (imported is None or not imported.is_initialized()):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        if imported is not None:
            _reread_auth()
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def _reread_auth() -> None:
    """Ray's cached authentication mode and token, read again from the environment (Ray's own
    CLI refreshes its config the same way); nothing on a Ray without token authentication."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _placed(pg: Any) -> bool:
    """Whether a placement group holds its resources now (not pending, not being moved off a
    lost node). Asked of Ray's table: `pg.ready()` is a task that needs a worker to run."""
    return ray.util.placement_group_table(pg).get("state") == "CREATED"


def _reason(text: str) -> str:
    """The informative line of Ray's multi-line actor-death message."""
    for line in text.splitlines():
        if "because" in line:
            return line.strip().split(". ")[0][:200]
    return text.splitlines()[0][:200] if text else "unknown"


def _failure(rank: int, err: Exception) -> WorkerFailure:
    """Map Ray's exceptions to the controller's typed failures."""
    from ray.exceptions import (
        ActorDiedError,
        ActorUnavailableError,
        NodeDiedError,
        RayActorError,
        RayTaskError,
    )

    if isinstance(err, RayTaskError):
        cause = err.cause if getattr(err, "cause", None) is not None else err
        return WorkerRaised(rank, f"{type(cause).__name__}: {str(cause).splitlines()[0]}"
                            if str(cause) else type(cause).__name__)
    text = str(err)
    # Ray says "The actor is dead because its node has died" when the node went away, and
    # "... because its worker process has died" when only the process did.
    if isinstance(err, NodeDiedError) or (isinstance(err, RayActorError)
                                          and "because its node has died" in text):
        return NodeLost(rank, _reason(text))
    if isinstance(err, ActorDiedError | RayActorError | ActorUnavailableError):
        return WorkerDied(rank, _reason(text))
    return WorkerRaised(rank, f"{type(err).__name__}: {err}")


def _carried(err: Exception) -> tuple[int | None] | tuple[()]:
    """The snapshot step a worker's failed step call carried (`failures.carry_snapshot`),
    read off the error it raised inside Ray's."""
    from ray.exceptions import RayTaskError

    return carried_snapshot(err.cause if isinstance(err, RayTaskError)
                            and getattr(err, "cause", None) is not None else err)


def _outcomes(done: list[Any], owners: dict[Any, int],
              carried: dict[int, int | None] | None = None) -> dict[int, WorkerFailure | None]:
    """For each finished call in `done`, its worker (`owners`) -> None, or the failure it
    raised; the snapshot steps the failures carried go to `carried`."""
    out: dict[int, WorkerFailure | None] = {}
    for ref in done:
        try:
            ray.get(ref)
            out[owners[ref]] = None
        except Exception as e:
            out[owners[ref]] = _failure(owners[ref], e)
            if carried is not None and (step := _carried(e)):
                carried[owners[ref]] = step[0]
    return out


class _Starved:
    """Whether a worker whose ping is overdue since `sent` is starved rather than hung: on this
    host, not stopped, its CPU time grown since the last look HEARTBEAT_S or more ago (the
    first look grants that long), for at most STARVED_GRACE past the ping deadline
    (`runtime.liveness`). Anywhere else, or stopped, or not using CPU: hung at the deadline."""

    def __init__(self, identities: dict[int, ProcessIdentity]):
        self.identities = identities
        self.looks: dict[int, tuple[int, float]] = {}  # worker -> (CPU ticks, seen at)

    def __call__(self, w: int, now: float, sent: float) -> bool:
        ticks = cpu_ticks(self.identities.get(w))
        if ticks is None or now - sent >= PING_TIMEOUT + STARVED_GRACE:
            return False
        last = self.looks.get(w)
        if last is None or now - last[1] >= HEARTBEAT_S:
            self.looks[w] = (ticks, now)
            return last is None or ticks > last[0]
        return True

    def forget(self, w: int) -> None:
        """`w` answered: its next late ping starts looking afresh."""
        self.looks.pop(w, None)


class _Heartbeat:
    """Pings, every HEARTBEAT_S once a call has run that long, each worker the call still
    waits on. A worker busy in a step or blocked in a collective answers on its second thread;
    one that leaves a ping unanswered for PING_TIMEOUT is hung (stopped, deadlocked or cut
    off): named within seconds, not at the call's deadline, unless it is starved (`_Starved`):
    then it has up to STARVED_GRACE more. A ping late by HEARTBEAT_S calls `on_late` (once):
    a replacement can start while the deadline runs."""

    def __init__(self, actors: dict[int, Any], identities: dict[int, ProcessIdentity],
                 on_late: Callable[[], None]):
        self.actors = actors
        self.starved = _Starved(identities)
        self.on_late: Callable[[], None] | None = on_late
        self.pings: dict[int, tuple[Any, float]] = {}  # worker -> (its ping or None, sent at)
        self.start = time.monotonic()

    def check(self, wids: list[int]) -> WorkerFailure | None:
        now = time.monotonic()
        for w in wids:
            ref, sent = self.pings.get(w, (None, self.start))
            if ref is not None and ray.wait([ref], timeout=0)[0]:
                try:
                    ray.get(ref)
                except Exception as e:
                    return _failure(w, e)
                ref = None
            if ref is not None:
                if now - sent >= PING_TIMEOUT and not self.starved(w, now, sent):
                    return WorkerHung(w, f"no answer to a ping within {PING_TIMEOUT:g}s while "
                                      "its call ran (stopped, deadlocked or cut off)")
                if now - sent >= HEARTBEAT_S and self.on_late is not None:
                    self.on_late, on_late = None, self.on_late
                    on_late()
            elif now - sent >= HEARTBEAT_S:
                self.pings[w] = (_control(self.actors[w]).ping.remote(), now)
                self.starved.forget(w)
            else:
                self.pings[w] = (None, sent)
        return None


@dataclass
class _Started:
    """Calls started on actors (`start_all`), for `finish` to collect."""

    refs: dict[Any, int]  # object ref -> worker
    timeout: float
    watch: bool  # pinged by the heartbeat while it runs (WATCHED)
    steps: bool  # every call is run_steps: the answers are in the wire form (runtime/wire.py)


class RayEngine(Engine):
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.actors: dict[int, Any] = {}
        self.groups: dict[int, Any] = {}
        self._ids: dict[int, ProcessIdentity] = {}  # worker -> its process (ping's answer)
        self._next_id = 0
        # a placement group for the next worker: a failed worker's slot kept (`retire`), or one
        # asked for by `spawn_ready` for the standby, placed whenever capacity allows
        self._reserved: Any = None
        self._outstanding: dict[Any, int] = {}
        self._carried: dict[int, int | None] = {}  # see `carried_snapshots`
        self._started: list[_Started] = []  # calls started and not yet finished (in order)
        self._spares: list[int] = []
        self._standby: int | None = None  # see _start_standby
        self._warming: dict[int, Any] = {}  # spare -> its warm_up() call
        self._aborting: list[Any] = []  # abort() calls not yet collected
        self._worker_args: tuple | None = None
        self._held: dict[int, float] = {}  # worker -> seconds its slot outlives it
        self._owns_cluster = False
        self._connect()

    def _connect(self) -> None:
        rt = self.cfg.runtime
        _import_ray(private_cluster=rt.address is None)
        if ray.is_initialized():  # e.g. a test session's cluster: use it, leave it running
            return
        env = {"OMP_NUM_THREADS": str(rt.threads_per_worker),
               "MKL_NUM_THREADS": str(rt.threads_per_worker)}
        if rt.address is None:
            need = (self.cfg.world_size + self.cfg.elastic.spares) * rt.cpus_per_worker
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)),
                     include_dashboard=False, _node_ip_address=LOOPBACK,
                     runtime_env={"env_vars": env}, log_to_driver=True,
                     configure_logging=False)
            if ray.util.get_node_ip_address() != LOOPBACK:
                ray.shutdown()
                raise RuntimeError(
                    "the private Ray cluster would listen beyond loopback: Ray was imported "
                    "before relaytrain could configure it; set "
                    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment")
        else:
            check_join(rt.address, f"runtime.address={rt.address}", ConfigError)
            ray.init(address=rt.address, runtime_env={"env_vars": env}, log_to_driver=True,
                     configure_logging=False)
        self._owns_cluster = True

    def _bundle(self) -> dict[str, float]:
        gpus = 1 if self.cfg.train.device == "cuda" else 0
        return {"CPU": self.cfg.runtime.cpus_per_worker, **({"GPU": gpus} if gpus else {})}

    def _placement(self, wait: float | None) -> Any:
        """A placement group for one worker, once placed within `wait` seconds (else None);
        with `wait` None, at once, placed whenever capacity allows."""
        pg = placement_group([self._bundle()], strategy="PACK")
        if wait is None:
            return pg
        ready, _ = ray.wait([pg.ready()], timeout=wait)
        if not ready:
            remove_placement_group(pg)
            return None
        return pg

    def spawn(self, worker_args: tuple, wait: float) -> int:
        """A worker: a warm spare when one is ready (promotion costs nothing), else a new one.
        Spares are refilled in the background up to `elastic.spares`. A spare still starting
        (see `prestart`) is waited for within the same `wait`."""
        self._worker_args = worker_args
        deadline = time.monotonic() + wait
        while self._spares:
            wid = self._spares.pop(0)
            if self._ready(wid, deadline):
                return wid  # the controller refills spares once training runs again
            self.kill(wid)
        wid = self._promote_standby(deadline)
        if wid is not None:
            return wid
        wid = self._create(worker_args, max(deadline - time.monotonic(), 0.0))
        if wid is None:
            raise WorkerDied(-1, f"no capacity to place a worker ({self._bundle()}) within "
                             f"{wait:.0f}s")
        # Construction opens the data: wait, so its errors surface here, naming the worker.
        self._ids[wid] = self.call({wid: lambda w: w.ping()},
                                   self.cfg.runtime.setup_timeout)[wid]
        self._refill()
        return wid

    def spawn_ready(self, worker_args: tuple) -> int | None:
        """A spare whose warm-up is done, else the warm standby once a slot is placed for it
        (asked for here, placed whenever capacity allows); None at once otherwise: nothing
        here waits for a process to start or for capacity."""
        self._worker_args = worker_args
        for wid in [w for w in self._spares if self._warm(w)]:
            self._spares.remove(wid)
            if self._ready(wid, time.monotonic()):
                return wid
            self.kill(wid)
        wid = self._standby
        if wid is None or not self._warm(wid):
            return None
        if self._reserved is None:
            self._reserved = self._placement(None)
        return self._promote_standby(time.monotonic()) if _placed(self._reserved) else None

    def _warm(self, wid: int) -> bool:
        """Whether a spare's or the standby's warm-up has ended (well or not), without waiting."""
        return bool(ray.wait([self._warming[wid]], timeout=0)[0])

    def _ready(self, wid: int, deadline: float) -> bool:
        """Whether a spare or the standby is up (answers a ping, warmed up) by `deadline` (or
        within a second)."""
        ping, warm = _control(self.actors[wid]).ping.remote(), self._warming.pop(wid)
        ready, _ = ray.wait([ping, warm], num_returns=2,
                            timeout=max(deadline - time.monotonic(), 1.0))
        try:
            if len(ready) == 2:
                self._ids[wid] = ray.get(ping)
                ray.get(warm)
                return True
        except ray.exceptions.RayError:
            pass
        return False

    def _start_standby(self) -> None:
        """An idle worker process started ahead (`elastic.standby`): Python and torch imported,
        the data opened, the model built, but no CPU or GPU reserved (Ray resources 0), so it
        costs the run only the host memory of one more process. A replacement becomes it,
        in a placement group placed for it (`_promote_standby`), instead of starting from
        nothing: seconds saved on every recovery. CPU runs only: Ray gives a GPU only to an
        actor that reserved it at creation. Not beside warm spares (`elastic.spares`): they
        already are started workers."""
        if (not self.cfg.elastic.standby or self.cfg.elastic.spares or self._standby is not None
                or self._worker_args is None or "GPU" in self._bundle()):
            return
        wid = self._new_actor(self._worker_args, num_cpus=0)
        self._warming[wid] = self.actors[wid].warm_up.remote()
        self._standby = wid

    def _promote_standby(self, deadline: float) -> int | None:
        """The standby as a new worker, in a placement group placed by `deadline` that keeps
        the worker's resources reserved for it; None without a standby or capacity (the
        standby stays for the next time) or if it failed."""
        wid = self._standby
        if wid is None:
            return None
        pg = self._slot(max(deadline - time.monotonic(), 0.0))
        if pg is None:
            return None
        self._standby = None
        if not self._ready(wid, deadline):
            self.kill(wid)
            self._reserved = pg  # for a new worker instead
            return None
        self.groups[wid] = pg
        return wid  # a new standby starts with `refill`, once training runs again

    def spawn_many(self, n: int, worker_args: tuple, wait: float) -> list[int]:
        """Start all at once: process start-up and imports overlap."""
        self._worker_args = worker_args
        wids = []
        for _ in range(n):
            wid = self._create(worker_args, wait)
            if wid is None:
                for w in wids:
                    self.kill(w)
                raise WorkerDied(-1, f"no capacity to place {n} workers ({self._bundle()} each) "
                                 f"within {wait:.0f}s")
            wids.append(wid)
        self._ids.update(self.call_all(wids, lambda w: w.ping(), self.cfg.runtime.setup_timeout))
        self.refill()
        return wids

    def refill(self) -> None:
        self._refill()
        self._start_standby()

    def prestart(self, n: int = 1) -> None:
        """Start workers now for the next `spawn` or `spawn_ready` to take, up to `n` with the
        spares ready or starting and the standby: after a failure (or a late ping) their
        start-up overlaps the detection, the abort and the restore, or the survivors' steps.
        Each is placed whenever capacity allows (a failed worker's slot may still be in use);
        one not needed stays a spare."""
        if self._worker_args is None:
            return
        for _ in range(n - len(self._spares) - (self._standby is not None)):
            wid = self._create(self._worker_args, None)
            self._warming[wid] = self.actors[wid].warm_up.remote()
            self._spares.append(wid)

    def cancel_starts(self) -> None:
        """The spares beyond `elastic.spares` killed, a slot asked for and not placed given
        up."""
        for wid in self._spares[self.cfg.elastic.spares:]:
            self.kill(wid)
        if self._reserved is not None and not _placed(self._reserved):
            remove_placement_group(self._reserved)
            self._reserved = None

    def _refill(self) -> None:
        while len(self._spares) < self.cfg.elastic.spares and self._worker_args is not None:
            wid = self._create(self._worker_args, 0.5)
            if wid is None:
                return
            self._warming[wid] = self.actors[wid].warm_up.remote()
            self._spares.append(wid)

    def _create(self, worker_args: tuple, wait: float | None) -> int | None:
        """Start an actor in its own placement group without waiting for it to come up
        (`wait`: as for `_placement`)."""
        pg = self._slot(wait)
        if pg is None:
            return None
        wid = self._new_actor(worker_args, num_cpus=self.cfg.runtime.cpus_per_worker,
                              num_gpus=self._bundle().get("GPU", 0),
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  placement_group=pg, placement_group_bundle_index=0))
        self.groups[wid] = pg
        return wid

    def _new_actor(self, worker_args: tuple, **options: Any) -> int:
        wid = self._next_id
        self._next_id += 1
        # Calls run one at a time, in the order started (a step dispatched ahead waits behind
        # the one before it); ping() and abort() have a thread of their own (`_control`).
        actor_cls = ray.remote(concurrency_groups={CONTROL: 1})(_RankedWorker).options(
            max_restarts=0, max_task_retries=0, max_concurrency=1,
            **options)
        self.actors[wid] = actor_cls.remote(wid, *worker_args)
        return wid

    def _slot(self, wait: float | None) -> Any:
        """The reserved placement group (taken), else a new one: as for `_placement`, a
        reserved one not placed within `wait` given up."""
        pg, self._reserved = self._reserved, None
        if pg is None:
            return self._placement(wait)
        if wait is None or _placed(pg) or ray.wait([pg.ready()], timeout=wait)[0]:
            return pg
        remove_placement_group(pg)
        return None

    def hold_capacity(self, wid: int, seconds: float) -> None:
        """See `Engine.hold_capacity`: the worker's own placement group outlives it. (A new
        one placed in its stead waited 0.1-1 s for Ray to take back the killed process's
        CPUs, inside the recovery it was to make wait for nothing.)"""
        self._held[wid] = seconds

    def run(self, invocations: dict[int, Invocation], timeout: float) -> dict[int, Any]:
        """See `Engine.call`. In a WATCHED call, a worker that stops answering pings is named
        hung within PING_TIMEOUT (+ HEARTBEAT_S), not at the deadline."""
        return self.finish(self._start(invocations, timeout))

    def start_all(self, wids: list[int], call: Callable, timeout: float) -> _Started:
        inv = invocation(call)
        return self._start(dict.fromkeys(wids, inv), timeout)

    def _start(self, invocations: dict[int, Invocation], timeout: float) -> _Started:
        refs = {getattr(self.actors[w], inv.method).remote(*inv.args, **inv.kwargs): w
                for w, inv in invocations.items()}
        methods = {i.method for i in invocations.values()}
        started = _Started(refs, timeout, not methods.isdisjoint(WATCHED),
                           methods == {"run_steps"})
        self._started.append(started)
        return started

    def finish(self, started: _Started) -> dict[int, Any]:
        """See `Engine.finish`: the deadline and the heartbeat start now (a call started ahead
        waited behind the one before it)."""
        self._started.remove(started)
        refs, results = started.refs, {}
        deadline = time.monotonic() + started.timeout
        pending = list(refs)
        heartbeat = _Heartbeat(self.actors, self._ids, self.prestart) if started.watch else None
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._abandon({p: refs[p] for p in pending})
                raise self._diagnose_hang([refs[p] for p in pending], started.timeout)
            done, pending = ray.wait(pending, num_returns=1, timeout=min(left, HEARTBEAT_S))
            for ref in done:
                try:
                    results[refs[ref]] = ray.get(ref)
                except Exception as e:  # the first failure surfaces at once
                    self._abandon({p: refs[p] for p in pending})
                    if step := _carried(e):
                        self._carried[refs[ref]] = step[0]
                    raise _failure(refs[ref], e) from e
            failure = heartbeat.check([refs[p] for p in pending]) if heartbeat else None
            if failure is not None:
                self._abandon({p: refs[p] for p in pending})
                raise failure
        if started.steps:
            return dict(zip(results, steps_from_wire(results.values()), strict=True))
        return results

    def _abandon(self, pending: dict[Any, int]) -> None:
        """After a failure: the calls `settle` waits for, those started after it included
        (the snapshot steps carried start afresh)."""
        self._outstanding = dict(pending)
        self._carried = {}
        for later in self._started:
            self._outstanding.update(later.refs)
        self._started = []

    def abort(self, wids: list[int], generation: int) -> None:
        """Ask each worker to abort `generation`'s collectives; no waiting (the answers are
        collected by `settle`)."""
        self._aborting += [_control(self.actors[w]).abort.remote(generation) for w in wids
                           if w in self.actors]

    def settle(self, timeout: float) -> dict[int, WorkerFailure]:
        """Calls still running after a failure: a worker that cannot answer a ping is hung and
        is not waited for (a SIGSTOPped peer would otherwise cost the whole `timeout`); the
        others get up to `timeout` to finish."""
        out: dict[int, BaseException | None] = {}
        refs, self._outstanding = self._outstanding, {}
        if not refs:
            self._collect_aborts()
            return {}
        deadline = time.monotonic() + timeout
        gone = {w: e for w, e in self._ping(list(refs.values())).items() if e is not None}
        out.update(gone)
        rest = [r for r, w in refs.items() if w not in gone]
        done, late = ray.wait(rest, num_returns=len(rest),
                              timeout=max(0.0, deadline - time.monotonic()))
        out.update(_outcomes(done, refs, self._carried))
        for ref in late:
            out[refs[ref]] = WorkerHung(refs[ref], f"still busy {timeout:.0f}s after a peer "
                                        "failed")
        self._collect_aborts()
        return {w: e for w, e in out.items() if isinstance(e, GONE)}

    def carried_snapshots(self) -> dict[int, int | None]:
        carried, self._carried = self._carried, {}
        return carried

    def _collect_aborts(self) -> None:
        """Retrieve the abort() answers that came (a dead worker's error is expected, and Ray
        would log it as unhandled); a stopped worker's never comes and is dropped."""
        aborting, self._aborting = self._aborting, []
        ready, _ = ray.wait(aborting, num_returns=len(aborting), timeout=0) if aborting \
            else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass

    def _ping(self, wids: list[int]) -> dict[int, WorkerFailure | None]:
        """Ping each worker on its second thread: None if it answers. A stopped or deadlocked
        process cannot answer (hung, at PING_TIMEOUT), a dead one fails; a worker busy in a
        step or blocked in a collective answers, and one that is starved (`_Starved`: a busy
        host) gets up to STARVED_GRACE more. A worker on a node Ray has not yet declared dead
        cannot answer either: it is named hung, and replaced all the same."""
        sent = time.monotonic()
        pings = {_control(self.actors[w]).ping.remote(): w for w in wids}
        starved = _Starved(self._ids)
        out: dict[int, WorkerFailure | None] = {}
        pending, wait = list(pings), PING_TIMEOUT
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=wait)
            out.update(_outcomes(done, pings))
            now = time.monotonic()
            for ref in [r for r in pending if now - sent >= PING_TIMEOUT
                        and not starved(pings[r], now, sent)]:
                out[pings[ref]] = WorkerHung(pings[ref], f"no answer to a ping within "
                                             f"{PING_TIMEOUT:g}s (stopped, deadlocked or cut "
                                             "off)")
                pending.remove(ref)
            wait = HEARTBEAT_S
        return out

    def _diagnose_hang(self, wids: list[int], timeout: float) -> WorkerFailure:
        """Which of the late workers is hung, and which is only waiting on it in a collective?"""
        answers = self._ping(wids)
        dead = [e for e in answers.values() if e is not None and not isinstance(e, WorkerHung)]
        if dead:
            return dead[0]
        silent = [w for w in wids if answers[w] is not None]
        wid = silent[0] if silent else wids[0]
        return WorkerHung(wid, f"no answer within the {timeout:.0f}s call deadline"
                          + ("" if silent else " (every late worker answers pings: a slow step)"))

    def store_host(self) -> str:
        """Loopback for a private cluster; on an existing one, the address Ray uses for the
        controller's node (the one its workers already reach it at)."""
        if self.cfg.runtime.address is None:
            return LOOPBACK
        return ray.util.get_node_ip_address()

    def pid(self, wid: int) -> int:
        return self._ids[wid].pid

    def processes(self) -> list[ProcessIdentity]:
        return list(self._ids.values())

    def retire(self, wid: int) -> None:
        """Kill the worker. With the standby ready to replace it, its placement group, if still
        placed where it was (not being moved off a lost node), is kept as the standby's slot
        (`_reserved`): a slot freed and placed again costs a recovery 0.3-0.6 s. Not for a new
        actor: it could start only once Ray has reclaimed the slot from the killed process,
        which for a stopped one takes seconds."""
        pg = self.groups.get(wid)
        keep = (self._standby is not None and pg is not None and self._reserved is None
                and wid not in self._held and _placed(pg))
        if keep:
            del self.groups[wid]
        self.kill(wid)
        if keep:
            self._reserved = pg

    def kill(self, wid: int) -> None:
        actor = self.actors.pop(wid, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        pg, held = self.groups.pop(wid, None), self._held.pop(wid, None)
        if pg is not None and held:
            timer = threading.Timer(held, remove_placement_group, (pg,))
            timer.daemon = True
            timer.start()
        elif pg is not None:
            remove_placement_group(pg)
        self._outstanding = {r: w for r, w in self._outstanding.items() if w != wid}
        if wid in self._spares:
            self._spares.remove(wid)
        if wid == self._standby:
            self._standby = None
        self._warming.pop(wid, None)

    def shutdown(self) -> None:
        for wid in list(self.actors):
            try:  # a spare (perhaps not even placed) has nothing to flush
                if wid not in self._spares and wid != self._standby:
                    ray.get(self.actors[wid].close.remote(), timeout=10)
            except Exception:  # a dead or hung worker has nothing to flush
                pass
            self.kill(wid)
        if self._reserved is not None:
            remove_placement_group(self._reserved)
            self._reserved = None
        if self._owns_cluster:
            ray.shutdown()
            self._owns_cluster = False
