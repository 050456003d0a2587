"""`relaytrain bench pipeline`: the schedules on real multi-process pipelines, and the
schedule simulator calibrated on them for pipelines deeper than this machine can run.

Two layers, kept apart so that neither hides the other:

- **Real.** The `small` preset trained through the controller on the Ray engine (gloo) with
  S = 2 and S = 4 stages (S = 2 only with `quick`), one run per schedule: time per step,
  throughput, each stage's bubble and peak memory (as the runtime measures them,
  `train/pipeline_stage.py`), held-out loss against steps and against training time. Only the
  held-out curves need the whole `steps`, and only one flush schedule's: every flush schedule
  makes the same updates at every S (bit for bit in exact mode, tests/train/
  test_pipeline_stage.py; the same held-out losses here), so 1f1b at the shallowest S runs them
  for all and the asynchronous schedules (whose updates depend on S) at every S, while the other
  flush runs stop after `probe_steps`, enough for their medians of time, bubble and costs (the
  default bench: 6 of its 11 runs, about a third of its time). One worker per stage with one
  thread: on a 2-core machine S = 2 has a core per stage, S = 4 puts
  two stages on each core. The asynchronous schedules update every `a` = M micro-batches (one
  update per global batch, like the flush schedules, so all five take the same optimizer steps
  on the same data and differ only in when; staleness <= 1 while a >= S - 1). More updates per
  token (a = M / 4, same learning rate) was tried and dropped: at S = 2 it reached the flush
  schedules' loss later, not sooner (12 steps: 12 against 7.4; 128 steps: held-out 5.795 against
  1f1b's 5.712 and a = M's 5.673; docs/MEASURED.md). So was a learning-rate correction for
  stale gradients, each stage's weight gradient of a micro-batch that crossed t updates scaled
  by w^t (w = 0.5: staleness-aware SGD's 1 / (1 + t)): at S = 4, 128 steps, the final held-out
  loss went 5.810, 5.738, 5.707, 5.777, 5.739 for w = 0, 0.125, 0.25, 0.375, 0.5 against
  5.760 at w = 1, no trend in w, one seed's spread (PACI's time to target at S = 8 from 1.12x
  to 1.37x the best flush schedule's). An update costs about half a micro-batch's forward at
  this model size on a CPU. Where PACI's simulated S = 8 time goes (docs/MEASURED.md): about
  half of its 5% bubble is the fill and drain of each span, half the stage-to-stage transfers
  on the round trip each of stage 0's S micro-batches in flight makes (2 t (S-1)/S per
  micro-batch at every stage). So PACI runs here with `parallel.paci.split`: each W right after
  its B, the input gradient sent first, which takes the W's off that trip and hides the
  transfers, training the whole backward's bits (simulated utilisation 0.95 -> 0.98). Deferring
  the weight gradients costs ~2% of a stage's F + B on this CPU (in-process, alternated; ~4%
  before `model.matmul.deferring` recorded on the whole backward's own graph), less than the
  ~3% it hides: 186.3 -> 184.5 ms a step simulated at S = 8 (docs/MEASURED.md). Weight
  prediction (`parallel.paci.predict`, formed op by op with no weight copy held) is not run
  here: at S = 4, 128 steps it lowers PACI's final held-out loss (5.760 -> 5.707 at seed 0,
  5.991 -> 5.914 at seed 1), but forming each weight's prediction for every micro-batch costs
  ~20% of a predicted micro-batch's F and 5-10% of its B here (64 tokens a micro-batch: the
  weight add is a sizeable share of the products), so the S = 8 ratio against 1f1b's curve
  moves only 1.21x -> 1.24-1.26x and 1.61x -> 1.66-1.69x; and the largest prediction one op
  forms (an MLP weight, 0.79 MB) is 15% of stage 0's activation memory at this model size:
  1.15x 1f1b's peak, over the 1.10x target (forming it in 64-row blocks meets that but costs
  ~40% more F and ~50% more B; docs/MEASURED.md).
- **Simulated.** Each schedule's action lists replayed by `simulate.simulate` with per-op costs
  measured in the real runs (median F, B, U per stage, after the first span) and a transfer time
  measured by a gloo ping-pong of one activation (the runtime posts its receives ahead, so the
  simulator puts the transfer on the link, not on the stages); a flush schedule's updates start
  together on every stage, as the global-norm all-gather before each of them makes the runtime's
  (a stage that finishes its last backward first waits there: bubble in the real runs). The error
  against the real runs is reported (the simulator is given the costs measured in that very run).
  For S in 4..32 every stage does what one real S = 2 stage did (their mean: a balanced cut), i.e.
  a model S/2 times deeper, as pipelines are used (the paper: GPT-2 Medium, 24 layers on 8
  stages); the `small` preset itself has 4 layers, so the runtime cannot cut it into more than 4
  stages, and 1/S-thin stages would make the fixed transfer weigh S/2 times more
  (`simulated_same_model` shows that case). Spans of `parallel.span` steps, the default dispatch
  (the asynchronous pipelines drain at every span end). Every schedule runs the same operations,
  so all are simulated with one set of costs: per stage, the median over the S = 2 runs (each
  run's own costs would carry the noise of whatever else the machine ran meanwhile into the
  comparison); the split lists (zb-h1, paci) with the F, B and W of their own runs (the
  split's extra work included) and the pooled U. `sensitivity_at_8` shows what the transfer
  time, the span length and the stage size do to paci and 1f1b.
- **interleaved-1f1b** runs with V = 2 chunks per stage (`VIRTUAL`), for real only where the
  preset's 4 layers give every virtual stage one (S = 2); it is simulated with the pooled
  per-stage costs, each chunk's F and B 1/V of them (its own run's costs are summed over its
  chunks for the comparison with that run). Its steps to the target are 1f1b's: every flush
  schedule makes the same updates (bit for bit in exact mode, tests/train/test_pipeline_stage.py),
  only the time per step differs.

Time to a target held-out loss at larger S = the real number of steps each schedule needed to reach
it (`heldout_curves`: an asynchronous schedule's in the deepest real pipeline, since staleness
grows with S, so their counts are optimistic for deeper ones) x the simulated time per step.
The target is the held-out loss every schedule reaches: the highest of the schedules' best
held-out losses (interpolated between evaluations). The machine's load averages before and
after are recorded: on a shared machine the real timings carry other people's work.

What it gave is in the README's "Measured" section, dated.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relaytrain.bench import progress
from relaytrain.config import load_config
from relaytrain.config.sections import ParallelSection
from relaytrain.data.prepare import prepare
from relaytrain.parallel.pipeline.schedules import (
    FLUSH_SCHEDULES,
    SCHEDULES,
    Schedule,
    asynchronous,
    build_schedule,
    split,
)
from relaytrain.parallel.pipeline.simulate import Costs, simulate

if TYPE_CHECKING:
    from relaytrain.runtime.kvstore import StoreAccess

SIM_STAGES = (4, 8, 16, 32)
VIRTUAL = 2  # interleaved-1f1b's chunks per stage
SMALL_LAYERS = 4  # the small preset's: at most that many (virtual) stages run for real
TARGETS = {"paci_utilisation": 0.95, "paci_memory_vs_1f1b": 1.10, "paci_speedup_at_8": 1.70,
           "zb_h1_memory_vs_1f1b": 1.10, "simulated_bubble_error": 0.10}


@dataclass(frozen=True)
class Setup:
    stages: tuple[int, ...]  # real pipeline depths
    steps: int
    eval_every: int  # also the span of the asynchronous schedules
    eval_instances: int
    max_docs: int | None
    probe_steps: int  # the runs whose held-out curve is another's (see the module docstring)
    seq_len: int = 64
    vocab: int = 2048
    global_batch: int = 8
    micro_batch: int = 1  # M = 8 micro-batches per step


QUICK = Setup(stages=(2,), steps=12, eval_every=4, eval_instances=8, max_docs=200, probe_steps=8)
FULL = Setup(stages=(2, 4), steps=128, eval_every=8, eval_instances=16, max_docs=1000,
             probe_steps=16)
CURVE_FLUSH = "1f1b"  # the flush schedule whose run gives every flush schedule's curve
SIM_SPAN = ParallelSection().span


def bench_pipeline(quick: bool, out_dir: str = "runs/bench-pipeline") -> dict[str, Any]:
    """Run every schedule for real (S = 2 and 4; S = 2 only and shorter with `quick`, < 3 min on
    2 cores), calibrate the simulator on those runs, predict S = 4..32. Returns the measurements,
    the predictions and the targets met or missed; writes the runs' metrics under `out_dir/runs`,
    the plot to `out_dir/pipeline.png` and the result to `out_dir/result.json`."""
    setup = QUICK if quick else FULL
    plan = [(S, name, run_steps(setup, S, name)) for S in setup.stages for name in SCHEDULES
            if _runs_for_real(name, S)]
    long = sum(n == setup.steps for _, _, n in plan)
    progress.start("pipeline", f"{len(plan)} runs (each schedule at S = "
                   f"{', '.join(map(str, setup.stages))} where the model is deep enough): "
                   f"{long} of {setup.steps} steps, {len(plan) - long} of {setup.probe_steps}")
    t0, load0 = time.perf_counter(), os.getloadavg()
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        data = Path(tmp) / "data"
        progress.report("preparing data, measuring a stage-to-stage transfer")
        prepare(None, data, f"bpe:{setup.vocab}", max_docs=setup.max_docs)
        transfer = measure_transfer((setup.micro_batch, setup.seq_len, _d_model()))
        real: dict[int, dict[str, dict[str, Any]]] = {}
        phases = {"prepare_s": time.perf_counter() - t0}
        with _private_ray():
            phases["ray_start_s"] = time.perf_counter() - t0 - phases["prepare_s"]
            for i, (S, name, steps) in enumerate(plan, start=1):
                progress.report(f"S = {S}, {name}, {steps} steps", i, len(plan))
                real.setdefault(S, {})[name] = _real_run(setup, S, name, steps, str(data),
                                                         out / "runs", Path(tmp) / "ckpt")
    phases["runs_s"] = time.perf_counter() - t0 - sum(phases.values())  # and Ray's shutdown
    M = setup.global_batch // setup.micro_batch
    for S, runs in real.items():
        for name, r in runs.items():
            r["predicted"] = _predict_real(r, name, S, M, transfer)
    costs = pooled_costs(real[setup.stages[0]])
    sim = {S: {name: _simulate_scaled(costs, name, S, M, transfer)
               for name in SCHEDULES if _fits(name, S, M)} for S in SIM_STAGES}
    same_model = {S: {name: _simulate_scaled(costs, name, S, M, transfer, deeper=False)
                      for name in SCHEDULES if _fits(name, S, M)} for S in SIM_STAGES}
    curves = heldout_curves(real, setup)
    ttt = _time_to_target(curves, sim, setup.stages[-1])
    result = {
        "bench": "pipeline", "quick": quick, "setup": setup.__dict__, "micro_per_batch": M,
        "async_a": M, "sim_span": SIM_SPAN,
        "tokens_per_step": setup.global_batch * setup.seq_len, "transfer_s": transfer,
        "loadavg": {"start": load0, "end": os.getloadavg()}, "pooled_costs": costs,
        "real": {str(S): runs for S, runs in real.items()},
        "simulated": {str(S): v for S, v in sim.items()},
        "simulated_same_model": {str(S): v for S, v in same_model.items()},
        "sensitivity_at_8": {
            f"{model},transfer={tr_name},span={span}": {
                name: _simulate_scaled(costs, name, 8, M, tr, span, deeper=model == "deeper")
                for name in ("1f1b", "paci")}
            for model in ("deeper", "same_model")
            for tr_name, tr in (("measured", transfer), ("0", 0.0)) for span in (SIM_SPAN, 8)},
        "time_to_target": ttt,
        "time_to_target_same_model": _time_to_target(curves, same_model, setup.stages[-1]),
        "targets": _targets(real, sim, ttt, setup.stages[0]),
    }
    out.mkdir(parents=True, exist_ok=True)
    result["plot"] = _plot(result, curves, str(out / "pipeline.png"))
    result["seconds"] = time.perf_counter() - t0
    result["phases_s"] = {**phases, "analysis_s": result["seconds"] - sum(phases.values())}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _d_model() -> int:
    from relaytrain.model.config import PRESETS

    return PRESETS["small"].d_model


# ---- real runs -------------------------------------------------------------------------------


@contextmanager
def _private_ray() -> Iterator[None]:
    """One private token-authenticated Ray cluster for all runs (the engine reuses it)."""
    from relaytrain.runtime.engines.ray import _import_ray

    _import_ray(private_cluster=True)
    import ray

    owned = not ray.is_initialized()
    if owned:
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False)
    try:
        yield
    finally:
        if owned:
            ray.shutdown()


def _runs_for_real(name: str, S: int) -> bool:
    """Whether the preset has a layer for every virtual stage of `name` on S stages."""
    return S * (VIRTUAL if name == "interleaved-1f1b" else 1) <= SMALL_LAYERS


def run_steps(setup: Setup, S: int, name: str) -> int:
    """The length of the run of `name` on S stages: `setup.steps` where its held-out curve is
    used (asynchronous schedules, and `CURVE_FLUSH` at the shallowest S for every flush
    schedule), else `setup.probe_steps` (see the module docstring)."""
    curve = asynchronous(name) or (name == CURVE_FLUSH and S == setup.stages[0])
    return setup.steps if curve else setup.probe_steps


def heldout_curves(real: dict[int, dict[str, dict[str, Any]]], setup: Setup
                   ) -> dict[str, list[list[float]]]:
    """Each schedule's held-out curve for the time to target: an asynchronous schedule's from
    its run in the deepest real pipeline (staleness grows with S, so its counts are optimistic
    for deeper ones), a flush schedule's `CURVE_FLUSH`'s (the same updates at any S)."""
    deepest, flush = real[setup.stages[-1]], real[setup.stages[0]][CURVE_FLUSH]["heldout"]
    return {name: deepest[name]["heldout"] if asynchronous(name) else flush
            for name in SCHEDULES}


def _real_run(setup: Setup, S: int, name: str, steps: int, data: str, runs: Path, ckpt: Path,
              overrides: Sequence[str] = ()) -> dict[str, Any]:
    """One training run of schedule `name` on S stages, `steps` long (config `overrides` last,
    for A/B runs of an option); its measurements from metrics.jsonl."""
    from relaytrain.runtime.controller import Controller

    run_dir = runs / f"S{S}-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an old run there would be resumed
    shutil.rmtree(ckpt, ignore_errors=True)
    M = setup.global_batch // setup.micro_batch
    options = _options(name, M)
    chosen = [f"{OPTION_KEYS[k]}={str(v).lower()}" for k, v in options.items()]
    cfg = load_config(None, [
        f"run_dir={run_dir}", f"data.path={data}", "model.preset=small",
        f"data.seq_len={setup.seq_len}", f"train.max_steps={steps}",
        f"train.global_batch={setup.global_batch}", f"train.micro_batch={setup.micro_batch}",
        "optim.lr=3e-3", f"optim.warmup={max(1, setup.steps // 10)}",
        f"eval.every={setup.eval_every}", f"eval.instances={setup.eval_instances}",
        "eval.memo_gap=1e9",  # early in training held-out and training loss differ a lot
        "checkpoint.every=0", f"checkpoint.url={ckpt}", f"parallel.pp={S}",
        f"parallel.schedule={name}", f"parallel.span={setup.eval_every}",
        "runtime.engine=ray", "log.progress=false", *chosen, *overrides])
    t0 = time.perf_counter()
    Controller(cfg, quiet=True).run()
    run_s = time.perf_counter() - t0
    return {**summarise_run(run_dir, S, setup.eval_every if asynchronous(name) else 1,
                            options.get("virtual", 1)),
            "run_s": run_s}


def summarise_run(run_dir: Path, S: int, span: int, chunks: int = 1) -> dict[str, Any]:
    """Time per step, throughput, per-stage bubble / memory / op costs (medians over the spans
    after the first, which pays one-off warm-up; per micro-batch at the whole stage, so summed
    over its `chunks`), and the held-out curve against steps and against cumulative training
    time (the controller's per-step time, evaluations excluded)."""
    steps, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "step":
            steps[rec["step"]] = rec
        elif rec["kind"] == "eval":
            evals[rec["step"]] = rec["heldout_loss"]
    order = sorted(steps)
    wall = {k: steps[k]["tokens"] / k / steps[k]["tokens_per_s"] for k in order}
    spans = [order[i] for i in range(span - 1, len(order), span)]  # last step of each span
    later = spans[1:] or spans
    stages = [str(i) for i in range(S)]

    def per_stage(key: str, how: Any = statistics.median) -> list[float]:
        return [how([steps[k]["pipeline"][s][key] for k in later]) for s in stages]

    elapsed, curve = 0.0, []
    for k in order:
        elapsed += wall[k]
        if k in evals:
            curve.append([k, evals[k], elapsed])
    span_time = statistics.median(max(steps[k]["pipeline"][s]["span_s"] for s in stages) / span
                                  for k in later)
    time_per_step = statistics.median(wall[k] for k in order if k > spans[0])
    return {
        "time_per_step_s": time_per_step, "pipeline_time_per_step_s": span_time,
        "tokens_per_s": steps[order[-1]]["tokens"] / order[-1] / time_per_step,
        "bubble": per_stage("bubble", statistics.mean),
        "peak_memory": per_stage("peak_memory", max),
        "weight_versions": per_stage("weight_versions", max),
        "staleness_max": [max(max(steps[k]["pipeline"][s]["staleness"]) for k in order)
                          for s in stages],
        "costs": {"forward": [chunks * c for c in per_stage("forward_s")],
                  "backward": [chunks * c for c in per_stage("backward_s")],
                  "update": per_stage("update_s"),
                  "weight": [chunks * c for c in per_stage("weight_s")]},
        "heldout": curve, "span": span, "steps": order[-1],
    }


# ---- transfer cost ---------------------------------------------------------------------------


def _pingpong(rank: int, access: StoreAccess, shape: tuple[int, ...], repeats: int,
              queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from relaytrain.runtime import rendezvous

    store = rendezvous.join(access, timeout_s=60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    buf = torch.zeros(shape)
    for i in range(repeats + 5):  # 5 warm-up round trips
        if i == 5:
            t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    if rank == 0:
        queue.put((time.perf_counter() - t0) / (2 * repeats))
    dist.destroy_process_group()


def measure_transfer(shape: tuple[int, ...], repeats: int = 200) -> float:
    """Seconds one activation tensor of `shape` (fp32) takes between two gloo processes: half
    a blocking ping-pong round trip."""
    import multiprocessing as mp

    from relaytrain.runtime import rendezvous

    store = rendezvous.serve("127.0.0.1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_pingpong, args=(r, store.access, shape, repeats, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        return float(queue.get(timeout=120))
    finally:
        for p in procs:
            p.join(timeout=30)
        store.close()


# ---- simulation ------------------------------------------------------------------------------


def _stage_bubbles(actions: Schedule, cost: Costs, synchronised: bool
                   ) -> tuple[float, list[float]]:
    """Makespan and each stage's idle share of its own active time (what the runtime measures:
    a stage's span ends when its own list does; a flush list's last U waits for every stage)."""
    res = simulate(actions, cost, timeline=True, synchronised_updates=synchronised)
    end = [0.0] * len(actions)
    for span in res.timeline:
        end[span.stage] = max(end[span.stage], span.end)
    return res.makespan, [1 - b / e if e else 0.0 for b, e in zip(res.busy, end, strict=True)]


def _fits(name: str, S: int, M: int) -> bool:
    """Whether schedule `name` takes M micro-batches per step on S stages: interleaved-1f1b
    sends them round in groups of S (so not at S = 16 and 32 with the bench's M = 8)."""
    return name != "interleaved-1f1b" or M % S == 0


# The config key of each schedule option the bench chooses (`_options`)
OPTION_KEYS = {"a": "parallel.paci.a", "split": "parallel.paci.split",
               "virtual": "parallel.virtual_stages"}


def _options(name: str, M: int) -> dict[str, Any]:
    """The bench's choices, for the real runs (as config, `OPTION_KEYS`) and the simulated
    lists alike: asynchronous schedules update once per global batch (a = M), paci's lists
    are split (see the module docstring), interleaved-1f1b has `VIRTUAL` chunks per stage."""
    options: dict[str, Any] = {"a": M} if asynchronous(name) else {}
    if name == "paci":
        options["split"] = True
    if name == "interleaved-1f1b":
        options["virtual"] = VIRTUAL
    return options


def _schedule(name: str, S: int, M: int, n_batches: int) -> Schedule:
    """The bench's lists (`_options`)."""
    return build_schedule(name, S, M, n_batches, **_options(name, M))


def _is_split(name: str) -> bool:
    return split(_schedule(name, 1, 1, 1)[0])


def _predict_real(run: dict[str, Any], name: str, S: int, M: int, transfer: float
                  ) -> dict[str, Any]:
    """The simulator given this run's own per-stage costs, against what the run measured."""
    c = run["costs"]
    whole = tuple(b + w for b, w in zip(c["backward"], c["weight"], strict=True))
    cost = Costs(tuple(c["forward"]), whole, tuple(c["update"]), transfer,
                 weight=tuple(c["weight"]) if _is_split(name) else None)
    makespan, bubbles = _stage_bubbles(_schedule(name, S, M, run["span"]), cost,
                                       not asynchronous(name))
    per_step = makespan / run["span"]
    return {"pipeline_time_per_step_s": per_step,
            "error": per_step / run["pipeline_time_per_step_s"] - 1,
            "bubble": bubbles,
            "bubble_error": statistics.mean(bubbles) - statistics.mean(run["bubble"])}


def pooled_costs(runs: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """Per op and stage, the median of the costs the runs measured: F and U over all runs but
    the interleaved one (its chunks' smaller products run at another speed), B over the runs of
    whole backwards; over the runs of split lists (if any), their F (`split_forward`: what
    recording the deferred layers costs included), B (`split_backward`, the input gradient) and
    W (`weight`)."""
    def median(op: str, of: list[dict[str, Any]]) -> list[float]:
        n = len(of[0]["costs"][op])
        return [statistics.median(r["costs"][op][i] for r in of) for i in range(n)]

    every = [r for name, r in runs.items() if name != "interleaved-1f1b"]
    split_runs = [r for r in every if any(r["costs"].get("weight", ()))]
    whole = [r for r in every if r not in split_runs] or every
    out = {"forward": median("forward", every), "backward": median("backward", whole),
           "update": median("update", every)}
    if split_runs:
        out |= {"split_forward": median("forward", split_runs),
                "split_backward": median("backward", split_runs),
                "weight": median("weight", split_runs)}
    return out


def scaled_costs(costs: dict[str, list[float]], S: int, transfer: float, *, deeper: bool = True,
                 split_lists: bool = False) -> Costs:
    """S equal stages with `transfer` per hop. `deeper`: every stage does what one measured stage
    did (their mean: a balanced cut), i.e. a model S / S_real times deeper, as pipelines are used
    (the paper: 24 layers on 8 stages); else the measured model itself cut into S stages of 1/S of
    its work, which the runtime can only build up to n_layers stages and whose thinning stages
    make the fixed transfer weigh S / S_real times more. `split_lists`: the costs of split
    lists (F, B and W as measured in their runs; what splitting costs extra included)."""
    n = len(costs["forward"]) if deeper else S
    forward, backward, weight = sum(costs["forward"]) / n, sum(costs["backward"]) / n, 0.0
    if split_lists:
        forward, weight = sum(costs["split_forward"]) / n, sum(costs["weight"]) / n
        backward = sum(costs["split_backward"]) / n + weight
    return Costs.uniform(S, forward=forward, backward=backward,
                         update=sum(costs["update"]) / n, transfer=transfer, weight=weight)


def _simulate_scaled(costs: dict[str, list[float]], name: str, S: int, M: int, transfer: float,
                     span: int = SIM_SPAN, *, deeper: bool = True) -> dict[str, Any]:
    """`scaled_costs` dispatched in spans of `span` steps (flush schedules: any span gives the
    same time per step)."""
    cost = scaled_costs(costs, S, transfer, deeper=deeper, split_lists=_is_split(name))
    res = simulate(_schedule(name, S, M, span), cost, synchronised_updates=not asynchronous(name))
    per_step = res.makespan / span
    return {"time_per_step_s": per_step, "utilisation": res.utilisation,
            "bubble": res.bubble_fraction}


def steps_to_target(curve: list[list[float]], target: float) -> float | None:
    """The (linearly interpolated) step at which a held-out curve first reaches `target`."""
    prev_step, prev_loss = 0.0, math.inf
    for step, loss, _ in curve:
        if loss <= target:
            if math.isinf(prev_loss):
                return float(step)
            return prev_step + (step - prev_step) * (prev_loss - target) / (prev_loss - loss)
        prev_step, prev_loss = step, loss
    return None


def _time_to_target(curves: dict[str, list[list[float]]],
                    sim: dict[int, dict[str, dict[str, Any]]], real_S: int) -> dict[str, Any]:
    """Steps each schedule's held-out curve (`heldout_curves`) needed x its simulated time per
    step."""
    target = max(min(loss for _, loss, _ in curve) for curve in curves.values())
    steps = {name: steps_to_target(curves[name], target) for name in SCHEDULES}
    seconds = {str(S): {name: (None if steps[name] is None
                               else steps[name] * v[name]["time_per_step_s"])
                        for name in v} for S, v in sim.items()}
    return {"target_heldout_loss": target, "steps_from_real_S": real_S,
            "steps": steps, "seconds": seconds}


def _targets(real: dict[int, dict[str, dict[str, Any]]], sim: dict[int, dict[str, Any]],
             ttt: dict[str, Any], real_S: int) -> dict[str, Any]:
    util = {str(S): sim[S]["paci"]["utilisation"] for S in sim}
    util[f"real_{real_S}"] = 1 - statistics.mean(real[real_S]["paci"]["bubble"])
    memory = {str(S): max(r["paci"]["peak_memory"]) / max(r["1f1b"]["peak_memory"])
              for S, r in real.items()}
    at8 = ttt["seconds"]["8"]
    flush = [at8[n] for n in FLUSH_SCHEDULES if at8[n] is not None]
    speedup = (min(flush) / at8["paci"]) if flush and at8["paci"] else None
    return {
        "paci_utilisation": {"value": util, "target": TARGETS["paci_utilisation"],
                             "met_at_8": util["8"] >= TARGETS["paci_utilisation"]},
        "paci_memory_vs_1f1b": {"value": memory, "target": TARGETS["paci_memory_vs_1f1b"],
                                "met": max(memory.values()) <= TARGETS["paci_memory_vs_1f1b"]},
        "paci_speedup_at_8": {"value": speedup, "target": TARGETS["paci_speedup_at_8"],
                              "met": speedup is not None
                              and speedup >= TARGETS["paci_speedup_at_8"]},
        **_baseline_targets(real, sim),
    }


def _baseline_targets(real: dict[int, dict[str, dict[str, Any]]],
                      sim: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """zb-h1 and interleaved-1f1b against 1f1b (simulated utilisation at S = 8; zb-h1's real
    peak memory), and the simulator against the real runs: its mean bubble minus theirs, every
    schedule and depth."""
    util = {name: sim[8][name]["utilisation"] for name in ("1f1b", "zb-h1", "interleaved-1f1b")}
    memory = {str(S): max(r["zb-h1"]["peak_memory"]) / max(r["1f1b"]["peak_memory"])
              for S, r in real.items()}
    errors = {str(S): {name: r[name]["predicted"]["bubble_error"] for name in r}
              for S, r in real.items()}
    worst = max(abs(e) for per_s in errors.values() for e in per_s.values())
    return {
        "zb_h1_utilisation_vs_1f1b_at_8": {"value": util, "met": util["zb-h1"] > util["1f1b"]},
        "interleaved_utilisation_vs_1f1b_at_8": {
            "value": util, "met": util["interleaved-1f1b"] > util["1f1b"]},
        "zb_h1_memory_vs_1f1b": {"value": memory, "target": TARGETS["zb_h1_memory_vs_1f1b"],
                                 "met": max(memory.values()) <= TARGETS["zb_h1_memory_vs_1f1b"]},
        "simulated_bubble_error": {"value": errors, "target": TARGETS["simulated_bubble_error"],
                                   "met": worst <= TARGETS["simulated_bubble_error"]},
    }


# ---- plot ------------------------------------------------------------------------------------


def _plot(result: dict[str, Any], curves: dict[str, list[list[float]]], path: str) -> str:
    """Held-out loss against simulated time at S = 8 (left) and against real training time at
    S = 2 (right), every schedule; a flush run stopped early (`run_steps`) is drawn dashed, its
    schedule's curve at its own median time per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_sim, ax_real) = plt.subplots(1, 2, figsize=(12, 4.5))
    sim8 = result["simulated"]["8"]
    stages = result["setup"]["stages"]
    for name in SCHEDULES:
        per_step = sim8[name]["time_per_step_s"]
        ax_sim.plot([s * per_step for s, _, _ in curves[name]], [v for _, v, _ in curves[name]],
                    "o-", ms=3, label=name)
        run = result["real"][str(stages[0])][name]  # every schedule runs at S=2
        whole = run["steps"] == result["setup"]["steps"]
        curve2 = run["heldout"] if whole else [
            [s, v, s * run["time_per_step_s"]] for s, v, _ in curves[name]]
        ax_real.plot([t for _, _, t in curve2], [v for _, v, _ in curve2],
                     "o-" if whole else "o--", ms=3, label=name)
    target = result["time_to_target"]["target_heldout_loss"]
    for ax in (ax_sim, ax_real):
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("held-out loss (nats)")
        ax.legend()
    ax_sim.set_xlabel(f"simulated time at S = 8 (s; steps from the real S = {stages[-1]} runs)")
    ax_real.set_xlabel(f"real training time at S = {stages[0]} (s; dashed: {CURVE_FLUSH}'s "
                       "curve at the run's time per step)")
    fig.suptitle("relaytrain bench pipeline: small preset, "
                 f"{result['micro_per_batch']} micro-batches per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
