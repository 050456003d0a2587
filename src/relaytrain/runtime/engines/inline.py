"""The in-process engine: one worker living in the controller's process (dp = pp = 1)."""

from __future__ import annotations

import os
from typing import Any

from relaytrain.runtime.engines.base import Engine, Invocation
from relaytrain.runtime.worker import Worker


class InlineEngine(Engine):
    def __init__(self) -> None:
        self.worker: Worker | None = None

    def spawn(self, worker_args: tuple, wait: float) -> int:
        if self.worker is not None:
            raise RuntimeError("the inline engine runs exactly one worker")
        self.worker = Worker(*worker_args)
        return 0

    def run(self, invocations: dict[int, Invocation], timeout: float) -> dict[int, Any]:
        # In-process calls cannot be abandoned; a failure is an ordinary exception here.
        assert self.worker is not None
        return {w: getattr(self.worker, inv.method)(*inv.args, **inv.kwargs)
                for w, inv in invocations.items()}

    def pid(self, wid: int) -> int:
        return os.getpid()

    def kill(self, wid: int) -> None:
        raise RuntimeError("the inline engine cannot kill its only worker (use runtime.engine=ray)")

    def store_host(self) -> str:
        return "127.0.0.1"

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
