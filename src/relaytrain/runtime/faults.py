"""Fault injection: real signals and real storage errors at chosen or random steps.

Nothing here branches inside the training code: a kill is SIGKILL to the worker's process, a
hang is SIGSTOP, a slow worker is SIGSTOP then SIGCONT, and a failed checkpoint write is a real
filesystem error (a file standing where the step directory must be created).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np

from relaytrain.config import FaultsSection

FAULT_SEED_TAG = 0xFA17


@dataclass(frozen=True)
class Fault:
    step: int
    kind: str  # "kill" | "hang" | "slow" | "fail_checkpoint"
    rank: int


def plan_faults(cfg: FaultsSection, seed: int, max_steps: int, world: int) -> list[Fault]:
    """The run's faults, a pure function of the config and the seed."""
    rng = np.random.Generator(np.random.PCG64([seed, FAULT_SEED_TAG]))

    def rank(given: int | None) -> int:
        return int(given) if given is not None else int(rng.integers(world))

    faults = [Fault(s, "kill", rank(cfg.kill_rank)) for s in cfg.kill_at]
    faults += [Fault(s, "hang", rank(cfg.hang_rank)) for s in cfg.hang_at]
    faults += [Fault(s, "slow", rank(None)) for s in cfg.slow_at]
    faults += [Fault(s, "fail_checkpoint", 0) for s in cfg.fail_checkpoint_at]
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


class FaultInjector:
    """Delivers each planned fault once, shortly after its step is dispatched."""

    def __init__(self, faults: list[Fault], slow_seconds: float, delay: float = 0.02):
        self.pending = list(faults)
        self.slow_seconds = slow_seconds
        self.delay = delay
        self.fired_at: dict[int, float] = {}  # pid -> when it was signalled
        self._timers: list[threading.Timer] = []

    def due(self, first: int, last: int, kinds: tuple[str, ...]) -> list[Fault]:
        hits = [f for f in self.pending if first <= f.step <= last and f.kind in kinds]
        self.pending = [f for f in self.pending if f not in hits]
        return hits

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

        timer = threading.Timer(self.delay, fire)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    @staticmethod
    def block_checkpoint_dir(root: str, step: int) -> str | None:
        """A plain file where the step's directory will be created: the write fails for real.
        Local checkpoint roots only; returns the blocker path to remove afterwards."""
        if "://" in root and not root.startswith("file://"):
            return None
        path = os.path.join(root.removeprefix("file://"), f"step_{step:08d}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write("fault injection: this file blocks the checkpoint directory\n")
            return path
        return None

    def cancel(self) -> None:
        for t in self._timers:
            t.cancel()
