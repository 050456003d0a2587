"""The in-process engine: one worker living in the controller's process (dp = pp = 1)."""

from __future__ import annotations

import os
from typing import Any

from relaytrain.runtime.engines.base import Engine
from relaytrain.runtime.worker import Worker


class InlineEngine(Engine):
    def __init__(self) -> None:
        self.worker: Worker | None = None

    def start(self, ranks: list[int], worker_args: tuple) -> None:
        if ranks != [0]:
            raise ValueError("the inline engine runs exactly one worker (rank 0)")
        self.worker = Worker(*worker_args)

    def call(self, calls: dict[int, tuple[str, tuple]], timeout: float) -> dict[int, Any]:
        # In-process calls cannot be abandoned; a failure is an ordinary exception here.
        assert self.worker is not None
        return {r: getattr(self.worker, m)(*a) for r, (m, a) in calls.items()}

    def store_host(self) -> str:
        return "127.0.0.1"

    def pids(self) -> dict[int, int]:
        return {0: os.getpid()}

    def kill(self, rank: int) -> None:
        raise RuntimeError("the inline engine cannot kill its only worker")

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
