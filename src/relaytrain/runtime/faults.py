"""Fault injection: real signals and real storage errors at chosen or random steps.

Nothing here branches inside the training code: a kill is SIGKILL to the worker's process, a
hang is SIGSTOP, a slow worker is SIGSTOP then SIGCONT, a failed checkpoint write is a real
filesystem error (a file standing where the step directory must be created), and a storage
outage makes the local checkpoint root a symbolic link to itself for a while, so every access
by any process fails with ELOOP (an OSError the writer retries as transient) until the real
directory is swapped back in (`renameat2(RENAME_EXCHANGE)`: atomic, so no writer can recreate
an empty root in between). A full disk (`faults.disk_full_at`) is a quota of the bytes the
local checkpoint root holds when it fires (and 64 KiB more), in a file beside the root that the
storage layer's local writes are charged against (`storage.charge_injected_quota`): a write
that would take the root past it fails with a real ENOSPC `OSError`, in every process, until
files are deleted (retention makes room) or the quota file is removed (`end_disk_full`: space
freed). It stays after the run, as a full disk does.

The one exception is `faults.raise_at`, a worker that raises. A genuine error from the real
data path cannot be aimed at one rank and one step from outside: every worker reads the same
token files through a memory map opened once (closing or removing the file changes nothing
for it) and a thread reads batches ahead. So the controller arms `RaiseHook` in the chosen
worker with an explicit call, and the worker raises `InjectedFault` when that step starts: the
only fault with a line in the worker, kept out of the training code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from relaytrain.config.sections import FaultsSection
from relaytrain.errors import UserError
from relaytrain.storage import FULL_SUFFIX, local_bytes

FAULT_SEED_TAG = 0xFA17
DISK_FULL_FREE = 64 << 10  # bytes a disk made full by faults.disk_full_at still takes
OUTAGE_SUFFIX = ".outage"  # where the real checkpoint root waits during an outage
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


@dataclass(frozen=True)
class Fault:
    step: int
    # "kill" | "hang" | "slow" | "raise" | "fail_checkpoint" | "storage_outage" | "disk_full"
    kind: str
    rank: int


def plan_faults(cfg: FaultsSection, seed: int, max_steps: int, world: int) -> list[Fault]:
    """The run's faults, a pure function of the config and the seed."""
    rng = np.random.Generator(np.random.PCG64([seed, FAULT_SEED_TAG]))

    def rank(given: int | None) -> int:
        return int(given) if given is not None else int(rng.integers(world))

    faults = [Fault(s, "kill", rank(cfg.kill_rank)) for s in cfg.kill_at]
    faults += [Fault(s, "hang", rank(cfg.hang_rank)) for s in cfg.hang_at]
    faults += [Fault(s, "slow", rank(None)) for s in cfg.slow_at]
    faults += [Fault(s, "raise", rank(cfg.raise_rank)) for s in cfg.raise_at]
    faults += [Fault(s, "fail_checkpoint", 0) for s in cfg.fail_checkpoint_at]
    faults += [Fault(s, "storage_outage", 0) for s in cfg.storage_outage_at]
    faults += [Fault(s, "disk_full", 0) for s in cfg.disk_full_at]
    n_random = cfg.random_kills + cfg.random_hangs
    if n_random:
        lo, hi = 2, max(3, max_steps)
        taken = {f.step for f in faults}
        choices = [s for s in range(lo, hi) if s not in taken]
        steps = sorted(rng.choice(choices, size=min(n_random, len(choices)), replace=False))
        kinds = ["kill"] * cfg.random_kills + ["hang"] * cfg.random_hangs
        rng.shuffle(kinds)
        faults += [Fault(int(s), k, rank(None)) for s, k in zip(steps, kinds, strict=False)]
    return sorted(faults, key=lambda f: (f.step, f.kind))


class InjectedFault(RuntimeError):
    """What a worker raises at a step of `faults.raise_at`."""


class RaiseHook:
    """The worker's side of `faults.raise_at`: armed by the controller for a step, it raises
    `InjectedFault` when a call runs that step, once."""

    def __init__(self) -> None:
        self.steps: set[int] = set()

    def arm(self, step: int) -> None:
        self.steps.add(step)

    def check(self, first: int, count: int) -> None:
        """Raise if one of steps first .. first+count-1 is armed."""
        due = sorted(s for s in self.steps if first <= s < first + count)
        if due:
            self.steps -= set(due)
            raise InjectedFault(f"injected by faults.raise_at at step {due[0]}")


