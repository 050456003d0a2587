"""Preemption: SIGTERM or SIGINT to the controller (a job scheduler's or a spot instance's notice
before its hard kill, Ctrl-C) ends the run at the next step boundary with its newest state
committed, instead of losing every step since the last checkpoint.

The first signal only sets the notice: the step in flight finishes (its state is then the
newest consistent one, already in the workers' memory: nothing is recomputed), the controller
saves it and exits with PREEMPTED, which a scheduler can requeue on. `checkpoint.preempt_grace`
bounds it all: once the grace is spent, or at a second signal, the run stops at once (exit 128 +
the signal) with nothing more committed: its worker processes killed, the controller gone as
if SIGKILLed, which every log and checkpoint is made to survive (a manifest is written last and
whole, so a save cut short leaves no checkpoint a reader would load). Not by an exception: one
raised from a handler while the main thread waits inside Ray comes out as Ray's `SystemError`.

Why the handlers are installed again once the engine is up: at `ray.init` Ray's core worker
installs absl's failure signal handler in the driver, SIGTERM among its signals (it printed a
C-level stack dump, `logging.cc ... *** SIGTERM received`, and killed the process), and Ray's
node a Python SIGTERM handler that tears the local cluster down and exits 1. Python's handlers
set after them replace both, for SIGTERM and SIGINT only, so real crashes (SIGSEGV, SIGABRT,
...) keep Ray's dumps (`RAY_DISABLE_FAILURE_SIGNAL_HANDLER` would drop those too).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

# EX_TEMPFAIL (sysexits.h): stopped for a preemption notice with its state saved; run the same
# command again (requeue) to continue.
PREEMPTED = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped at a notice; the message says what was saved (one line)."""


class Notice:
    """The run's preemption notice: which signal came (None: none yet) and the grace left.

    In force as a context manager in the main thread (elsewhere it never fires); `reinstall`
    after anything (Ray) replaced the handlers. `on_stop` is called before a stop
    at once: it kills the workers and says where the run stands."""

    def __init__(self, grace: float):
        self.grace = grace
        self.signum: int | None = None
        self._deadline = float("inf")
        self.on_stop: Callable[[], str] = lambda: ""
        self.saved: str | None = None  # what the notice's save committed, once it is done
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    @property
    def received(self) -> bool:
        return self.signum is not None

    def left(self) -> float:
        """Seconds left of the grace (inf before a notice)."""
        return self._deadline - time.monotonic()

    def reinstall(self) -> None:
        """The handlers again, if this notice is in force (entered): after Ray's start."""
        if self._previous:
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    def __enter__(self) -> Notice:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            self._deadline = time.monotonic() + self.grace
            self._timer = threading.Timer(self.grace, self._expire)
            self._timer.daemon = True
            self._timer.start()
            _say(f"warning: {name} received: saving the newest completed step within "
                 f"checkpoint.preempt_grace={self.grace:g}s, then stopping (a second signal "
                 "stops at once)")
            return
        self.stop_at_once(f"a second {name}", 128 + signum)

    def _expire(self) -> None:
        """The grace is spent (on the timer's thread)."""
        self.stop_at_once(f"the save did not finish within checkpoint.preempt_grace="
                          f"{self.grace:g}s", 128 + (self.signum or signal.SIGTERM))

    def stop_at_once(self, reason: str, code: int) -> None:
        """Kill the workers, say so in one line, and end the process now with `code` (after the
        notice's save, while the workers were shut down: with PREEMPTED all the same). Also
        for a run whose lease was lost (runtime/lease.py), from the lease's thread."""
        try:
            where = self.on_stop()
        except Exception as e:  # the exit must happen all the same
            where = f"stopping the workers failed ({type(e).__name__}: {e})"
        if self.saved is not None:
            line, code = f"{self.saved} (workers stopped at once: {reason})", PREEMPTED
        else:
            line = f"stopped at once ({reason}): nothing more was committed" \
                + (f"; {where}" if where else "")
        _say(line)
        os._exit(code)


def _say(line: str) -> None:
    """One line on stderr, written past Python's buffered stream: a handler runs between two
    bytecodes of the main thread, which may be inside a write to that stream (a reentrant
    write raises)."""
    os.write(2, f"relaytrain: {line}\n".encode())
