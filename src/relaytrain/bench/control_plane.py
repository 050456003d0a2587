"""`relaytrain bench control-plane`: the controller against 8, 64, 256 and 1,024 simulated
workers (runtime/engines/simulated.py: the real controller, wire, reporter, ledger, catalogue
and recovery; workers that take a fixed step time and do not train), and Ray's own fan-out cost
with real (light) actors.

Per size, two runs of the same steps: dispatch ahead (the default) with one worker killed near
the end, and lockstep (`runtime.dispatch_ahead=false`). Reported: the controller's time per
step (its wall time in the step loop less the time it waited for the workers' answers:
dispatching, receiving and unpickling results, checking and recording them; and its process's
CPU time per step, which a busy machine inflates less), the time workers
sat idle between consecutive steps (measured by the workers' host), ledger bytes per step, the
audit's time per 1,000 steps, and the recovery's decision (failure to the new layout chosen and
its workers placed) and re-formation (process groups joined, state restored) times, and the
controller's own CPU time in it (the simulated workers' host does every worker's part of a
re-formation one after another, which a cluster's workers do at once: the wall times grow with
N here for that reason too). A warm-up run with a kill comes first, unreported: the first
recovery in a process imports what unpickling a peer's snapshot needs (~1.5 ms of the smallest
size's recovery otherwise). Every figure is measured, none computed from another.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from relaytrain.bench import progress
from relaytrain.bench.common import demo_data
from relaytrain.bench.fan_out import ray_fan_out
from relaytrain.config import load_config
from relaytrain.data.audit import audit
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.engines.simulated import SimulatedEngine

SIZES = (8, 64, 256, 1024)
# The simulated step time: the host builds 1,024 workers' results within it (on 2 shared cores)
STEP_S = 0.25
WARM = 5  # steps left out at the start (first calls) of the per-step figures


def _run(tmp: str, data: str, n: int, steps: int, ahead: bool, fail: bool) -> dict[str, Any]:
    run = os.path.join(tmp, f"n{n}-{'ahead' if ahead else 'lockstep'}")
    cfg = load_config(None, [f"run_dir={run}", f"data.path={data}", "model.preset=tiny",
                             "data.seq_len=8", "runtime.engine=ray", f"parallel.dp={n}",
                             f"train.global_batch={n}", "train.micro_batch=1",
                             f"train.max_steps={steps}", "eval.every=0", "checkpoint.every=0",
                             "log.progress=false", f"runtime.dispatch_ahead={str(ahead).lower()}"])
    engine = SimulatedEngine(step_s=STEP_S)
    fail_at = steps - 8
    if fail:
        engine.fail(fail_at, rank=n // 2)
    summary = Controller(cfg, quiet=True, engine=engine).run()
    t0 = time.perf_counter()
    report = audit(run)
    audit_s = time.perf_counter() - t0
    if not report.ok:
        raise RuntimeError(f"bench control-plane: the audit of {run} failed: "
                           f"{report.first_failure()}")
    # the steps between the warm-up and the failure (or the final checkpoint)
    marks = engine.step_marks[WARM: (fail_at if fail else steps) - 2]
    (t_a, w_a, cpu_a), (t_b, w_b, cpu_b) = marks[0], marks[-1]
    out = {"controller_ms_per_step": 1e3 * ((t_b - t_a) - (w_b - w_a)) / (len(marks) - 1),
           "controller_cpu_ms_per_step": 1e3 * (cpu_b - cpu_a) / (len(marks) - 1),
           "idle_ms_median": 1e3 * statistics.median(engine.idle_s),
           "idle_ms_max": 1e3 * max(engine.idle_s), "overruns": engine.overruns,
           "ledger_bytes_per_step": os.path.getsize(os.path.join(run, "ledger.jsonl")) / steps,
           "audit_s_per_1000_steps": 1e3 * audit_s / steps}
    if fail:
        [rec] = summary.recoveries
        p = rec["phases"]
        out.update(recovery_decision_s=p["replace"], recovery_reform_s=p["reform"] + p["restore"],
                   recovery_controller_cpu_s=rec["controller_cpu_s"],
                   lost_steps=rec["lost_steps"], discarded_ahead=rec["discarded_ahead"])
    return out


def bench_control_plane(quick: bool = False, sizes: tuple[int, ...] = SIZES,
                        actors: int | None = None) -> dict[str, Any]:
    steps = 30 if quick else 100
    actors = actors or (32 if quick else 64)
    progress.start("control-plane", f"per size {sizes}: {steps} steps of {STEP_S}s simulated, "
                   "dispatch ahead (one kill) and lockstep; then Ray with "
                   f"{actors} light actors")
    out: dict[str, Any] = {"steps": steps, "step_s": STEP_S, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        progress.report("preparing data")
        data = demo_data(tmp, max_docs=100, vocab=512)
        # the process's first recovery imports and first calls, left out of every size's
        progress.report(f"warm-up: {sizes[0]} simulated workers, a kill (not reported)")
        _run(os.path.join(tmp, "warm-up"), data, sizes[0], 20, ahead=True, fail=True)
        for n in sizes:
            progress.report(f"{n} simulated workers, dispatch ahead, a kill at step {steps - 8}")
            ahead = _run(tmp, data, n, steps, ahead=True, fail=True)
            progress.report(f"{n} simulated workers, lockstep")
            lockstep = _run(tmp, data, n, steps, ahead=False, fail=False)
            out["sizes"][n] = {"ahead": ahead, "lockstep": lockstep}
    progress.report(f"Ray: {actors} light actors")
    out["ray"] = ray_fan_out(actors, rounds=20 if quick else 100)
    return out


def format_report(r: dict[str, Any]) -> str:
    lines = [f"control plane: {r['steps']} steps of {r['step_s']:g}s per run, simulated workers "
             "(the real controller); figures measured per run",
             f"{'workers':>8} {'ctl ms/step':>11} {'(lockstep)':>10} {'ctl CPU ms':>10} "
             f"{'idle ms':>8} "
             f"{'(lockstep)':>10} {'ledger B/step':>13} {'audit s/1k':>10} "
             f"{'decide s':>8} {'re-form s':>9} {'rec CPU ms':>10} {'lost':>4}"]
    for n, s in r["sizes"].items():
        a, b = s["ahead"], s["lockstep"]
        lines.append(f"{n:>8} {a['controller_ms_per_step']:>11.2f} "
                     f"{b['controller_ms_per_step']:>10.2f} "
                     f"{a['controller_cpu_ms_per_step']:>10.2f} {a['idle_ms_median']:>8.2f} "
                     f"{b['idle_ms_median']:>10.2f} {a['ledger_bytes_per_step']:>13,.0f} "
                     f"{a['audit_s_per_1000_steps']:>10.2f} {a['recovery_decision_s']:>8.3f} "
                     f"{a['recovery_reform_s']:>9.3f} "
                     f"{1e3 * a['recovery_controller_cpu_s']:>10.2f} "
                     f"{a['lost_steps'] + a['discarded_ahead']:>4}")
        if a["overruns"] + b["overruns"] > r["steps"] // 20:  # more than the first steps
            lines.append(f"{'':>8} (the simulated workers' host took longer than a step "
                         f"{a['overruns']} + {b['overruns']} times: their idle time is not the "
                         "controller's alone)")
    ray = r["ray"]
    lines.append("Ray fan-out, light actors (one step call to each and back), median: "
                 + ", ".join(f"{k.split('_')[-1]} actors {v:.2f} ms" for k, v in ray.items()
                             if k.startswith("ms_")))
    return "\n".join(lines)
