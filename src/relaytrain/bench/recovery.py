"""`relaytrain bench recovery`: kill a worker N times in a tiny 4-worker run and report the
time from each kill to the next completed step, split by phase, and the steps lost.

Settings a user of tiny steps would choose: one warm spare (a replacement is a promotion), and a
1 s collective timeout (the tiny step's collectives take milliseconds; a survivor waiting on
the dead worker through a peer gives up after it)."""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

from relaytrain.bench.common import demo_data, run_training


def bench_recovery(quick: bool = False, kills: int | None = None, spares: int = 1
                   ) -> dict[str, Any]:
    kills = kills or (3 if quick else 8)
    # Kills 30 tiny steps (a few seconds) apart: time for the promoted spare to be replaced by
    # a new warm one, as between real failures.
    at = [10 + 30 * i for i in range(kills)]
    steps = at[-1] + 10
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        data = demo_data(tmp, max_docs=100, vocab=512)
        summary = run_training([f"data.path={data}", f"run_dir={os.path.join(tmp, 'run')}",
                                "runtime.engine=ray", "parallel.dp=4",
                                f"train.max_steps={steps}", f"faults.kill_at={at}",
                                f"elastic.spares={spares}", "runtime.call_timeout=30",
                                "runtime.collective_timeout=1"])
    recs = summary["recoveries"]
    totals = [r["total_s"] for r in recs]
    phases = {p: statistics.median(r["phases"][p] for r in recs if r["phases"][p] is not None)
              for p in ("detect", "replace", "reform", "restore", "first_step")}
    return {"kills": kills, "recoveries": len(recs), "spares": spares,
            "median_s": statistics.median(totals), "max_s": max(totals),
            "median_phases_s": phases, "max_lost_steps": max(r["lost_steps"] for r in recs),
            "goodput": summary["goodput"], "target_median_s": 3.0}


def format_report(r: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v:.2f}s" for k, v in r["median_phases_s"].items())
    return (f"recovery from {r['kills']} kills of 1 of 4 workers ({r['spares']} warm spare):\n"
            f"  kill -> next completed step: median {r['median_s']:.2f}s, max {r['max_s']:.2f}s "
            f"(target median <= {r['target_median_s']:.0f}s)\n"
            f"  median by phase: {phases}\n"
            f"  steps lost per recovery: at most {r['max_lost_steps']} (the step in flight)\n"
            f"  goodput of the whole run: {r['goodput']:.1%}")
