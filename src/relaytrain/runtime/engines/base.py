"""What the controller needs from an engine: start workers, call them with a deadline, stop
them. Failures come back as `WorkerFailure` exceptions naming the rank."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Engine(ABC):
    @abstractmethod
    def start(self, ranks: list[int], worker_args: tuple) -> None:
        """Create one worker per rank, each constructed with `worker_args`."""

    @abstractmethod
    def call(self, calls: dict[int, tuple[str, tuple]], timeout: float) -> dict[int, Any]:
        """Run `method(*args)` on each rank concurrently; results by rank.

        Raises the first `WorkerFailure` seen; every call has finished or been abandoned when it
        returns.
        """

    def call_all(self, ranks: list[int], method: str, *args: Any, timeout: float) -> dict[int, Any]:
        return self.call({r: (method, args) for r in ranks}, timeout)

    @abstractmethod
    def store_host(self) -> str:
        """The address workers use to reach the controller's TCPStore."""

    @abstractmethod
    def pids(self) -> dict[int, int]:
        """Worker process ids by rank."""

    @abstractmethod
    def kill(self, rank: int) -> None:
        """Forcefully end a worker (a hung one, or one being replaced)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop all workers and release the engine's resources."""
