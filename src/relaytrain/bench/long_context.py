"""`relaytrain bench long-context`: context parallelism on the `small` preset at a long
sequence: per-step time and peak resident memory per worker at cp 1, 2 and 4 (real runs on Ray
actors; the resident peak is mostly the process's own at these sizes), the activation bytes a
worker saves for backward (one forward per rank on gloo ranks, counted by `model.memory`), and
the bytes a rank exchanges per step for sliding layers against gathering every key (from the
attention plans: what the exchange moves, counted, not timed)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relaytrain.bench import progress
from relaytrain.bench.common import demo_data, run_training
from relaytrain.model.config import PRESETS, SLIDING
from relaytrain.model.init import init_weights
from relaytrain.model.memory import SavedBytes
from relaytrain.model.olmo3 import Olmo3
from relaytrain.parallel.context import ContextGroup, ContextSplit, plan_attention
from relaytrain.runlog import read_metrics

DEGREES = (1, 2, 4)
STAGE3_SEQ, STAGE3_WINDOW = 65_536, 4_096


def fetched_tokens(seq_len: int, cp: int, window: int | None) -> int:
    """Key tokens the busiest rank fetches per layer and sequence (`AttentionPlan`)."""
    return max(plan_attention(ContextSplit(seq_len, cp, r), window).fetched_tokens
               for r in range(cp))


def exchange_bytes(tokens: int, kv_width: int, exact: bool) -> int:
    """Bytes a rank receives for `tokens` fetched keys: K and V in the forward and again in the
    backward, and the dK/dV contributions its peers return (int64 limb pairs in exact mode:
    4x float32's)."""
    kv = 2 * tokens * kv_width * 4
    return 2 * kv + kv * (4 if exact else 1)


def _saved_bytes(rank: int, cp: int, seq_len: int, port: int, out: str) -> None:
    """Rank `rank` of `cp`: one forward of the small preset on its part of a sequence, the bytes
    it saves for backward written to `out`/rank (then the backward, which its peers need)."""
    torch.set_num_threads(1)
    if cp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=cp)
    cfg = PRESETS["small"].with_vocab(2048)
    model = Olmo3(cfg)
    init_weights(model, 0)
    tokens = torch.randint(0, 2048, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    kwargs = {}
    if cp > 1:
        context = ContextGroup(ContextSplit(seq_len, cp, rank), dist.group.WORLD)
        inputs, labels = context.split.local(inputs), context.split.local(labels)
        kwargs["context"] = context
    counter = SavedBytes(model.parameters())
    with counter.counting():
        loss = model(inputs, labels=labels, **kwargs)[0]
    loss.backward()
    Path(out, str(rank)).write_text(str(counter.nbytes))
    if cp > 1:
        dist.destroy_process_group()


def activation_bytes(seq_len: int, cp: int) -> int:
    """The most bytes any of `cp` ranks saves for backward in one forward of one sequence."""
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as out:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_saved_bytes, args=(cp, seq_len, port, out), nprocs=cp)
        return max(int(Path(out, str(r)).read_text()) for r in range(cp))


def bench_long_context(quick: bool = False) -> dict[str, Any]:
    # blocks of 64 tokens at 1,024 (the window: a sliding layer fetches whole blocks)
    seq, steps = (512, 3) if quick else (1024, 5)
    cfg = PRESETS["small"]
    out: dict[str, Any] = {"preset": "small", "seq_len": seq, "steps": steps,
                           "window": cfg.sliding_window, "runs": {}, "exchange": {}}
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
            out["runs"][f"cp{cp}"] = {
                "step_s": statistics.median(r["time_compute"] for r in recs),
                "peak_rss_mib": max(r["peak_rss"] for r in recs) / 2**20,
                "saved_mib": activation_bytes(seq, cp) / 2**20}
    one = out["runs"]["cp1"]["saved_mib"]
    for cp in DEGREES[1:]:  # the issue's target: <= 1.2 x cp 1's / cp
        out["runs"][f"cp{cp}"]["saved_over_share"] = out["runs"][f"cp{cp}"]["saved_mib"] / (
            one / cp)
    kv_width = cfg.n_kv_heads * cfg.head_dim
    for cp in DEGREES[1:]:
        sliding, full, gather = (exchange_bytes(t, kv_width, exact=False) for t in (
            fetched_tokens(seq, cp, cfg.sliding_window), fetched_tokens(seq, cp, None),
            seq - seq // cp))
        out["exchange"][f"cp{cp}"] = {
            "sliding_bytes": sliding, "full_bytes": full, "all_gather_bytes": gather,
            "sliding_over_gather": sliding / gather, "target": cfg.sliding_window / (seq / cp)}
    out["sliding_layers"] = sum(t == SLIDING for t in cfg.layer_types)
    # Olmo 3's stage 3 (65,536 tokens, cp 8, a 4,096 window), counted the same way
    stage3 = (fetched_tokens(STAGE3_SEQ, 8, STAGE3_WINDOW), STAGE3_SEQ - STAGE3_SEQ // 8)
    out["stage3_fetched_tokens"] = {"sliding": stage3[0], "all_gather": stage3[1],
                                    "ratio": stage3[0] / stage3[1],
                                    "target": STAGE3_WINDOW / (STAGE3_SEQ / 8)}
    return out


def format_report(r: dict[str, Any]) -> str:
    lines = [f"long context, small preset, {r['seq_len']} tokens, {r['steps']} steps "
             "(per worker: median step seconds, peak resident MiB, MiB saved for backward and "
             "its ratio to cp 1's / cp, target <= 1.2):"]
    lines += [f"  {k:<5} {v['step_s']:8.3f} s {v['peak_rss_mib']:7.0f} MiB "
              f"{v['saved_mib']:8.1f} MiB saved" + (f" ({v['saved_over_share']:.2f})"
                                                   if "saved_over_share" in v else "")
              for k, v in r["runs"].items()]
    lines.append(f"bytes one rank receives per layer and sequence (fast mode; window "
                 f"{r['window']}):")
    for k, v in r["exchange"].items():
        lines.append(f"  {k:<5} sliding {v['sliding_bytes']:>12,}  full {v['full_bytes']:>12,}"
                     f"  all-gather {v['all_gather_bytes']:>12,}  sliding/gather "
                     f"{v['sliding_over_gather']:.3f} (target <= {v['target']:.3f})")
    s = r["stage3_fetched_tokens"]
    lines.append(f"  65,536 tokens at cp 8, window 4,096: a rank fetches {s['sliding']:,} keys "
                 f"for a sliding layer where gathering fetches {s['all_gather']:,} "
                 f"({s['ratio']:.3f}; target <= {s['target']:.3f})")
    return "\n".join(lines) + "\n" + json.dumps(r)
