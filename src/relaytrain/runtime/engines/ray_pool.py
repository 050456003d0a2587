"""Work spread over a Ray cluster's nodes, results in order: `data prepare --address`.

One actor per worker (one CPU each, spread over the nodes), each building its function once
from a pickled factory; items are dealt round-robin and read back in their order
(`data.prepare.in_order`), so the output is the same as on one core. An actor that dies fails
the command (prepare then writes nothing: it is never half-written, and cheap to rerun). The
cluster is joined by address, before prepare writes anything, and left running; a private
cluster would only be this machine's cores, which `process_map` already uses.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from relaytrain.data.prepare import ChunkMap, in_order
from relaytrain.errors import DataError
from relaytrain.runtime.engines.ray_join import check_join

PLACE_S = 120.0  # the workers must all be placed within this


class _Mapper:
    def __init__(self, factory: Callable[[], Callable[[Any], Any]]) -> None:
        self.fn = factory()

    def where(self) -> tuple[str, int]:
        """This process's node and PID, asked of the process itself."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, item: Any) -> Any:
        return self.fn(item)


def _connect(address: str) -> None:
    """Join the cluster, or one line saying why not (Ray itself would retry for minutes)."""
    check_join(address, f"--address {address}", DataError)
    import ray

    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise DataError(f"--address {address}: cannot join the Ray cluster ({e})") from None


def ray_map(address: str) -> ChunkMap:
    """A `ChunkMap` on the Ray cluster at `address` ("auto": the one this node belongs to),
    joined now; 0 workers means one per CPU of the cluster."""
    _connect(address)

    def run(factory: Callable[[], Callable[[Any], Any]], items: Iterable[Any], workers: int,
            env: dict[str, str]) -> Iterator[Any]:
        import ray

        try:
            cpus = int(ray.cluster_resources().get("CPU", 0))
            n = workers or max(1, cpus)
            if n > cpus:
                raise DataError(f"--workers {n}: the Ray cluster at {address} has {cpus} CPUs "
                                "(one per worker); give at most that, or 0 for all")
            cls = ray.remote(num_cpus=1, max_restarts=0)(_Mapper).options(
                scheduling_strategy="SPREAD", runtime_env={"env_vars": env})
            actors = [cls.remote(factory) for _ in range(n)]
            try:
                where = ray.get([a.where.remote() for a in actors], timeout=PLACE_S)
            except ray.exceptions.GetTimeoutError:
                raise DataError(f"--workers {n}: not all placed on the Ray cluster at {address} "
                                f"within {PLACE_S:.0f}s (its CPUs are busy?)") from None
            print(f"relaytrain: encoding with {n} Ray workers on {len({w[0] for w in where})} "
                  f"nodes (PIDs {', '.join(str(w[1]) for w in where)})", file=sys.stderr)
            yield from in_order(lambda i, item: actors[i % n].run.remote(item), ray.get, items,
                                n)
        finally:
            ray.shutdown()

    return run
