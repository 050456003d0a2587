"""A worker as the OS of its host knows it, and whether one whose ping is overdue still runs.

Why: a ping left unanswered for the ping deadline names a worker hung (stopped, deadlocked or
cut off). A process that a busy host leaves without the CPU (or its GIL) for that long is
neither, but was named hung all the same, and a recovery started for nothing: on 2 cores shared
by two test processes and their Ray workers, a worker mid-step went 2 s without answering. For
a worker on the controller's own host the OS tells them apart: a stopped process is in state T,
a deadlocked one uses no CPU, a starved one's CPU time still grows. Workers elsewhere have only
the ping deadline.
"""

from __future__ import annotations

import os
import signal
from typing import Any, NamedTuple

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3 onwards), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _boot() -> str | None:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return None


class ProcessIdentity(NamedTuple):
    """A process as the OS knows it: a PID alone can be recycled, the PID and start time name one
    process, and the boot says on which host (and which boot of it). A named tuple: every
    worker's answers carry one (1,024 unpickled per recovery at 1,024 workers)."""

    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/PID/stat); 0 where /proc is missing
    boot: str | None  # the host's random boot id; None where it cannot be read


def process_identity() -> ProcessIdentity:
    """This process's identity."""
    fields = _stat("self")
    start = int(fields[19]) if fields else 0
    return ProcessIdentity(pid=os.getpid(), start=start, boot=_boot())


def cpu_ticks(identity: Any) -> int | None:
    """The CPU time (user + system clock ticks) of the process `identity` names, if it runs on
    this host and is not stopped; None if it is stopped or traced, gone, or on another host (or
    another boot of this one), or no identity is known, so that only the ping deadline can judge
    it."""
    if not isinstance(identity, ProcessIdentity) or identity.boot is None:
        return None
    if identity.boot != _boot():
        return None
    fields = _stat(identity.pid)
    if fields is None or int(fields[19]) != identity.start or fields[0] in "Tt":
        return None
    return int(fields[11]) + int(fields[12])


def running(identity: ProcessIdentity) -> bool:
    """Whether the process `identity` names still runs on this host (this boot of it): not gone,
    not a recycled PID, not a zombie. False for a process elsewhere: ask only about this host's
    (`identity.boot` is ours)."""
    if identity.boot is None or identity.boot != _boot():
        return False
    fields = _stat(identity.pid)
    return fields is not None and int(fields[19]) == identity.start and fields[0] not in "ZX"


def kill_local(identity: ProcessIdentity) -> bool:
    """SIGKILL the process `identity` names if it runs on this host and is not this one;
    whether it was signalled."""
    if identity.pid == os.getpid() or not running(identity):
        return False
    try:
        os.kill(identity.pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True
