"""An engine of in-memory workers whose failures a test scripts, to drive the recovery decisions
(memory or checkpoint, replace or shrink, grow, the recovery limit) in milliseconds. The
end-to-end behaviour with real processes is tested on Ray (test_elastic.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relaytrain.runtime.engines.base import Engine, Invocation
from relaytrain.runtime.failures import WorkerDied, WorkerFailure
from relaytrain.runtime.wire import ProcessIdentity, WorkerInfo, WriteReport


class FakeWorker:
    """Answers the calls recovery makes; `snapshot` is the step its in-memory snapshot holds."""

    def __init__(self, wid: int, snapshot: int | None):
        self.wid = wid
        self.snapshot = snapshot
        self.calls: list[str] = []
        self.built: tuple[int, Any] | None = None  # (step, tensors given) of the last build
        self.placement: Any = None
        self.writing: list[Callable[[], WriteReport]] = []  # checkpoint parts still being written

    def ping(self) -> ProcessIdentity:
        return ProcessIdentity(pid=1000 + self.wid, start=0, boot=None)

    def setup(self, generation: int, placement: Any, store: Any, timeout_s: float
              ) -> WorkerInfo | None:
        self.calls.append(f"setup{generation}")
        if placement is None:  # kept its place
            return None
        self.placement = placement
        return WorkerInfo(self.ping(), "fake", "cpu")

    def build(self, step: int, given: Any) -> int:
        self.built = (step, given)
        self.snapshot = step
        return step

    def rejoin(self, generation: int, store: Any, timeout_s: float, step: int) -> None:
        self.setup(generation, None, store, timeout_s)
        self.build(step, None)

    def snapshot_step(self) -> int | None:
        return self.snapshot

    def snapshot_tensors(self, step: int) -> dict[str, Any]:
        assert step == self.snapshot
        return {"from": self.wid, "step": step}

    def snapshot_rows(self, step: int, shards: int, shard: int) -> dict[str, Any]:
        assert step == self.snapshot
        return {"from": self.wid, "rows of shard": (shard, shards)}

    def take_snapshot(self, step: int) -> None:
        self.snapshot = step

    def flush_writes(self, timeout: float | None = None) -> list[WriteReport]:
        done, self.writing = [finish() for finish in self.writing], []
        return done


class FakeEngine(Engine):
    def __init__(self, snapshots: list[int | None], capacity: int = 10):
        self.workers = {w: FakeWorker(w, s) for w, s in enumerate(snapshots)}
        self.next_id = len(snapshots)
        self.capacity = capacity  # how many more workers can be placed
        self.settled: dict[int, WorkerFailure] = {}  # what settle() reports next
        self.killed: list[int] = []
        self.up_now = True  # whether a worker is up at once (else it is starting)
        self.prestarted = 0  # how many workers the last prestart() asked to start
        self.waited: list[float] = []  # each spawn() that waited for a start: its wait
        self.refills = 0  # refill() calls: a new standby started after one was taken

    def spawn_ready(self, worker_args: tuple) -> int | None:
        return super().spawn_ready(worker_args) if self.up_now else None

    def prestart(self, n: int = 1) -> None:
        self.prestarted = n

    def spawn(self, worker_args: tuple, wait: float) -> int:
        if wait:
            self.waited.append(wait)
        if self.capacity <= 0:
            raise WorkerDied(-1, "no capacity")
        self.capacity -= 1
        wid, self.next_id = self.next_id, self.next_id + 1
        self.workers[wid] = FakeWorker(wid, None)
        return wid

    def spawn_many(self, n: int, worker_args: tuple, wait: float) -> list[int]:
        return sorted(self.workers)[:n]

    def run(self, invocations: dict[int, Invocation], timeout: float) -> dict[int, Any]:
        return {w: getattr(self.workers[w], i.method)(*i.args, **i.kwargs)
                for w, i in invocations.items()}

    def settle(self, timeout: float) -> dict[int, WorkerFailure]:
        out, self.settled = self.settled, {}
        return out

    def refill(self) -> None:
        self.refills += 1

    def hold_capacity(self, wid: int, seconds: float) -> None:
        self.capacity = 0

    def pid(self, wid: int) -> int:
        return 1000 + wid

    def kill(self, wid: int) -> None:
        self.killed.append(wid)
        self.workers.pop(wid, None)

    def store_host(self) -> str:
        return "127.0.0.1"

    def shutdown(self) -> None:
        self.workers.clear()

