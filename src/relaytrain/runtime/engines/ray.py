"""The Ray engine: one Ray actor per worker, placed with a placement group, `max_restarts=0`.

Ray is only the transport and the process manager here: the controller decides what to replace
(Ray Train's trainer loop would restart the whole group). With no address, a private local
cluster is started on 127.0.0.1 without a dashboard and with token authentication, and shut down
at the end; with `runtime.address` the same code joins an existing cluster.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from typing import Any

from relaytrain.config import RunConfig
from relaytrain.runtime.engines.base import Engine
from relaytrain.runtime.failures import (
    NodeLost,
    WorkerDied,
    WorkerFailure,
    WorkerHung,
    WorkerRaised,
)
from relaytrain.runtime.worker import Worker

PING_TIMEOUT = 2.0


class _RankedWorker(Worker):
    """The worker as a Ray actor; Ray prefixes its log lines with this repr (the rank)."""

    def __init__(self, rank: int, *args: Any):
        self.rank = rank
        super().__init__(*args)

    def __repr__(self) -> str:
        return f"Worker(rank={self.rank})"

    def ping(self) -> int:
        return os.getpid()


def _import_ray(private_cluster: bool) -> None:
    """Import Ray, first enabling token authentication for a private cluster.

    Ray reads RAY_AUTH_MODE when it is imported, so the secret (fresh per cluster, inherited by
    the processes Ray starts, never printed) must be in the environment before that; a cluster
    given by address keeps whatever its operator configured."""
    global ray, placement_group, remove_placement_group, PlacementGroupSchedulingStrategy
    if private_cluster and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


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
    if isinstance(err, NodeDiedError) or (isinstance(err, RayActorError)
                                          and "node" in text.lower() and "died" in text.lower()):
        return NodeLost(rank, text.splitlines()[0][:200])
    if isinstance(err, ActorDiedError | RayActorError | ActorUnavailableError):
        return WorkerDied(rank, str(err).splitlines()[0][:200])
    return WorkerRaised(rank, f"{type(err).__name__}: {err}")


class RayEngine(Engine):
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.actors: dict[int, Any] = {}
        self.groups: dict[int, Any] = {}
        self._pids: dict[int, int] = {}
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
            need = self.cfg.world_size * rt.cpus_per_worker
            ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)),
                     include_dashboard=False, _node_ip_address="127.0.0.1",
                     runtime_env={"env_vars": env}, log_to_driver=True,
                     configure_logging=False)
        else:
            ray.init(address=rt.address, runtime_env={"env_vars": env}, log_to_driver=True,
                     configure_logging=False)
        self._owns_cluster = True

    def start(self, ranks: list[int], worker_args: tuple) -> None:
        for rank in ranks:
            self._spawn(rank, worker_args)
        # Constructing the worker opens the data; wait so errors surface here, per rank.
        self.call_all(ranks, "info", timeout=self.cfg.runtime.setup_timeout)

    def _spawn(self, rank: int, worker_args: tuple) -> None:
        rt = self.cfg.runtime
        gpus = 1 if self.cfg.train.device == "cuda" else 0
        bundle = {"CPU": rt.cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        pg = placement_group([bundle], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=self.cfg.elastic.replace_timeout)
        if not ready:
            remove_placement_group(pg)
            raise WorkerDied(rank, f"no capacity to place a worker ({bundle}) within "
                             f"elastic.replace_timeout={self.cfg.elastic.replace_timeout}s")
        actor_cls = ray.remote(_RankedWorker).options(
            num_cpus=rt.cpus_per_worker, num_gpus=gpus, max_restarts=0, max_task_retries=0,
            max_concurrency=2,  # one thread answers ping() while another runs a step
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0))
        self.groups[rank] = pg
        self.actors[rank] = actor_cls.remote(rank, *worker_args)

    def call(self, calls: dict[int, tuple[str, tuple]], timeout: float) -> dict[int, Any]:
        refs = {getattr(self.actors[r], m).remote(*a): r for r, (m, a) in calls.items()}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._diagnose_hang([refs[p] for p in pending], timeout)
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                try:
                    results[refs[ref]] = ray.get(ref)
                except Exception as e:  # the first failure surfaces at once
                    raise _failure(refs[ref], e) from e
        return results

    def _diagnose_hang(self, ranks: list[int], timeout: float) -> WorkerFailure:
        """Which of the late ranks is hung, and which is only waiting on it in a collective?

        A stopped or deadlocked process cannot answer ping() on its second thread; a rank
        blocked in a collective with it can."""
        pings = {self.actors[r].ping.remote(): r for r in ranks}
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=PING_TIMEOUT)
        answered = set()
        for ref in done:
            try:
                ray.get(ref)
                answered.add(pings[ref])
            except Exception as e:
                return _failure(pings[ref], e)
        silent = [r for r in ranks if r not in answered]
        rank = silent[0] if silent else ranks[0]
        return WorkerHung(rank, f"no answer within the {timeout:.0f}s call deadline"
                          + ("" if silent else " (all late ranks answer pings: a slow step)"))

    def store_host(self) -> str:
        if self.cfg.runtime.address is None:
            return "127.0.0.1"
        return ray.util.get_node_ip_address()

    def pids(self) -> dict[int, int]:
        got = self.call_all(list(self.actors), "ping", timeout=self.cfg.runtime.call_timeout)
        return {r: int(p) for r, p in got.items()}

    def kill(self, rank: int) -> None:
        actor = self.actors.pop(rank, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        pg = self.groups.pop(rank, None)
        if pg is not None:
            remove_placement_group(pg)

    def shutdown(self) -> None:
        for rank in list(self.actors):
            try:
                ray.get(self.actors[rank].close.remote(), timeout=10)
            except Exception:  # a dead or hung worker has nothing to flush
                pass
            self.kill(rank)
        if self._owns_cluster:
            ray.shutdown()
            self._owns_cluster = False
