"""The one reader of a run directory's `metrics.jsonl` (docs/CONTRACTS.md "Run directory").

compare, plot and eval read runs through here so that they agree on what a run's curve is:
the last record per (kind, step) wins, because a step redone after a restore overrides the
rolled-back one; and a truncated last line (a run killed mid-write) is ignored, so a crashed
run can still be inspected.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relaytrain.errors import UserError

METRICS_FILE = "metrics.jsonl"
EVENT_KINDS = ("restart", "recovery", "alarm", "spike", "nan")


@dataclass(frozen=True)
class RunLog:
    """A run's records, split by kind: `steps` and `evals` one per step, sorted by step;
    `events` (restart, recovery, alarm, spike, nan) in the order they were written."""

    path: Path
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    events: list[dict[str, Any]]

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]], path: Path) -> RunLog:
        """Apply the last-record-per-(kind, step) rule to records already read from `path`."""
        by_kind: dict[str, dict[int, dict[str, Any]]] = {"step": {}, "eval": {}}
        events = []
        for rec in records:
            kind = rec.get("kind", "step")  # a record without a kind is a step
            if kind in by_kind:
                step = rec.get("step")
                if not isinstance(step, int) or isinstance(step, bool):
                    raise UserError(
                        f"{path}: a {kind!r} record without an integer 'step': {json.dumps(rec)}"
                    )
                by_kind[kind][step] = rec
            elif kind in EVENT_KINDS:
                events.append(rec)
        steps, evals = ([d[k] for k in sorted(d)] for d in by_kind.values())
        return cls(path, steps, evals, events)


def metrics_path(run_dir: str | os.PathLike[str]) -> Path:
    """`run_dir/metrics.jsonl`, or `run_dir` itself when it names the file."""
    p = Path(run_dir)
    if p.is_dir():
        return p / METRICS_FILE
    if p.name == METRICS_FILE or p.is_file():
        return p
    raise UserError(f"run directory not found: {p} (expected a directory with {METRICS_FILE})")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one per non-blank line.

    An unparsable *last* line is dropped (a writer killed mid-line); anywhere else it is an
    error naming the line.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise UserError(f"{p}: no such file") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise UserError(
                f"{p}:{n}: not valid JSON ({e.msg}); expected one object per line"
            ) from None
        if not isinstance(rec, dict):
            raise UserError(f"{p}:{n}: expected a JSON object, got {type(rec).__name__}")
        records.append(rec)
    return records


def read_metrics(run_dir: str | os.PathLike[str]) -> RunLog:
    """Read a run directory's (or a `metrics.jsonl` file's) records."""
    path = metrics_path(run_dir)
    return RunLog.from_records(read_jsonl(path), path)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def series(
    records: Sequence[dict[str, Any]], key: str, x: str = "step"
) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) float64 arrays of `key` against `x` over the records that carry both as numbers,
    in record order (records without the key, e.g. a step that logged no eval, are skipped)."""
    pts = [(r[x], r[key]) for r in records if _is_number(r.get(x)) and _is_number(r.get(key))]
    xy = np.array(pts, dtype=np.float64).reshape(-1, 2)
    return xy[:, 0].copy(), xy[:, 1].copy()
