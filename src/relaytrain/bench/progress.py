"""Progress of a running benchmark on stderr: which section, which repetition, how long so far.

Why: some benchmarks take minutes, and a silent one cannot be told from a hung one. stdout
stays the report's (and `--json`'s) alone.
"""

from __future__ import annotations

import sys
import time

_state = {"name": "bench", "t0": time.perf_counter()}


def start(name: str, plan: str) -> None:
    """Name the benchmark, reset its clock and state what it will do (sections, repetitions)."""
    _state.update(name=name, t0=time.perf_counter())
    report(f"start: {plan}")


def report(section: str, rep: int | None = None, of: int | None = None) -> None:
    """One line: `[bench NAME 12.3s] section (repetition rep/of)`."""
    where = f" (repetition {rep}/{of})" if rep is not None else ""
    print(f"[bench {_state['name']} {time.perf_counter() - _state['t0']:6.1f}s] {section}{where}",
          file=sys.stderr, flush=True)
