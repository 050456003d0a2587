"""A process's CPU priority, every thread of it: the standby warms up at Linux's SCHED_IDLE
(it runs only on CPU time the training workers on the same cores leave), and is switched back
to SCHED_OTHER when it is promoted, before it trains.

Policies are per thread in Linux: a new thread inherits its creator's, so every thread listed
in /proc/self/task is switched, again until a pass finds none left (one started meanwhile by a
thread not yet switched). Where the kernel refuses or the OS has no SCHED_IDLE, the process
stays at its normal priority, with one warning: never a failure."""

from __future__ import annotations

import os
import warnings


def run_idle() -> bool:
    """This process's threads at SCHED_IDLE; False (and one warning) where not possible."""
    return _set_all(getattr(os, "SCHED_IDLE", None))


def run_normally() -> bool:
    """This process's threads back at SCHED_OTHER; False (and one warning) where refused."""
    return _set_all(getattr(os, "SCHED_OTHER", None))


def policies(pid: int | str = "self") -> dict[int, int]:
    """Each thread of process `pid` -> its scheduling policy (os.SCHED_*)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(t)] = os.sched_getscheduler(int(t))
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return out


def _set_all(policy: int | None) -> bool:
    try:
        if policy is None or not os.path.isdir("/proc/self/task"):
            raise OSError("no SCHED_IDLE / SCHED_OTHER policies on this OS")
        param = os.sched_param(0)
        for _ in range(5):
            left = [t for t, p in policies().items() if p != policy]
            if not left:
                return True
            for tid in left:
                try:
                    os.sched_setscheduler(tid, policy, param)
                except ProcessLookupError:  # the thread ended meanwhile
                    pass
        return True
    except OSError as e:
        warnings.warn(f"the standby's idle CPU priority is not available here ({e}): it warms "
                      "up at normal priority", RuntimeWarning, stacklevel=3)
        return False
