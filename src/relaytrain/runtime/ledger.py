"""The data ledger writer: which instance ids every step consumed, per data-parallel rank, and
which steps a restore rolled back. `relaytrain data audit` reads it (DESIGN.md "Data")."""

from __future__ import annotations

import json
import time
from typing import Any


class Ledger:
    def __init__(self, path: str):
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def _write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def header(self, **fields: Any) -> None:
        """Written at every start, resume and resize: the facts the audit recomputes from."""
        self._write({"kind": "header", **fields, "wall": time.time()})

    def step(self, step: int, parts: list[list[int]]) -> None:
        """`parts[r]`: the ids DP rank r reported consuming (not recomputed here)."""
        self._write({"kind": "step", "step": step, "batch": step - 1, "dp": len(parts),
                     "parts": parts})

    def rollback(self, steps: list[int], to_step: int) -> None:
        if steps:
            self._write({"kind": "rollback", "steps": steps, "to_step": to_step})

    def close(self) -> None:
        self._f.close()
