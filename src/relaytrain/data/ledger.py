"""The data ledger of a run (docs/CONTRACTS.md "Run directory"): which instance ids each DP rank
consumed at each step, every (re)start's order parameters, and the steps a restore discarded.

One JSON object per line, appended and flushed as training goes, so a crash loses at most the
line being written; a reader ignores such a torn last line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relaytrain.errors import DataError

LEDGER_FILE = "ledger.jsonl"


def header_record(*, seed: int, data_seed: int, global_batch: int, micro_batch: int,
                  seq_len: int, n_instances: int, fingerprint: str, data_path: str, dp: int,
                  order: str = "relay", eval_sets: dict[str, str] | None = None,
                  init: dict[str, Any] | None = None, wall: float | None = None,
                  packing: dict[str, Any] | None = None) -> dict[str, Any]:
    """Written at every start, resume and resize; `data_seed` is the order's seed (`seed` the
    initialisation's), `order` data.order, `eval_sets` the named evaluation sets (name -> data
    directory) the audit checks for contamination, `init` where step 0's weights came from
    (`init.origin`; None: the seed), `packing` how packed instances were packed (None:
    concatenated; `data.packing.train_split`)."""
    return {"kind": "header", "seed": int(seed), "data_seed": int(data_seed),
            "global_batch": int(global_batch), "micro_batch": int(micro_batch),
            "seq_len": int(seq_len),
            "n_instances": int(n_instances), "fingerprint": fingerprint,
            "data_path": str(data_path), "dp": int(dp), "order": order,
            "eval_sets": dict(eval_sets or {}), "init": init, "packing": packing,
            "wall": time.time() if wall is None else wall}


def step_record(step: int, parts: Sequence[Sequence[int] | np.ndarray],
                batch: int | None = None) -> dict[str, Any]:
    """Optimizer step `step` (1-based) consumed global batch `batch` (step - 1, unless the run
    continues another's data position: `init.trainer_state`); parts[r] are the ids DP rank r
    actually trained on."""
    batch = int(step) - 1 if batch is None else int(batch)
    # A list (a worker's StepResult.ids, Python ints) is taken as is: at 1,024 ranks of a few
    # ids each, a numpy array per rank cost the controller 10x more per step, an int() per id
    # 2x more.
    return {"kind": "step", "step": int(step), "batch": batch, "dp": len(parts),
            "parts": [p.astype(np.int64).tolist() if isinstance(p, np.ndarray) else list(p)
                      for p in parts]}


def rollback_record(steps: Sequence[int], to_step: int) -> dict[str, Any]:
    """Steps discarded by a restore to the state after `to_step`."""
    return {"kind": "rollback", "steps": [int(s) for s in steps], "to_step": int(to_step)}


class LedgerWriter:
    """Appends records to RUN_DIR/ledger.jsonl, one flushed line each."""

    def __init__(self, run_dir: str | os.PathLike[str], fsync: bool = False) -> None:
        self.path = Path(run_dir) / LEDGER_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
        self._fsync = fsync

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Ledger:
    records: list[dict[str, Any]]
    torn_tail: bool  # the last line was cut off by a crash and ignored


def read_ledger(path: str | os.PathLike[str]) -> Ledger:
    """All records; a DataError for a missing, unreadable or corrupt ledger."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no ledger (expected a run directory written by relaytrain "
                        "train)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the ledger ({e})") from None
    lines = text.split("\n")
    records, torn = [], False
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if lineno == len(lines) and not text.endswith("\n"):
                torn = True  # a crash mid-write: the step was never committed
                break
            raise DataError(f"{path}:{lineno}: corrupt ledger line ({e})") from None
        records.append(record)
    return Ledger(records, torn)
