"""What the controller needs from an engine: start workers, call them with a deadline, stop
them. Workers are named by an id the engine hands out (a rank can move to another worker after a
resize); failures come back as `WorkerFailure` exceptions naming the worker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Engine(ABC):
    @abstractmethod
    def spawn(self, worker_args: tuple, wait: float) -> int:
        """Create one worker constructed with `worker_args`; its id. Raises `WorkerFailure` when
        it cannot be placed within `wait` seconds."""

    def spawn_many(self, n: int, worker_args: tuple, wait: float) -> list[int]:
        """`n` workers (an engine may start them concurrently)."""
        return [self.spawn(worker_args, wait) for _ in range(n)]

    @abstractmethod
    def call(self, calls: dict[int, tuple[str, tuple]], timeout: float) -> dict[int, Any]:
        """Run `method(*args)` on each worker concurrently; results by worker id.

        Raises the first `WorkerFailure` seen; the other calls may still be running
        (`settle` waits for them)."""

    def call_all(self, wids: list[int], method: str, *args: Any, timeout: float
                 ) -> dict[int, Any]:
        return self.call({w: (method, args) for w in wids}, timeout)

    def settle(self, timeout: float) -> dict[int, BaseException | None]:
        """Wait for calls still running after a failure: per worker, None if it finished, the
        failure if it failed or did not finish in time."""
        return {}

    def abort(self, wids: list[int], generation: int) -> None:
        """Ask each worker to abort `generation`'s collectives now, without waiting: a call
        blocked in one fails at once (runtime/abort.py). Engines of one worker have no peers
        to wait for."""
        return None

    def prestart(self) -> None:
        """Start a worker for the next `spawn` to take, so that a replacement's start-up
        overlaps the rest of a recovery. Engines without spares start it in `spawn`."""
        return None

    def refill(self) -> None:
        """Start standby spares again after some were promoted (off the recovery path).
        Engines without spares have nothing to do."""
        return None

    def has_capacity(self, wait: float) -> bool:
        """Whether one more worker could be placed now (for growing back after a shrink)."""
        return False

    def hold_capacity(self, seconds: float) -> None:
        """Occupy one worker's worth of resources for `seconds` (fault injection: a lost node
        whose capacity does not come back at once)."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold capacity")

    @abstractmethod
    def pid(self, wid: int) -> int:
        """The worker's process id (to deliver real signals in fault injection)."""

    @abstractmethod
    def kill(self, wid: int) -> None:
        """Forcefully end a worker (a hung one, or one being replaced)."""

    @abstractmethod
    def store_host(self) -> str:
        """The address workers use to reach the controller's TCPStore."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop all workers and release the engine's resources."""
