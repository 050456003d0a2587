"""`relaytrain bench recovery`: kill (SIGKILL) or hang (SIGSTOP) a worker N times in a tiny
4-worker run and report, per kind of failure, the time from the fault to the next completed
step, split by phase, and the steps lost.

Settings a user of tiny steps would choose: one warm spare (a replacement is a promotion), and a
1 s collective timeout (the tiny step's collectives take milliseconds; a survivor waiting on
the failed worker through a peer gives up after it). A hang costs more than a kill by design:
a stopped process closes no connection, so it shows only when a survivor's collective times
out (or the call deadline passes), and it is named by a ping it cannot answer
(`runtime.engines.ray.PING_TIMEOUT`)."""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

from relaytrain.bench import progress
from relaytrain.bench.common import demo_data, run_training
from relaytrain.errors import UserError

PHASES = ("detect", "replace", "reform", "restore", "first_step")


def fault_plan(kills: int, hangs: int) -> list[tuple[int, str]]:
    """(step, "kill" | "hang") for every fault, 30 tiny steps (a few seconds) apart: time for
    the promoted spare to be replaced by a new warm one, as between real failures. Hangs are
    spread evenly among the kills."""
    n = kills + hangs
    hang_slots = {int((i + 0.5) * n / hangs) for i in range(hangs)}
    kinds = ["hang" if i in hang_slots else "kill" for i in range(n)]
    return [(10 + 30 * i, kind) for i, kind in enumerate(kinds)]


def _summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    totals = [r["total_s"] for r in recs]
    return {"recoveries": len(recs), "median_s": statistics.median(totals), "max_s": max(totals),
            "median_phases_s": {p: statistics.median(r["phases"][p] for r in recs
                                                     if r["phases"][p] is not None)
                                for p in PHASES},
            "max_lost_steps": max(r["lost_steps"] for r in recs)}


def bench_recovery(quick: bool = False, kills: int | None = None, hangs: int | None = None,
                   spares: int = 1) -> dict[str, Any]:
    kills = (3 if quick else 8) if kills is None else kills
    hangs = (1 if quick else 4) if hangs is None else hangs
    plan = fault_plan(kills, hangs)
    if not plan:
        raise UserError("bench recovery: nothing to recover from; give at least one kill or hang")
    steps = plan[-1][0] + 10
    progress.start("recovery", f"one 4-worker run of {steps} steps with {kills} kills and "
                   f"{hangs} hangs (each a repetition)")
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        progress.report("preparing data")
        data = demo_data(tmp, max_docs=100, vocab=512)
        progress.report("training with faults (progress bar below)")
        summary = run_training([f"data.path={data}", f"run_dir={os.path.join(tmp, 'run')}",
                                "runtime.engine=ray", "parallel.dp=4",
                                f"train.max_steps={steps}",
                                f"faults.kill_at={[s for s, k in plan if k == 'kill']}",
                                f"faults.hang_at={[s for s, k in plan if k == 'hang']}",
                                f"elastic.spares={spares}", f"elastic.max_recoveries={len(plan)}",
                                "runtime.call_timeout=30",
                                "runtime.collective_timeout=1"])
    recs = summary["recoveries"]
    out: dict[str, Any] = {"kills": kills, "hangs": hangs, "spares": spares,
                           "recoveries": len(recs), "goodput": summary["goodput"],
                           "target_median_s": 3.0}
    for cause in ("died", "hung"):
        mine = [r for r in recs if r["cause"] == cause]
        out[cause] = _summary(mine) if mine else None
    return out


def format_report(r: dict[str, Any]) -> str:
    lines = [f"recovery from {r['kills']} kills and {r['hangs']} hangs of 1 of 4 workers "
             f"({r['spares']} warm spare), {r['recoveries']} recoveries:"]
    for cause, what in (("died", "kill (SIGKILL)"), ("hung", "hang (SIGSTOP)")):
        s = r[cause]
        if s is None:
            continue
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in s["median_phases_s"].items())
        target = f" (target median <= {r['target_median_s']:.0f}s)" if cause == "died" else ""
        lines += [f"  {what} -> next completed step: median {s['median_s']:.2f}s, "
                  f"max {s['max_s']:.2f}s over {s['recoveries']}{target}",
                  f"    median by phase: {phases}",
                  f"    steps lost per recovery: at most {s['max_lost_steps']}"]
    lines.append(f"  goodput of the whole run: {r['goodput']:.1%}")
    return "\n".join(lines)
