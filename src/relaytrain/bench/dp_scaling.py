"""`relaytrain bench dp-scaling`: throughput at dp = 1, 2 (and 4 where cores allow) on real Ray
actors, and the cost of exact mode over fast mode, as ratios of runs side by side in rounds;
beside each run, the gradient reduction's share of the step (its fold and its collectives, from
the step records: `time_fold`, `time_comm`) and the bytes it reduced per parameter
(`wire_bytes_per_param`)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from typing import Any

from relaytrain.bench import progress
from relaytrain.bench.common import demo_data, run_training
from relaytrain.runlog import read_metrics

TARGET_EXACT = 1.10  # exact over fast step time (issue 44)


def _throughput(run_dir: str, skip: int) -> float:
    steps = read_metrics(run_dir).steps[skip:]
    return statistics.median(r["tokens_per_s"] for r in steps)


def reduction_cost(run_dir: str, skip: int) -> dict[str, float]:
    """The gradient reduction's median share of the step's compute time (its fold and
    conversions, its collectives) and the bytes it reduced per parameter."""
    steps = read_metrics(run_dir).steps[skip:]
    return {"fold_share": statistics.median(r["time_fold"] / r["time_compute"] for r in steps),
            "comm_share": statistics.median(r["time_comm"] / r["time_compute"] for r in steps),
            "wire_bytes_per_param": max(r["wire_bytes_per_param"] for r in steps)}


def bench_dp_scaling(quick: bool = False) -> dict[str, Any]:
    """Each layout's runs in rounds (every layout once a round), so that a change in the
    machine's load between runs falls on both modes of a pair alike: exact mode's cost is the
    median over rounds of fast's throughput over exact's in the same round."""
    steps, skip, rounds = (8, 3, 2) if quick else (20, 5, 3)
    cores = os.cpu_count() or 1
    sizes = [1, 2] + ([4] if cores >= 4 else [])
    out: dict[str, Any] = {"cores": cores, "steps": steps, "rounds": rounds, "preset": "small",
                           "runs": {}}
    runs = [(dp, mode) for dp in sizes for mode in ("fast", "exact")
            if mode == "fast" or dp in (1, 2)]
    progress.start("dp-scaling", f"{rounds} rounds of {len(runs)} training runs of {steps} "
                   "steps: " + ", ".join(f"dp{dp}-{mode}" for dp, mode in runs))
    seen: dict[str, list[float]] = {f"dp{dp}-{mode}": [] for dp, mode in runs}
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        data = demo_data(tmp)
        common = [f"data.path={data}", "model.preset=small", "data.seq_len=128",
                  "train.global_batch=16", "train.micro_batch=4", f"train.max_steps={steps}",
                  "runtime.engine=ray", "runtime.threads_per_worker=1"]
        done = 0
        for k in range(rounds):
            for dp, mode in runs:
                name = f"dp{dp}-{mode}"
                done += 1
                progress.report(f"{name} (round {k + 1}/{rounds})", done, rounds * len(runs))
                run = os.path.join(tmp, f"{name}-{k}")
                run_training([*common, f"run_dir={run}", f"parallel.dp={dp}",
                              f"determinism={mode}"])
                seen[name].append(_throughput(run, skip))
                if k == rounds - 1:
                    out.setdefault("reduction", {})[name] = reduction_cost(run, skip)
                shutil.rmtree(run)
    out["runs"] = {name: statistics.median(v) for name, v in seen.items()}
    out["rounds_tokens_per_s"] = seen
    r = out["runs"]
    out["speedup_dp2"] = r["dp2-fast"] / r["dp1-fast"]
    if "dp4-fast" in r:
        out["speedup_dp4"] = r["dp4-fast"] / r["dp1-fast"]
    for dp in (1, 2):
        pairs = [f / e for f, e in zip(seen[f"dp{dp}-fast"], seen[f"dp{dp}-exact"], strict=True)]
        out[f"exact_over_fast_dp{dp}_rounds"] = pairs
        out[f"exact_over_fast_dp{dp}"] = statistics.median(pairs)
    return out


def format_report(r: dict[str, Any]) -> str:
    lines = [f"dp scaling, small preset, {r['steps']} steps, {r['cores']} cores "
             f"(tokens/s, median after warm-up; median of {r['rounds']} rounds):"]
    lines += [f"  {k:<10} {v:12,.0f}" for k, v in r["runs"].items()]
    lines.append(f"  dp2 / dp1 (fast): {r['speedup_dp2']:.2f}x")
    if "speedup_dp4" in r:
        lines.append(f"  dp4 / dp1 (fast): {r['speedup_dp4']:.2f}x")
    else:
        lines.append("  dp4: skipped (fewer than 4 cores)")
    rounds = {dp: ", ".join(f"{x:.2f}" for x in r[f"exact_over_fast_dp{dp}_rounds"])
              for dp in (1, 2)}
    lines.append(f"  exact-mode cost (median of the rounds' fast / exact): "
                 f"{r['exact_over_fast_dp1']:.2f}x slower at dp1 ({rounds[1]}), "
                 f"{r['exact_over_fast_dp2']:.2f}x at dp2 ({rounds[2]}) "
                 f"(target <= {TARGET_EXACT:.2f}x)")
    lines += format_reduction(r["reduction"])
    return "\n".join(lines) + "\n" + json.dumps(r)


def format_reduction(costs: dict[str, dict[str, float]]) -> list[str]:
    """The gradient reduction's lines of a report: per run, its share of the step and its bytes
    on the wire per parameter."""
    return ["  gradient reduction (share of the step: fold + conversions, collectives; bytes "
            "reduced per parameter):"] + [
        f"    {k:<12} fold {100 * v['fold_share']:5.1f}%  collectives "
        f"{100 * v['comm_share']:5.1f}%  {v['wire_bytes_per_param']:5.2f} B/param"
        for k, v in costs.items()]
