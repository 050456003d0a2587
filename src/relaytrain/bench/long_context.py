"""`relaytrain bench long-context`: context parallelism on the `small` preset at the longest
sequence this machine holds (within a cap, below): per-step time and peak resident memory per
worker at cp 1, 2 and 4 (real runs on Ray actors); the activation memory of a worker's step
(a forward and backward per rank on gloo ranks), all measured above its weights and gradients,
both allocated before the step: the bytes it saves for backward (`model.memory.SavedBytes`),
the peak bytes of the tensors alive at once, saved and temporaries (`LiveBytes`: the target's
measure, what CUDA's `max_memory_allocated` counts on a GPU), and its process's peak resident
growth (which also holds code pages first touched, gloo's and malloc's buffers); and the bytes
the busiest rank receives in the step for sliding and for full layers, measured as its
exchanges hand them to gloo (`parallel.context.metering`), against what gathering every key
would move. And what bit identity across cp degrees would cost (`chunked_weight_grads`,
docs/DETERMINISM.md): the small preset's weight-gradient products over a sequence formed per
fixed token chunk, each folded into exact mode's fixed-point integers, against one product and
one fold (exact mode today) and one product (fast mode).

The sequence is measured, not fixed: the longest power of two whose cp 1 step fits a budget of
half the memory the machine has available (`longest_sequence`: a worker's state plus its
activations, per token as measured at `PROBE_SEQ`), capped at `SEQ_CAP` tokens. Why a cap: on
a 2-core host a cp 1 step of `small` takes seconds per thousand tokens, and the bench trains
three runs of several steps, each starting its Ray workers; at 2,048 tokens that is 74 s of CPU
(9 min of wall time under a load average of 30: docs/MEASURED.md), where memory alone would
allow 32,768 tokens, 16 times the tokens a step (more for full layers, quadratic in them).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relaytrain.bench import progress
from relaytrain.bench.common import demo_data, run_training
from relaytrain.data.dataset import TokenDataset
from relaytrain.model.accounting import param_count
from relaytrain.model.config import PRESETS, SLIDING, Olmo3Config
from relaytrain.model.init import init_weights
from relaytrain.model.matmul import Linear
from relaytrain.model.memory import LiveBytes, SavedBytes
from relaytrain.model.olmo3 import Olmo3
from relaytrain.parallel.context import ContextGroup, ContextSplit, metering, plan_attention
from relaytrain.parallel.reduce import fold_kernel_builds, fold_packed, pack_bound, pack_shift
from relaytrain.runlog import read_metrics
from relaytrain.train.metrics import proc_bytes
from relaytrain.train.stepper import peak_rss, reset_peak_rss

DEGREES = (1, 2, 4)
STAGE3_SEQ, STAGE3_WINDOW = 65_536, 4_096
PROBE_SEQ = 256  # the step whose memory per token sizes the sequence
SEQ_CAP = 2_048  # tokens at most (module docstring: why)
# token chunks a weight gradient would be formed in: bit identity across cp 1, 2 (and 4)
# needs the chunks of the finest split, 2 x cp (the zig-zag's)
CHUNKS = (2, 4, 8)


def fetched_tokens(seq_len: int, cp: int, window: int | None) -> int:
    """Key tokens the busiest rank fetches per layer and sequence, as the plan lays them out
    (`AttentionPlan.wire_tokens`): for lengths too long to run here (Olmo 3's stage 3)."""
    return max(plan_attention(ContextSplit(seq_len, cp, r), window).wire_tokens
               for r in range(cp))


def exchange_bytes(tokens: int, kv_width: int, exact: bool) -> int:
    """Bytes a rank receives for `tokens` fetched keys: K and V in the forward and again in the
    backward, and the dK/dV contributions its peers return (int64 limb pairs in exact mode:
    4x float32's). What gathering every key would move, to compare the measured bytes with."""
    kv = 2 * tokens * kv_width * 4
    return 2 * kv + kv * (4 if exact else 1)


def weight_shapes(cfg: Olmo3Config) -> list[tuple[int, int]]:
    """(out, in) of every linear layer's weight of `cfg` (its vocabulary set), the head's
    included: the weight gradients a backward forms as products over the tokens (dY^T X).
    Read from the model itself, built without memory."""
    with torch.device("meta"):
        model = Olmo3(cfg)
    return [(m.weight.shape[0], m.weight.shape[1]) for m in model.modules()
            if isinstance(m, Linear)]


def chunked_weight_grads(cfg: Olmo3Config, seq_len: int, chunks: Sequence[int] = CHUNKS,
                         repeats: int = 7) -> dict[str, Any]:
    """Median seconds (one thread, as the bench's workers) of `cfg`'s weight gradients for
    one sequence of `seq_len` tokens: `one` product over the sequence (fast mode), `exact`
    that product folded into the fixed-point integers (`reduce.fold_packed`, as exact mode
    folds a micro-batch's gradient), and per C in `chunks` C products over the sequence's C
    token chunks each folded (what bit identity across cp degrees would need of every linear
    layer); `ratio`: C's over exact's, `over_one`: over fast mode's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        pairs = [(torch.randn(seq_len, o, generator=gen) * 1e-3,
                  torch.randn(seq_len, i, generator=gen))
                 for o, i in weight_shapes(cfg)]
        accs = [torch.zeros(dy.shape[1], x.shape[1], dtype=torch.int64) for dy, x in pairs]
        fused = fold_kernel_builds()

        def run(c: int | None) -> float:
            n = c or 1
            shift, bound = pack_shift(n), pack_bound(n)
            t0 = time.perf_counter()
            for (dy, x), acc in zip(pairs, accs, strict=True):
                for dyc, xc in zip(dy.chunk(n), x.chunk(n), strict=True):
                    g = dyc.T @ xc
                    if c is not None:
                        fold_packed(g, acc, shift, bound, False, fused)
            return time.perf_counter() - t0

        variants: list[int | None] = [None, 1, *chunks]
        for c in variants:
            run(c)  # warm: kernels, pages
        # each repeat times every variant in turn, so a shared host's load drifts over all alike
        times = [[run(c) for c in variants] for _ in range(repeats)]
        one, exact, *chunked = (statistics.median(t[k] for t in times)
                                for k in range(len(variants)))
        out: dict[str, Any] = {"seq_len": seq_len, "vocab": cfg.vocab_size, "fused_fold": fused,
                               "repeats": repeats, "one_s": one, "exact_s": exact, "chunks": {}}
        for c, t in zip(chunks, chunked, strict=True):
            out["chunks"][str(c)] = {"s": t, "ratio": t / exact, "over_one": t / one}
        return out
    finally:
        torch.set_num_threads(threads)


def _step_memory(rank: int, cp: int, seq_len: int, port: int, out: str, resident: bool
                 ) -> None:
    """Rank `rank` of `cp`: a forward and backward of the small preset on its part of a
    sequence, its gradients allocated before (a training step's baseline: weights, gradients;
    optimizer state is untouched by the step). Written to `out`/rank (JSON): the bytes it saved
    for backward, the peak bytes of the tensors alive at once (`LiveBytes`), the bytes its
    exchanges received per layer kind (as handed to gloo), and, with `resident`, its process's
    peak resident growth over a step before, run without the meters (whose Python bookkeeping
    would be in it)."""
    torch.set_num_threads(1)
    if cp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=cp)
        dist.barrier()  # the group's connections up before the step, as a worker's are
    cfg = PRESETS["small"].with_vocab(2048)
    model = Olmo3(cfg)
    init_weights(model, 0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tokens = torch.randint(0, 2048, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    kwargs = {}
    if cp > 1:
        context = ContextGroup(ContextSplit(seq_len, cp, rank), dist.group.WORLD)
        inputs, labels = context.split.local(inputs), context.split.local(labels)
        kwargs["context"] = context
    def step() -> None:
        model(inputs, labels=labels, **kwargs)[0].backward()

    growth = 0
    if resident:  # a step of its own: the meters' bookkeeping kept out of the resident size
        before = proc_bytes("/proc/self/status", "VmRSS") or 0
        reset_peak_rss()
        step()
        growth = max(0, peak_rss() - before)
    counter = SavedBytes(model.parameters())
    held = [t for p in model.parameters() for t in (p, p.grad)]
    with counter.counting(), metering() as wire, LiveBytes(held) as live:
        step()
    Path(out, str(rank)).write_text(json.dumps({
        "saved": counter.nbytes, "growth": growth, "live": live.peak,
        "wire": {str(w): n for w, n in wire.received.items()}}))
    if cp > 1:
        dist.destroy_process_group()


def step_memory(seq_len: int, cp: int, resident: bool = True) -> dict[str, Any]:
    """Over `cp` ranks' steps of one sequence, the most any rank saves for backward (`saved`),
    holds in live tensors at once (`live`), grows its resident size by (`growth`; 0 where /proc
    is missing or without `resident`), and receives for each layer kind's exchanges (`wire`:
    window, or "None" for full layers -> bytes of the step, all such layers together)."""
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as out:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_step_memory, args=(cp, seq_len, port, out, resident), nprocs=cp)
        ranks = [json.loads(Path(out, str(r)).read_text()) for r in range(cp)]
        kinds = {w for r in ranks for w in r["wire"]}
        return {**{k: max(r[k] for r in ranks) for k in ("saved", "live", "growth")},
                "wire": {w: max(r["wire"].get(w, 0) for r in ranks) for w in kinds}}


def longest_sequence(available: int, per_token: float, cap: int = SEQ_CAP) -> dict[str, Any]:
    """The longest power of two (at least `PROBE_SEQ`) whose cp 1 step of `small` fits half of
    `available` bytes: a worker's state (16 bytes a parameter: weights, gradients, AdamW's
    moments) plus its step's peak resident growth, `per_token` bytes a token (as measured at
    `PROBE_SEQ`: attention runs in blocks, no T x T scores, so it grows about linearly); and
    that capped at `cap` (the module docstring says why)."""
    budget = available // 2
    state = 16 * param_count(PRESETS["small"].with_vocab(2048))
    holds = PROBE_SEQ
    while state + per_token * holds * 2 <= budget:
        holds *= 2
    return {"budget": budget, "bytes_per_token": round(per_token), "state": state,
            "holds": holds, "cap": cap, "seq_len": min(holds, cap)}


def bench_long_context(quick: bool = False) -> dict[str, Any]:
    """`--quick`: 512 tokens, 3 steps (the plumbing); else the measured sequence, 5 steps."""
    cfg = PRESETS["small"]
    choice = None if quick else longest_sequence(
        proc_bytes("/proc/meminfo", "MemAvailable") or 0,
        max(1, step_memory(PROBE_SEQ, 1)["growth"]) / PROBE_SEQ)
    seq, steps = (512, 3) if choice is None else (choice["seq_len"], 5)
    out: dict[str, Any] = {"preset": "small", "seq_len": seq, "steps": steps,
                           "sequence_choice": choice, "window": cfg.sliding_window,
                           "runs": {}, "exchange": {}}
    progress.start("long-context", f"{len(DEGREES)} training runs of {steps} steps at {seq} "
                   "tokens: " + ", ".join(f"cp{c}" for c in DEGREES))
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        data = demo_data(tmp)
        common = [f"data.path={data}", "model.preset=small", f"model.max_seq_len={seq}",
                  f"data.seq_len={seq}", "train.global_batch=1", "train.micro_batch=1",
                  f"train.max_steps={steps}", "runtime.engine=ray",
                  "runtime.threads_per_worker=1"]
        for i, cp in enumerate(DEGREES, 1):
            progress.report(f"cp{cp}", i, len(DEGREES))
            run = os.path.join(tmp, f"cp{cp}")
            run_training([*common, f"run_dir={run}", f"parallel.cp={cp}"])
            recs = read_metrics(run).steps[1:]  # the first step builds kernels
            memory = step_memory(seq, cp)
            out["runs"][f"cp{cp}"] = {
                "step_s": statistics.median(r["time_compute"] for r in recs),
                "peak_rss_mib": max(r["peak_rss"] for r in recs) / 2**20,
                **{f"{k}_mib": memory[k] / 2**20 for k in ("saved", "live", "growth")}}
            out["exchange"][f"cp{cp}"] = memory["wire"]
        vocab = TokenDataset.open(data).vocab_size
        out["chunked_grads"] = chunked_weight_grads(cfg.with_vocab(vocab), seq)
    step = out["runs"]["cp1"]["step_s"]
    for v in out["chunked_grads"]["chunks"].values():  # the seconds C chunks add to a step
        v["step_ratio"] = 1 + (v["s"] - out["chunked_grads"]["exact_s"]) / step
    for key in ("saved", "live", "growth"):  # the issue's target: <= 1.2 x cp 1's / cp
        one = out["runs"]["cp1"][f"{key}_mib"]
        for cp in DEGREES[1:]:
            run = out["runs"][f"cp{cp}"]
            run[f"{key}_over_share"] = run[f"{key}_mib"] / (one / cp) if one else None
    kv_width = cfg.n_kv_heads * cfg.head_dim
    sliding_layers = sum(t == SLIDING for t in cfg.layer_types)
    layers = {str(cfg.sliding_window): sliding_layers, "None": cfg.n_layers - sliding_layers}
    del out["exchange"]["cp1"]  # nothing exchanged
    for cp in DEGREES[1:]:
        wire = out["exchange"][f"cp{cp}"]
        sliding, full = (wire.get(k, 0) // n for k, n in layers.items())
        gather = exchange_bytes(seq - seq // cp, kv_width, exact=False)
        out["exchange"][f"cp{cp}"] = {
            "sliding_bytes": sliding, "full_bytes": full, "all_gather_bytes": gather,
            "sliding_over_gather": sliding / gather, "target": cfg.sliding_window / (seq / cp)}
    out["sliding_layers"] = sliding_layers
    # Olmo 3's stage 3 (65,536 tokens, cp 8, a 4,096 window): from the plan (not run here)
    stage3 = (fetched_tokens(STAGE3_SEQ, 8, STAGE3_WINDOW), STAGE3_SEQ - STAGE3_SEQ // 8)
    out["stage3_fetched_tokens"] = {"sliding": stage3[0], "all_gather": stage3[1],
                                    "ratio": stage3[0] / stage3[1],
                                    "target": STAGE3_WINDOW / (STAGE3_SEQ / 8)}
    return out


def _share(v: dict[str, Any], key: str) -> str:
    ratio = v.get(f"{key}_over_share")
    return f" ({ratio:.2f})" if ratio is not None else ""


def format_report(r: dict[str, Any]) -> str:
    c = r["sequence_choice"]
    lines = [f"long context, small preset, {r['seq_len']} tokens, {r['steps']} steps"]
    if c is None:
        lines.append("  (--quick: 512 tokens, not measured)")
    else:
        lines.append(
            f"  sequence: the longest power of two whose cp 1 step fits half the available "
            f"memory ({c['budget'] / 2**30:.1f} GiB: state {c['state'] / 2**20:.0f} MiB + "
            f"{c['bytes_per_token']:,} B a token) holds {c['holds']:,} tokens, capped at "
            f"{c['cap']:,} so the bench ends in minutes on a 2-core host")
    lines.append("per worker: median step seconds, peak resident MiB (Ray runs); a step's "
                 "activation memory (the busiest rank's, above its weights and gradients, "
                 "both allocated before the step; measured): MiB saved for backward, peak MiB "
                 "of tensors alive at once (saved and temporaries: the target's measure), "
                 "peak resident growth of the process (also code pages, gloo's and malloc's "
                 "buffers), each with its ratio to cp 1's / cp (target <= 1.2):")
    lines += [f"  {k:<5} {v['step_s']:8.3f} s {v['peak_rss_mib']:7.0f} MiB "
              f"{v['saved_mib']:8.1f} saved{_share(v, 'saved')} "
              f"{v['live_mib']:8.1f} live{_share(v, 'live')} "
              f"{v['growth_mib']:8.1f} growth{_share(v, 'growth')}"
              for k, v in r["runs"].items()]
    lines.append(f"bytes the busiest rank receives per layer and sequence, measured as its "
                 f"exchanges hand them to gloo (fast mode; window {r['window']}), against "
                 f"gathering every key:")
    for k, v in r["exchange"].items():
        lines.append(f"  {k:<5} sliding {v['sliding_bytes']:>12,}  full {v['full_bytes']:>12,}"
                     f"  all-gather {v['all_gather_bytes']:>12,}  sliding/gather "
                     f"{v['sliding_over_gather']:.3f} (target <= {v['target']:.3f})")
    g = r["chunked_grads"]
    lines.append(f"bit identity across cp degrees: every weight gradient of a sequence formed "
                 f"per token chunk and each folded into the fixed-point integers, one thread "
                 f"(fused fold: {g['fused_fold']}); one product {g['one_s']:.4f} s, one product "
                 f"+ one fold (exact mode today) {g['exact_s']:.4f} s:")
    lines += [f"  {c} chunks {v['s']:.4f} s: {v['ratio']:.2f}x exact's weight-gradient work, "
              f"{v['over_one']:.2f}x one product's; the cp 1 step x {v['step_ratio']:.3f}"
              for c, v in g["chunks"].items()]
    s = r["stage3_fetched_tokens"]
    lines.append(f"  65,536 tokens at cp 8, window 4,096 (the plan's count): a rank fetches "
                 f"{s['sliding']:,} keys "
                 f"for a sliding layer where gathering fetches {s['all_gather']:,} "
                 f"({s['ratio']:.3f}; target <= {s['target']:.3f})")
    return "\n".join(lines) + "\n" + json.dumps(r)
