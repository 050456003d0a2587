"""`relaytrain bench memory`: what sharding (parallel.fsdp) saves and costs, side by side in one
run: per-worker bytes of parameters + gradients + AdamW moments and peak resident memory of a
step, for dp 2 unsharded and fsdp 2 and 4 on the small preset, the step time of fsdp 2 against
dp 2 (same workers, same batch), and exact mode's cost with and without sharding, with the
gradient reduction's share of each step and its bytes per parameter (`bench dp-scaling`'s).
Under sharding the bytes count every micro-batch's reduce-scatter (fast mode: FSDP2's fp32
input, 4 bytes a parameter; its time is inside FSDP2's backward, not in the shares).

The step is `bench train-throughput`'s, at the preset's full context: sequences of 256 tokens in
micro-batches of 8, two micro-batches per worker at dp 2 (FSDP2's cost is per micro-batch and
per parameter, so a toy micro-batch inflates it: at 128 x 4 tokens, fsdp 2 took 1.37-1.41x the
time of dp 2, docs/MEASURED.md). The two layouts of that ratio run twice, alternating, and each
counts its faster run: a minute of a busy host otherwise decides it (one run each gave 0.85x
and 1.24x)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any

from relaytrain.bench import progress
from relaytrain.bench.common import demo_data, run_training
from relaytrain.bench.dp_scaling import TARGET_EXACT, format_reduction, reduction_cost
from relaytrain.runlog import read_metrics

# (name, dp, fsdp, determinism); dp2-fast is the baseline of every ratio.
LAYOUTS = (("dp2-fast", 2, 1, "fast"), ("fsdp2-fast", 1, 2, "fast"), ("fsdp4-fast", 1, 4, "fast"),
           ("dp2-exact", 2, 1, "exact"), ("fsdp2-exact", 1, 2, "exact"))
TARGETS = {"state_over_even_share": 1.1, "fsdp2_over_dp2_step_time": 1.3}
PAIR = ("dp2-fast", "fsdp2-fast")  # the step-time ratio's layouts: each run twice


def _measure(run_dir: str, skip: int) -> dict[str, float]:
    steps = read_metrics(run_dir).steps[skip:]
    return {"step_s": statistics.median(r["time_compute"] + r["time_data"] for r in steps),
            "state_bytes": max(r["state_bytes"] for r in steps),
            "peak_rss": max(r["peak_rss"] for r in steps)}


def bench_memory(quick: bool = False) -> dict[str, Any]:
    steps, skip = (5, 2) if quick else (8, 3)
    out: dict[str, Any] = {"preset": "small", "steps": steps, "cores": os.cpu_count(),
                           "targets": TARGETS, "runs": {}}
    order = [*LAYOUTS, *(x for x in LAYOUTS if x[0] in PAIR)]
    progress.start("memory", f"{len(order)} training runs of {steps} steps: "
                   + ", ".join(name for name, *_ in order))
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        data = demo_data(tmp)
        common = [f"data.path={data}", "model.preset=small", "data.seq_len=256",
                  "train.global_batch=32", "train.micro_batch=8", f"train.max_steps={steps}",
                  "runtime.engine=ray", "runtime.threads_per_worker=1", "eval.every=0",
                  "checkpoint.every=0"]
        for i, (name, dp, fsdp, mode) in enumerate(order, 1):
            progress.report(name, i, len(order))
            run = os.path.join(tmp, f"{name}-{i}")
            run_training([*common, f"run_dir={run}", f"parallel.dp={dp}",
                          f"parallel.fsdp={fsdp}", f"determinism={mode}"])
            got = _measure(run, skip)
            out.setdefault("reduction", {})[name] = reduction_cost(run, skip)
            out.setdefault("step_s_of_each_run", {}).setdefault(name, []).append(got["step_s"])
            if name in out["runs"]:
                got["step_s"] = min(got["step_s"], out["runs"][name]["step_s"])
            out["runs"][name] = got
    r = out["runs"]
    whole = r["dp2-fast"]["state_bytes"]
    out["state_over_even_share"] = {f"fsdp{k}": r[f"fsdp{k}-fast"]["state_bytes"] / (whole / k)
                                    for k in (2, 4)}
    out["fsdp2_over_dp2_step_time"] = r["fsdp2-fast"]["step_s"] / r["dp2-fast"]["step_s"]
    out["exact_over_fast"] = {"dp2": r["dp2-exact"]["step_s"] / r["dp2-fast"]["step_s"],
                              "fsdp2": r["fsdp2-exact"]["step_s"] / r["fsdp2-fast"]["step_s"]}
    return out


def format_report(r: dict[str, Any]) -> str:
    mib = 2.0**20
    lines = [f"memory and time of sharding, small preset, {r['steps']} steps, {r['cores']} cores "
             "(per worker: the largest; step time: median after warm-up)",
             f"  {'layout':<12} {'state MiB':>10} {'peak RSS MiB':>13} {'step s':>8}"]
    lines += [f"  {k:<12} {v['state_bytes'] / mib:10.1f} {v['peak_rss'] / mib:13.1f} "
              f"{v['step_s']:8.3f}" for k, v in r["runs"].items()]
    share = r["state_over_even_share"]
    lines.append("  state / (unsharded / fsdp): " + ", ".join(
        f"{k} {v:.3f}x" for k, v in share.items())
        + f" (target <= {r['targets']['state_over_even_share']}x)")
    runs = r["step_s_of_each_run"]
    lines.append(f"  step time fsdp2 / dp2: {r['fsdp2_over_dp2_step_time']:.2f}x "
                 f"(target <= {r['targets']['fsdp2_over_dp2_step_time']}x; the faster of two "
                 f"runs each: dp2 {', '.join(f'{x:.3f}' for x in runs['dp2-fast'])} s, fsdp2 "
                 f"{', '.join(f'{x:.3f}' for x in runs['fsdp2-fast'])} s)")
    lines.append(f"  exact-mode cost: {r['exact_over_fast']['dp2']:.2f}x at dp2, "
                 f"{r['exact_over_fast']['fsdp2']:.2f}x at fsdp2 (target <= {TARGET_EXACT:.2f}x)")
    lines += format_reduction(r["reduction"])
    return "\n".join(lines) + "\n" + json.dumps(r)
