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
from typing import Any

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


def process_identity() -> dict[str, Any]:
    """This process as the OS knows it: its PID, its start time (clock ticks after boot, field
    22 of /proc/self/stat; a PID alone can be recycled, the pair names one process) and the
    host's boot (its random boot id: which host, and which boot of it)."""
    fields = _stat("self")
    start = int(fields[19]) if fields else 0
    return {"pid": os.getpid(), "start": start, "boot": _boot()}


def cpu_ticks(identity: Any) -> int | None:
    """The CPU time (user + system clock ticks) of the process `identity` names, if it runs on
    this host and is not stopped; None if it is stopped or traced, gone, or on another host (or
    another boot of this one), so that only the ping deadline can judge it."""
    if not isinstance(identity, dict) or identity.get("boot") is None:
        return None
    if identity["boot"] != _boot():
        return None
    fields = _stat(identity.get("pid", ""))
    if fields is None or int(fields[19]) != identity.get("start") or fields[0] in "Tt":
        return None
    return int(fields[11]) + int(fields[12])