class FaultInjector:
    """Delivers each planned fault once, shortly after its step is dispatched."""

    def __init__(self, faults: list[Fault], slow_seconds: float, delay: float = 0.02):
        self.pending = list(faults)
        self.slow_seconds = slow_seconds
        self.delay = delay
        self.fired_at: dict[int, float] = {}  # pid -> when it was signalled
        self._timers: list[threading.Timer] = []
        self._outages: set[str] = set()  # local checkpoint roots that are unavailable now
        self._blockers: list[str] = []  # files standing where checkpoint directories go
        self._lock = threading.Lock()

    def due(self, first: int, last: int, kinds: tuple[str, ...]) -> list[Fault]:
        hits = [f for f in self.pending if first <= f.step <= last and f.kind in kinds]
        self.pending = [f for f in self.pending if f not in hits]
        return hits

    def planned(self, first: int, last: int) -> bool:
        """Whether a fault of any kind is still to be delivered at steps first .. last."""
        return any(first <= f.step <= last for f in self.pending)

    def signal_later(self, pid: int, kind: str) -> None:
        """SIGKILL/SIGSTOP `pid` after a short delay, so it lands mid-step."""

        def fire() -> None:
            self.fired_at[pid] = time.time()
            try:
                if kind == "kill":
                    os.kill(pid, signal.SIGKILL)
                elif kind == "hang":
                    os.kill(pid, signal.SIGSTOP)
                elif kind == "slow":
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(self.slow_seconds)
                    os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

        self._later(self.delay, fire)

    def storage_outage(self, root: str, seconds: float) -> bool:
        """Make the local checkpoint root unavailable now and for `seconds`; False if it
        already is."""
        with self._lock:
            if root in self._outages:
                return False
            start_storage_outage(root)
            self._outages.add(root)
        self._later(seconds, self._end_outage, root)
        return True

    def _end_outage(self, root: str) -> None:
        with self._lock:
            if root in self._outages:
                self._outages.discard(root)
                end_storage_outage(root)

    def _later(self, seconds: float, fn: Callable[..., None], *args: object) -> None:
        timer = threading.Timer(seconds, fn, args)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def block_checkpoint(self, root: str, step: int) -> None:
        """A plain file where the step's directory will be created: the write fails for real.
        Local checkpoint roots only; `unblock` removes it once the failure was reported."""
        if "://" in root and not root.startswith("file://"):
            return
        path = os.path.join(root.removeprefix("file://"), f"step_{step:08d}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write("fault injection: this file blocks the checkpoint directory\n")
            self._blockers.append(path)

    def unblock(self, step: int) -> None:
        """Remove the blocker of `step`'s checkpoint, if any: it has done its job."""
        for path in [b for b in self._blockers if b.endswith(f"step_{step:08d}")]:
            os.remove(path)
            self._blockers.remove(path)

    def cancel(self) -> None:
        """Stop what has not fired yet and end outages in progress (storage is never left
        unavailable)."""
        for t in self._timers:
            t.cancel()
        for root in list(self._outages):
            self._end_outage(root)


def start_storage_outage(root: str) -> None:
    """Make the local directory `root` unusable: it becomes a symbolic link to itself (every
    access fails with ELOOP, "too many levels of symbolic links") while the real directory
    waits, untouched, at `root + OUTAGE_SUFFIX`."""
    root = root.removeprefix("file://").rstrip("/")
    aside = root + OUTAGE_SUFFIX
    os.makedirs(root, exist_ok=True)
    if os.path.islink(aside):  # left by an outage that failed to start
        os.unlink(aside)
    os.symlink(os.path.basename(root), aside)
    _exchange(root, aside)


def end_storage_outage(root: str) -> bool:
    """Swap the real directory back in; False if `root` is not in an outage. Idempotent, so a
    controller also heals an outage that a killed run left behind."""
    root = root.removeprefix("file://").rstrip("/")
    aside = root + OUTAGE_SUFFIX
    if not (os.path.islink(root) and os.path.isdir(aside) and not os.path.islink(aside)):
        return False
    _exchange(root, aside)
    os.unlink(aside)
    return True


def start_disk_full(root: str) -> int:
    """Make the local directory `root` full: from now on it may hold no more than the bytes
    it holds now and DISK_FULL_FREE more (a full disk keeps a little room: small files such
    as a manifest may still fit, a checkpoint's part does not); the quota."""
    root = root.removeprefix("file://").rstrip("/")
    quota = local_bytes(root) + DISK_FULL_FREE
    with open(root + FULL_SUFFIX, "w") as f:
        f.write(str(quota))
    return quota


def end_disk_full(root: str) -> bool:
    """Free the space of a disk made full by `start_disk_full`; False if it was not full."""
    try:
        os.remove(root.removeprefix("file://").rstrip("/") + FULL_SUFFIX)
    except FileNotFoundError:
        return False
    return True


def _exchange(a: str, b: str) -> None:
    """Swap two paths atomically (Linux `renameat2(RENAME_EXCHANGE)`)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        raise UserError("faults.storage_outage_at needs renameat2 (Linux with glibc >= 2.28) "
                        "to swap the checkpoint directory atomically; remove the key here")
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")
