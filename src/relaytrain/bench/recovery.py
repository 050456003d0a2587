"""`relaytrain bench recovery [key=value ...]`: kill (SIGKILL) or hang (SIGSTOP) a worker N
times in a tiny 4-worker run, kill workers of a sharded one (dp 2 x fsdp 2), and once take a
worker away with no capacity to replace it (a shrink), and report, per kind of failure, the
time from the fault to the next completed step, split by phase, and the steps lost.

Goodput is measured as the project's benchmarks measure: against a baseline run beside it,
the same config (same steps, same settings) without faults, run after the faulty one in the
same process: the fault-free run's wall over the faulty run's. The faulty run's own productive
share (of its wall, and of its wall after start-up) is reported beside it.

Every setting is the run's default unless given on the command line (e.g. `elastic.spares=1`
for a warm spare), and the report names the settings that bound recovery. A survivor waits
for no timeout: the controller aborts its collectives the moment a failure is known
(runtime/abort.py). A kill is known at once (the process is gone); a hang when the stopped
worker leaves a ping unanswered (`runtime.engines.ray.PING_TIMEOUT`, pinged every
`HEARTBEAT_S` while a step runs). Without a worker up to replace it (no capacity, or no
standby or spare), the survivors go on at once on fewer workers; the time until the run is back
at its size is reported on its own."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any

from relaytrain.bench import progress
from relaytrain.bench.common import TINY_RUN, demo_data, run_training
from relaytrain.config import load_config
from relaytrain.errors import UserError
from relaytrain.runtime.engines.ray import HEARTBEAT_S, PING_TIMEOUT

PHASES = ("detect", "replace", "reform", "restore", "first_step")
CAUSES = {"died": "kill (SIGKILL)", "hung": "hang (SIGSTOP)",
          "died, sharded": "kill in a sharded run (dp 2 x fsdp 2)",
          "shrunk": "kill, no capacity (shrink)"}


# Tiny steps between faults: time for the promoted standby (or spare) to be replaced by a new
# warm one, as between real failures. A new worker process warms up in about 28 steps' time on
# a 2-core host (docs/MEASURED.md: recovery time); at 30 apart the next fault found it still
# warming and waited for it.
FAULT_SPACING = 60
HELD_S = 5.0  # how long the shrink case's killed worker's slot stays taken


def fault_plan(kills: int, hangs: int) -> list[tuple[int, str]]:
    """(step, "kill" | "hang") for every fault, `FAULT_SPACING` steps apart. Hangs are spread
    evenly among the kills."""
    n = kills + hangs
    hang_slots = {int((i + 0.5) * n / hangs) for i in range(hangs)}
    kinds = ["hang" if i in hang_slots else "kill" for i in range(n)]
    return [(10 + FAULT_SPACING * i, kind) for i, kind in enumerate(kinds)]


def _summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    totals = [r["total_s"] for r in recs]
    return {"recoveries": len(recs), "median_s": statistics.median(totals), "max_s": max(totals),
            "median_phases_s": {p: statistics.median(r["phases"][p] for r in recs
                                                     if r["phases"][p] is not None)
                                for p in PHASES},
            "max_lost_steps": max(r["lost_steps"] for r in recs)}


def goodput(faulty: Any, fault_free: Any, resize_s: float = 0.0) -> dict[str, float]:
    """The faulty run's goodput against the same run without faults (`RunSummary`s: the
    fault-free wall over the faulty wall), its productive share with and without its start-up
    (the Ray cluster, the workers and the standby, which any run pays), and where its extra
    wall went: the start-up's difference; training's (steps lost and trained again, steps on
    fewer workers or beside a replacement starting on the same cores); the recoveries outside
    their first step (of them detection: a hang's ping deadline); growing back (`resize_s`,
    its `resize` records); the rest (the standby's refills, the final save, the host)."""
    productive = faulty.goodput * faulty.wall_s
    clean_productive = fault_free.goodput * fault_free.wall_s
    recs = faulty.recoveries
    out = {"goodput": fault_free.wall_s / faulty.wall_s,
           "faulty_wall_s": faulty.wall_s, "fault_free_wall_s": fault_free.wall_s,
           "productive_share": faulty.goodput,
           "productive_share_after_start_up": productive / (faulty.wall_s - faulty.setup_s),
           "start_up_s": faulty.setup_s, "extra_s": faulty.wall_s - fault_free.wall_s,
           "start_up_extra_s": faulty.setup_s - fault_free.setup_s,
           "training_extra_s": productive - clean_productive,
           "lost_steps": sum(r["lost_steps"] for r in recs),
           "recoveries_s": sum(r["total_s"] - r["phases"]["first_step"] for r in recs),
           "detect_s": sum(r["phases"]["detect"] or 0.0 for r in recs), "resize_s": resize_s}
    out["rest_s"] = out["extra_s"] - sum(out[k] for k in ("start_up_extra_s", "training_extra_s",
                                                          "recoveries_s", "resize_s"))
    return out


def settings(overrides: list[str]) -> dict[str, Any]:
    """The settings that bound a recovery, as the run will use them."""
    cfg = load_config(None, [*TINY_RUN, *overrides])
    return {"runtime.collective_timeout": cfg.runtime.collective_timeout,
            "runtime.call_timeout": cfg.runtime.call_timeout,
            "elastic.spares": cfg.elastic.spares,
            # in effect: not beside spares (runtime/engines/ray.py)
            "elastic.standby": cfg.elastic.standby and not cfg.elastic.spares,
            "elastic.replace_timeout": cfg.elastic.replace_timeout,
            "ping_timeout": PING_TIMEOUT, "heartbeat_s": HEARTBEAT_S}


def bench_recovery(quick: bool = False, kills: int | None = None, hangs: int | None = None,
                   shrink: bool = True, sharded: bool = True,
                   overrides: list[str] | None = None) -> dict[str, Any]:
    kills = (3 if quick else 6) if kills is None else kills
    hangs = (1 if quick else 3) if hangs is None else hangs
    plan = fault_plan(kills, hangs)
    if not plan:
        raise UserError("bench recovery: nothing to recover from; give at least one kill or hang")
    given = list(overrides or [])
    used = settings(given)
    steps = plan[-1][0] + 10
    progress.start("recovery", f"one 4-worker run of {steps} steps with {kills} kills and "
                   f"{hangs} hangs (each a repetition), and the same run without faults")
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        progress.report("preparing data")
        data = demo_data(tmp, max_docs=100, vocab=512)
        common = [f"data.path={data}", "runtime.engine=ray", "parallel.dp=4", *given]
        progress.report("training with faults (progress bar below)")
        summary = run_training([*common, f"run_dir={os.path.join(tmp, 'run')}",
                                f"train.max_steps={steps}",
                                f"faults.kill_at={[s for s, k in plan if k == 'kill']}",
                                f"faults.hang_at={[s for s, k in plan if k == 'hang']}",
                                f"elastic.max_recoveries={len(plan)}"])
        # the baseline: the same run without faults, after it (anything the process warms
        # once, it finds warm: the goodput leans against the faulty run)
        progress.report("the same run without faults (the goodput's baseline)")
        clean = run_training([*common, f"run_dir={os.path.join(tmp, 'fault-free')}",
                              f"train.max_steps={steps}"])
        good = goodput(summary, clean, sum(r["seconds"] for r in _records(
            os.path.join(tmp, "run"), "resize")))
        recs = list(summary.recoveries)
        if sharded:
            kill_at = [s for s, _ in fault_plan(2 if quick else 3, 0)]
            progress.report(f"{len(kill_at)} kills in a sharded run (dp 2 x fsdp 2)")
            run = run_training([*common, f"run_dir={os.path.join(tmp, 'sharded')}",
                                "parallel.dp=2", "parallel.fsdp=2",
                                f"train.max_steps={kill_at[-1] + 10}", f"faults.kill_at={kill_at}",
                                f"elastic.max_recoveries={len(kill_at)}"])
            recs += [{**r, "cause": "died, sharded"} for r in run.recoveries]
        back_s = None
        if shrink:
            # The 4 workers fill the machine's CPUs, and the killed one's slot stays taken for
            # HELD_S: no capacity to replace it until then.
            progress.report("a kill with no capacity to replace it (shrink)")
            run_dir = os.path.join(tmp, "shrink")
            # 160 steps: time to grow back (the slot held, then a new process's start-up:
            # 16.5 s on 2 cores under load 15)
            shrunk = run_training([*common, f"run_dir={run_dir}", "train.max_steps=160",
                                   "faults.kill_at=[10]", f"faults.hold_capacity_s={HELD_S:g}",
                                   "elastic.spares=0",
                                   f"runtime.cpus_per_worker={(os.cpu_count() or 4) / 4:g}"])
            # only a recovery that did go on with fewer workers is a shrink's figure
            recs += [{**r, "cause": "shrunk"} for r in shrunk.recoveries if r["dp"] < 4]
            if not any(r["dp"] < 4 for r in shrunk.recoveries):
                progress.report("the shrink case found capacity for a replacement: no figure")
            back_s = _back_at_full_size(run_dir)
    out: dict[str, Any] = {"kills": kills, "hangs": hangs, "settings": used, "overrides": given,
                           "recoveries": len(recs), "steps": steps,
                           "goodput": good,
                           # issue 42's: no survivor waits for a process to start
                           "targets_s": {"died": 1.0, "hung": PING_TIMEOUT + 1.0,
                                         "died, sharded": 1.5, "shrunk": 1.0},
                           "back_at_full_size_s": back_s, "held_s": HELD_S}
    for cause in CAUSES:
        mine = [r for r in recs if r["cause"] == cause]
        out[cause] = _summary(mine) if mine else None
    return out


def _records(run_dir: str, kind: str) -> list[dict[str, Any]]:
    """The run's metrics records of `kind`."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _back_at_full_size(run_dir: str) -> float | None:
    """From the shrink's fault until the run was back at 4 workers (its `resize` record);
    None if it never was."""
    back = [r["since_failure_s"] for r in _records(run_dir, "resize")
            if r.get("since_failure_s") is not None]
    return back[0] if back else None


def _shown(v: float | bool) -> str:
    return str(v).lower() if isinstance(v, bool) else f"{v:g}"


def format_report(r: dict[str, Any]) -> str:
    given = " ".join(r["overrides"]) or "none"
    lines = [f"recovery from {r['kills']} kills and {r['hangs']} hangs of 1 of 4 workers, "
             f"{r['recoveries']} recoveries; settings given: {given}",
             "  in effect: " + ", ".join(f"{k} {_shown(v)}" for k, v in r["settings"].items())]
    for cause, what in CAUSES.items():
        s = r[cause]
        if s is None:
            continue
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in s["median_phases_s"].items())
        lines += [f"  {what} -> next completed step: median {s['median_s']:.2f}s, "
                  f"max {s['max_s']:.2f}s over {s['recoveries']} "
                  f"(target median <= {r['targets_s'][cause]:g}s)",
                  f"    median by phase: {phases}",
                  f"    steps lost per recovery: at most {s['max_lost_steps']}"]
    if r.get("shrunk") is not None:
        back = r["back_at_full_size_s"]
        lines.append(f"  shrink: back at 4 workers {back:.2f}s after the fault (its slot held "
                     f"{r['held_s']:g}s)" if back is not None else
                     "  shrink: never back at 4 workers within the run")
    g = r["goodput"]
    lines += [f"  goodput of the faulty run (kills and hangs): {g['goodput']:.1%} = the same "
              f"{r['steps']} steps without faults {g['fault_free_wall_s']:.1f}s / with them "
              f"{g['faulty_wall_s']:.1f}s (target >= 90%)",
              f"    the faulty run's productive share: {g['productive_share']:.1%} of its wall, "
              f"{g['productive_share_after_start_up']:.1%} after its start-up "
              f"({g['start_up_s']:.1f}s: Ray, the workers, the standby)",
              f"    its {g['extra_s']:.1f}s more: start-up {g['start_up_extra_s']:+.1f}s, "
              f"training {g['training_extra_s']:+.1f}s ({g['lost_steps']} steps lost and "
              f"trained again, steps on fewer workers or beside a process starting), "
              f"recoveries {g['recoveries_s']:.1f}s outside their first step (detection "
              f"{g['detect_s']:.1f}s), growing back {g['resize_s']:.1f}s, the rest "
              f"{g['rest_s']:+.1f}s"]
    return "\n".join(lines)
