"""`relaytrain bench gpu`: every GPU figure of issue 9 from one command, into one JSON file.

GPU time is scarce, so one process measures everything, writing `gpu.json` (in `--out`, default
`runs/bench-gpu`) after each section; a section that fails records its error and the next runs.

In order (the 7B first, in the cleanest allocator state):

- `olmo3_7b`: the 7B preset at seq 8192, fp32 master weights and AdamW state, bf16 autocast,
  fused AdamW, full activation checkpointing, compiled blocks: a few steps' tokens/s, MFU and
  peak memory next to `memory_plan` (target >= 40% MFU). Weights are drawn on the GPU
  (N(0, init_std)): the CPU-seeded init would spend minutes drawing 7B numbers.
- `throughput`: `bench train-throughput` on the 1.48B config (`olmo3-1b`: d_model 2048, 16
  layers, SwiGLU 8192, vocab 100352; seq 4096 x micro-batch 4): our step against HF's, eager
  and `torch.compile`d, tokens/s, MFU, peak memory, ratios (targets: >= 1.2x the compiled HF
  step, >= 50% MFU).
- `checkpointing`: the same config, our step (eager: compiling does not change what is saved)
  under each activation-checkpointing policy, peak memory and tokens/s; and the step with
  `torch.use_deterministic_algorithms(True)`: what the deterministic kernels cost.
- `portability`: a tiny run checkpointed on the CPU resumes on CUDA, and the reverse; the
  resumed losses against an uninterrupted run on the resuming device.
- `determinism`: `determinism: exact` on CUDA, the `small` preset with sliding layers on
  FlexAttention: a re-run and a resumed run against the first, losses and final weights
  bitwise, and its step time against `fast`.

`--device cpu --quick` runs the same code at tiny sizes on the CPU (the CPU suite does), where
the CUDA-only parts (HF compiled, peak memory) are left out; `--device cuda` without CUDA fails
at once.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relaytrain.bench import progress
from relaytrain.bench.dp_scaling import reduction_cost
from relaytrain.config import load_config
from relaytrain.config.sections import ModelSection, OptimSection, TrainSection
from relaytrain.errors import UserError
from relaytrain.model.accounting import flops_per_token, layer_params, param_count
from relaytrain.model.config import PRESETS, Olmo3Config
from relaytrain.model.loss import GPU_CHUNK_ELEMENTS
from relaytrain.model.olmo3 import Olmo3
from relaytrain.parallel.fsdp import SLICE_VALUES
from relaytrain.parallel.precision import gather_dtype
from relaytrain.parallel.reduce import GradReducer
from relaytrain.train.execution import CUBLAS_WORKSPACE, prepare_model
from relaytrain.train.metrics import peak_flops, run_peak_flops
from relaytrain.train.optim import build_optimizer
from relaytrain.train.step import train_step

if TYPE_CHECKING:
    from relaytrain.runtime.summary import RunSummary

# The 7B first: it needs the most memory, so it runs in the cleanest allocator state.
SECTIONS = ("olmo3_7b", "throughput", "checkpointing", "portability", "determinism")
TARGETS = {"vs_hf_compiled": 1.2, "mfu_1b": 0.5, "mfu_7b": 0.4}
GIB = 2**30


# Bytes a value while torch's ops fold a gradient into packed sums (parallel.reduce.fold_packed:
# the bool mask, the masked fp32 copy, its float64 scaled copy and floor, both int64 limbs).
FOLD_BYTES = 37


def memory_plan(cfg: Olmo3Config, seq_len: int, micro_batch: int, fsdp: int = 1,
                exact: bool = False, gather: str = "auto", cp: int = 1,
                checkpointing: str = "full") -> dict[str, Any]:
    """Bytes a training step of `cfg` needs on one CUDA device with fp32 master weights, as
    arithmetic (activation checkpointing as `model.checkpointing`: full or none, bf16
    autocast, fused AdamW, chunked loss, compiled blocks), unsharded or sharded over `fsdp`
    devices (parallel/fsdp.py), in fast or `exact` mode, gathering parameters as
    `parallel.fsdp_param_dtype=gather` resolves on CUDA (`auto`: bf16 in fast mode, fp32 in
    exact mode, which refuses bf16).

    n parameters cost 4n (fp32 weights) + 4n (fp32 gradients) + 8n (AdamW's two fp32
    moments) = 16n for the whole step; autocast's bf16 weight copies (2n) live only through
    the forward, before any gradient exists (`zero_grad(set_to_none=True)`), so the peak is
    the backward's: 16n, plus the blocks' activations (`activation_plan`), plus the fused
    loss's logit chunk.

    Sharded, the 16n bytes of state are split over the devices; FSDP2 gathers a unit's
    parameters whole while it runs: the root (embedding and head) for the whole step and a
    block with the next one prefetched. A unit's whole gradient and its reduce-scatter input
    exist until the reduce-scatter: the gradient in the gathered dtype (autograd's, of the
    gathered parameter), the input fp32 (FSDP2's `foreach_reduce` allocates it in the reduce
    dtype and casts the gradient into it as it copies it in, then frees the gradient).
    Gathered in fp32, the residual stream is fp32 and autocast copies the running blocks'
    weights to bf16 (compiled blocks cast inside their graphs; eager ones, `model.compile=
    none`, would keep every block's copy in autocast's cache through the forward: 2n);
    gathered in bf16, the weights are bf16 already (no copies) and so is the residual stream,
    checkpoints included. Exact mode adds the packed int64 sums (parallel/reduce.py): an
    accumulator of 8 bytes per (sharded) parameter, and while a gradient is folded by torch's
    ops (CUDA) its temporaries, `FOLD_BYTES` a value: unsharded, of the largest tensor (the
    head's weight); sharded, of one slice (`parallel.fsdp.SLICE_VALUES`) and its int64 send
    buffer, 8 more. A parameter with values above the packing bound (rare) adds two limbs'
    sums, 16 bytes a value of it, which the plan leaves out. Unsharded, exact mode drops each
    gradient once it is folded (`GradReducer.overlapping`) and writes them all back after the
    backward, when the activations are gone: the plan's 4n of gradients bounds both.

    With context parallelism (`cp` devices per sequence, parallel/context.py) a device holds
    1/cp of the tokens: its checkpoints and recomputed activations shrink cp-fold, and the
    attention of one layer at a time adds (`context_plan`): the keys and values its queries
    see (a full layer's: up to the whole sequence), the scores of one query block against them
    (probabilities, scores and their gradients, fp32), and the sums of dK/dV over the blocks it
    fetched (float, or two int64 limbs a value in exact mode).
    """
    dtype = gather_dtype(gather, "cuda", exact) if fsdp > 1 else "fp32"
    if exact and dtype == "bf16":
        raise ValueError("memory_plan: exact mode gathers fp32 (config/checks.py refuses bf16)")
    width = 2 if dtype == "bf16" else 4  # bytes of a gathered value and of the residual stream
    n = param_count(cfg)
    tokens = seq_len * micro_batch // cp
    context = context_plan(cfg, seq_len, micro_batch, cp, exact)
    root = 2 * cfg.vocab_size * cfg.d_model + cfg.d_model  # embedding, head, final norm
    unit = max(root, layer_params(cfg)) if fsdp > 1 else cfg.vocab_size * cfg.d_model
    gathered = (root + 2 * layer_params(cfg)) if fsdp > 1 else 0
    states = 16 * n // fsdp
    accumulator = 8 * n // fsdp if exact else 0
    exact_transient = ((FOLD_BYTES + 8) * min(unit, SLICE_VALUES) if fsdp > 1
                       else FOLD_BYTES * unit) if exact else 0
    in_flight = (width + 4) * unit if fsdp > 1 else 0  # the unit's gradient + fp32 RS input
    checkpoints, block = activation_plan(cfg, tokens, width, checkpointing)
    kept = checkpointing == "none"  # every block's activations kept, nothing recomputed
    loss_chunk = 2 * GPU_CHUNK_ELEMENTS * 4  # its fp32 logits and a bf16/fp32 neighbour
    bf16_copies = 2 * (gathered if fsdp > 1 else n) if width == 4 else 0  # of what is whole
    forward_peak = (12 * n // fsdp + (accumulator if fsdp == 1 else 0) + width * gathered
                    + bf16_copies + checkpoints + (0 if kept else block) + context["forward"])
    backward_peak = (states + accumulator + width * gathered + in_flight + exact_transient
                     + checkpoints + (1 if kept else 2) * block + loss_chunk
                     + context["backward"])
    return {"params": n, "tokens": tokens, "fsdp": fsdp, "exact": exact,
            "gather_dtype": dtype if fsdp > 1 else None,
            "weights_fp32": 4 * n // fsdp, "grads_fp32": 4 * n // fsdp,
            "adamw_fp32": 8 * n // fsdp, "exact_accumulator": accumulator,
            "gathered": width * gathered, "reduce_in_flight": in_flight,
            "exact_transient": exact_transient, "autocast_bf16_copies": bf16_copies,
            "checkpointing": checkpointing, "checkpoints": checkpoints,
            "recompute_estimate": (1 if kept else 2) * block,
            "loss_chunk": loss_chunk, "cp": cp, "context_attention": context["backward"],
            "forward_peak": forward_peak,
            "backward_peak": backward_peak, "peak": max(forward_peak, backward_peak)}


def activation_plan(cfg: Olmo3Config, tokens: int, width: int, checkpointing: str
                    ) -> tuple[int, int]:
    """Bytes the blocks' activations hold through the forward, and one block's activations
    (estimated at tokens x (16 d_model + 6 mlp_hidden) bytes: bf16 projections, fp32 norm
    statistics, the SwiGLU's hidden-width tensors). Full checkpointing keeps every block's
    input (layers x tokens x d_model in the residual stream's `width` bytes) and the backward
    recomputes about two blocks' worth with their gradients; without (`none`) every block keeps
    its activations and the backward adds one block's gradients: at 7B and 8,192 tokens on one
    device, 34.5 GB (it does not fit one H200 beside the state); over cp 8 at 65,536 tokens the
    same per device (Olmo 3's 7B stage 3: OLMo-core's script sets `ac_config=None`)."""
    if checkpointing not in ("full", "none"):
        raise ValueError(f"memory_plan: checkpointing {checkpointing!r}; planned: full, none")
    block = tokens * (16 * cfg.d_model + 6 * cfg.mlp_hidden)
    if checkpointing == "none":
        return cfg.n_layers * block, block
    return cfg.n_layers * tokens * cfg.d_model * width, block


def context_plan(cfg: Olmo3Config, seq_len: int, micro_batch: int, cp: int, exact: bool
                 ) -> dict[str, int]:
    """Bytes a device's context-parallel attention adds while one layer runs (`memory_plan`):
    a full layer's keys and values (the busiest rank's late chunk sees the whole sequence), one
    query block's fp32 scores over them (two at once in the forward and in the backward: the
    softmax's gradient is formed in place, parallel/context.py) and, in fast mode, the fp32
    copy of its keys and values (held in bf16), and in the backward the dK/dV sums of every
    block it holds or fetched. None at cp 1."""
    if cp == 1:
        return {"forward": 0, "backward": 0}
    from relaytrain.parallel.context import attention_block

    keys = seq_len * micro_batch
    kv_width = cfg.n_kv_heads * cfg.head_dim
    kv = 2 * keys * kv_width * (4 if exact else 2)  # bf16 under autocast in fast mode
    scores = cfg.n_heads * attention_block(seq_len) * keys * 4
    sums = 2 * keys * kv_width * (16 if exact else 4)
    fp32_copy = 0 if exact else 2 * keys * kv_width * 4
    return {"forward": kv + fp32_copy + 2 * scores, "backward": kv + fp32_copy + 2 * scores + sums}


GPU_80GB = 80e9  # an H100's or A100's memory, the bar of the memory tables
_TABLE_ROWS = (  # a row of `memory_table`: its label and the plan's keys it adds up
    ("fp32 weights + gradients + AdamW moments (1/fsdp each)",
     ("weights_fp32", "grads_fp32", "adamw_fp32")),
    ("gathered whole (bf16 fast, fp32 exact): the root (embedding, head) all step, a block "
     "and the next", ("gathered",)),
    ("a unit's whole gradient (bf16 fast, fp32 exact) + its fp32 reduce-scatter input",
     ("reduce_in_flight",)),
    ("packed int64 gradient accumulator, 8 B a value (1/fsdp)", ("exact_accumulator",)),
    ("a gradient (slice) while it is folded into packed limbs (37-45 B a value)",
     ("exact_transient",)),
    ("activations: block checkpoints (bf16 fast, fp32 exact) + a recomputed block, or without "
     "checkpointing every block's + one's gradients; + loss chunk",
     ("checkpoints", "recompute_estimate", "loss_chunk")),
    ("**planned peak** (backward)", ("peak",)),  # the last two rows stay last
    ("planned peak gathering fp32 (`parallel.fsdp_param_dtype=fp32`)", ("peak_fp32_gathers",)),
)


_CONTEXT_ROW = ("context-parallel attention of a layer: its keys and values, a query block's "
                "scores, the dK/dV sums (limbs in exact)", ("context_attention",))


def memory_table(cfg: Olmo3Config, seq_len: int, micro_batch: int,
                 fsdps: tuple[int, ...], cp: int = 1, checkpointing: str = "full") -> str:
    """`memory_plan` of each sharding in `fsdps`, fast and exact, as the Markdown table
    docs/MEASURED.md shows (GB = 1e9 bytes; a test holds the docs to it): at the default
    gathers (`auto`), and the peak gathering fp32; whether the default fits 80 GB. With
    `cp` > 1, per device of a sequence split over cp, with the context's attention's row."""
    plans = [memory_plan(cfg, seq_len, micro_batch, fsdp=f, exact=e, cp=cp,
                         checkpointing=checkpointing) for f in fsdps for e in (False, True)]
    for p in plans:
        p["peak_fp32_gathers"] = memory_plan(cfg, seq_len, micro_batch, fsdp=p["fsdp"],
                                             exact=p["exact"], gather="fp32", cp=cp,
                                             checkpointing=checkpointing)["peak"]
    rows = _TABLE_ROWS if cp == 1 else (*_TABLE_ROWS[:-2], _CONTEXT_ROW, *_TABLE_ROWS[-2:])
    head = "".join(f" fsdp {p['fsdp']} {'exact' if p['exact'] else 'fast'} |" for p in plans)
    lines = [f"| GB per GPU |{head}", "| --- |" + " ---: |" * len(plans)]
    for label, keys in rows:
        cells = [sum(p[k] for k in keys) for p in plans]
        text = [f"{c / 1e9:.1f}" if c else "—" for c in cells]
        if label.startswith("**"):
            text = [f"**{t}**" for t in text]
        lines.append(f"| {label} | " + " | ".join(text) + " |")
    fits = ["yes" if p["peak"] < GPU_80GB else "no" for p in plans]
    lines.append(f"| fits an 80 GB GPU | {' | '.join(fits)} |")
    return "\n".join(lines)


def bench_gpu(device: str = "cuda", quick: bool = False, out: str | None = None,
              only: list[str] | None = None) -> dict[str, Any]:
    """Run the sections (all, or `only`), writing `<out>/gpu.json` after each."""
    dev = torch.device(device) if device in ("cpu", "cuda") else None
    if dev is None:
        raise UserError(f"bench gpu: --device {device!r}; expected cuda (or cpu for a dry run)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("bench gpu: --device cuda, but this torch sees no CUDA device (torch "
                        f"{torch.__version__}); run it on a GPU machine, or --device cpu "
                        "--quick for a dry run of the plumbing")
    unknown = sorted(set(only or ()) - set(SECTIONS))
    if unknown:
        raise UserError(f"bench gpu: unknown section {unknown[0]!r}; expected any of {SECTIONS}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # before cuBLAS starts
    out_dir = Path(out or "runs/bench-gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"bench": "gpu", "device": str(dev), "quick": quick,
                              "environment": _environment(dev), "targets": TARGETS}
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "throughput": lambda: _throughput(dev, quick),
        "checkpointing": lambda: _checkpointing(dev),
        "olmo3_7b": lambda: _olmo3_7b(dev, quick),
        "portability": lambda: _portability(dev, out_dir),
        "determinism": lambda: _determinism(dev, out_dir),
    }
    sections = only or SECTIONS
    progress.start("gpu", f"{len(sections)} sections ({', '.join(sections)}), once each")
    for i, name in enumerate(sections, 1):
        progress.report(f"section {name}", i, len(sections))
        t0 = time.perf_counter()
        try:
            section = runners[name]()
        except Exception as e:  # recorded; the remaining sections still run
            section = {"error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=6)}
        section["wall_s"] = round(time.perf_counter() - t0, 1)
        result[name] = section
        _release(dev)
        (out_dir / "gpu.json").write_text(json.dumps(result, indent=1, default=str))
    result["json"] = str(out_dir / "gpu.json")
    return result


def _environment(dev: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu=props.name, memory_bytes=props.total_memory,
                   peak_flops=peak_flops(dev, 1)[0])
    return env


def _release(dev: torch.device) -> None:
    """Drop what a section left behind: compiled graphs (and what they reference), cached
    blocks of the allocator, its peak statistic."""
    gc.collect()
    if dev.type == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


# ---- sections ---------------------------------------------------------------------------------


def _throughput(dev: torch.device, quick: bool) -> dict[str, Any]:
    from relaytrain.bench.train_throughput import bench_train_throughput

    if dev.type == "cpu":
        # the plumbing only, at its smallest (micro-batch 2, one round): the quick bench itself
        # is `bench train-throughput --quick` (its own test)
        r = bench_train_throughput("cpu", quick=True, preset="tiny", micro_batch=2, rounds=1)
    else:
        r = bench_train_throughput("cuda", preset="olmo3-1b", seq_len=4096, micro_batch=4,
                                   rounds=2 if quick else 3, steps=2 if quick else 3)
    summary = {k: r[k]["tokens_per_s"] for k in ("ours", "hf", "hf_compiled") if k in r}
    met = {"mfu": r["ours"]["mfu"] is not None and r["ours"]["mfu"] >= TARGETS["mfu_1b"]}
    if "ratio_vs_compiled" in r:
        met["vs_hf_compiled"] = r["ratio_vs_compiled"] >= TARGETS["vs_hf_compiled"]
    return {"tokens_per_s": summary, "mfu_ours": r["ours"]["mfu"], "ratio_vs_hf": r["ratio"],
            "ratio_vs_hf_compiled": r.get("ratio_vs_compiled"), "targets_met": met,
            "report": r}


def _device_model(cfg: Olmo3Config, dev: torch.device, seed: int = 0) -> Olmo3:
    """`cfg` built and initialised on `dev`: N(0, init_std) matrices, unit norms."""
    with torch.device(dev):
        model = Olmo3(cfg)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.ndim == 1 else p.normal_(0.0, cfg.init_std, generator=gen)
    return model


def _time_steps(model: Olmo3, cfg: Olmo3Config, dev: torch.device, seq_len: int,
                micro_batch: int, warmup: int, steps: int) -> dict[str, Any]:
    """Our full training step (as the worker runs it) on random tokens: tokens/s, MFU, peak."""
    opt = build_optimizer(model, OptimSection())
    params = list(model.parameters())
    reducer = GradReducer(params, None, exact=False, total_micro_batches=1)
    gen = torch.Generator().manual_seed(0)
    vocab = cfg.tokenizer_vocab or cfg.vocab_size
    batch = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen)
    z_loss, clip = TrainSection().z_loss, TrainSection().clip
    losses, times = [], []

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for i in range(warmup + steps):
        if i == warmup and dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sync()
        t0 = time.perf_counter()
        outcome = train_step(model, opt, reducer, [(0, batch)], 1, z_loss, clip, dev)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(outcome.losses[0][0])
    step_s = statistics.median(times[warmup:])
    tokens = seq_len * micro_batch
    peak_rate = run_peak_flops(dev, torch.get_num_threads())[0]
    del opt
    return {"tokens_per_s": tokens / step_s, "step_s": step_s,
            "mfu": flops_per_token(cfg, seq_len) * tokens / step_s / peak_rate,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
            else None, "losses": losses, "steps_timed": steps}


def _checkpointing(dev: torch.device) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    preset, seq_len, mb = ("olmo3-1b", 4096, 4) if cuda else ("tiny", 64, 2)
    cfg = PRESETS[preset] if cuda else PRESETS[preset].with_vocab(512)
    out: dict[str, Any] = {"preset": preset, "seq_len": seq_len, "micro_batch": mb}
    for policy in ("none", "selective", "full"):
        model = prepare_model(_device_model(cfg, dev), ModelSection(checkpointing=policy,
                                                                    compile="none"), dev)
        out[policy] = _time_steps(model, cfg, dev, seq_len, mb, warmup=1, steps=2)
        del model
        _release(dev)
    base = out["none"]
    for policy in ("selective", "full"):
        out[policy]["slowdown"] = base["tokens_per_s"] / out[policy]["tokens_per_s"]
        out[policy]["same_losses"] = out[policy]["losses"] == base["losses"]
        if cuda:
            out[policy]["memory_saved_bytes"] = (base["peak_memory_bytes"]
                                                 - out[policy]["peak_memory_bytes"])
    if cuda:
        model = prepare_model(_device_model(cfg, dev), ModelSection(compile="none"), dev)
        torch.use_deterministic_algorithms(True)
        try:
            det = _time_steps(model, cfg, dev, seq_len, mb, warmup=1, steps=2)
        finally:
            torch.use_deterministic_algorithms(False)
        det["slowdown"] = base["tokens_per_s"] / det["tokens_per_s"]
        out["deterministic_algorithms"] = det
    return out


def _olmo3_7b(dev: torch.device, quick: bool) -> dict[str, Any]:
    cuda = dev.type == "cuda"
    preset, seq_len = ("olmo3-7b", 8192) if cuda else ("tiny", 64)
    cfg = PRESETS[preset] if cuda else PRESETS[preset].with_vocab(512)
    plan = memory_plan(cfg, seq_len, 1)
    section = ModelSection(checkpointing="full")  # attention, compile: auto
    model = prepare_model(_device_model(cfg, dev), section, dev)
    r = _time_steps(model, cfg, dev, seq_len, 1, warmup=1, steps=2 if quick else 3)
    del model
    r.update(preset=preset, seq_len=seq_len, micro_batch=1,
             execution={"checkpointing": section.checkpointing, "attention": section.attention,
                        "compile": section.compile, "master_weights": "fp32",
                        "autocast": "bf16" if cuda else None,
                        "optimizer": "AdamW fused" if cuda else "AdamW foreach"},
             memory_plan_gib={k: round(v / GIB, 2) for k, v in plan.items()
                              if k not in ("params", "tokens", "gather_dtype", "checkpointing")},
             params=plan["params"])
    if cuda:
        r["peak_memory_gib"] = round(r["peak_memory_bytes"] / GIB, 2)
        r["mfu_target_met"] = r["mfu"] >= TARGETS["mfu_7b"]
    return r


def _train(data: str, run_dir: Path, *overrides: str) -> tuple[RunSummary, dict[int, dict]]:
    """A real `relaytrain train` run (inline engine, this process); its summary and steps."""
    from relaytrain.runtime.controller import Controller

    cfg = load_config(None, [f"run_dir={run_dir}", f"data.path={data}", "log.progress=false",
                             "eval.every=0", *overrides])
    summary = Controller(cfg, quiet=True).run()
    steps: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step":
            steps[rec["step"]] = rec
    return summary, steps


def _data(out_dir: Path) -> str:
    from relaytrain.bench.common import demo_data

    path = out_dir / "data" / "data"
    return str(path) if (path / "index.json").exists() else demo_data(out_dir / "data", 40, 512)


PORTABLE_RUN = ("model.preset=tiny", "data.seq_len=32", "train.global_batch=8",
                "train.micro_batch=2", "optim.lr=3e-3", "optim.warmup=2",
                "checkpoint.async_write=false")


def _fork(run_dir: Path, step: int, new_dir: Path) -> Path:
    """A new run directory holding only `run_dir`'s checkpoint of `step`: training it with
    the same config is a restart from that checkpoint (the learning-rate schedule, which
    depends on train.max_steps, stays the uninterrupted run's)."""
    src = run_dir / "checkpoints" / f"step_{step:08d}"
    shutil.copytree(src, new_dir / "checkpoints" / src.name)
    return new_dir


def _portability(dev: torch.device, out_dir: Path) -> dict[str, Any]:
    data = _data(out_dir)
    devices = ("cpu", dev.type)
    work = Path(tempfile.mkdtemp(prefix="portability-", dir=out_dir))
    common = (*PORTABLE_RUN, "train.max_steps=6", "checkpoint.every=3")
    ref = {d: _train(data, work / f"ref-{d}", *common, f"train.device={d}")[1]
           for d in set(devices)}
    gap = max(abs(ref["cpu"][s]["loss"] - ref[dev.type][s]["loss"]) for s in range(1, 7))
    out: dict[str, Any] = {"reference_losses": {d: [ref[d][s]["loss"] for s in range(1, 7)]
                                                for d in ref}, "cpu_vs_device_gap": gap}
    for src, dst in dict.fromkeys((devices, devices[::-1])):  # one pair on the CPU
        run = _fork(work / f"ref-{src}", 3, work / f"{src}-to-{dst}")
        summary, steps = _train(data, run, *common, f"train.device={dst}")
        diff = max(abs(steps[s]["loss"] - ref[dst][s]["loss"]) for s in range(4, 7))
        out[f"{src}_to_{dst}"] = {
            "resumed_from": summary.resumed_from,
            "losses_after_resume": [steps[s]["loss"] for s in range(4, 7)],
            "max_abs_diff_vs_uninterrupted_on_target": diff,
            # Across devices the state resumed from differs by bf16 rounding, so the curve
            # must stay within the devices' own gap (on one device: bit-identical).
            "continuous": summary.resumed_from == 3 and diff <= 2 * gap}
    return out


def _determinism(dev: torch.device, out_dir: Path) -> dict[str, Any]:
    data = _data(out_dir)
    cuda = dev.type == "cuda"
    steps = 8 if cuda else 4
    run = ("model.preset=small", "data.seq_len=256", "train.global_batch=8",
           "train.micro_batch=2") if cuda else PORTABLE_RUN[:4]
    common = (*run, f"train.device={dev.type}", "optim.warmup=2", f"train.max_steps={steps}",
              f"checkpoint.every={steps // 2}", "checkpoint.async_write=false")
    work = Path(tempfile.mkdtemp(prefix="determinism-", dir=out_dir))
    _, first = _train(data, work / "first", *common, "determinism=exact")
    _, again = _train(data, work / "again", *common, "determinism=exact")
    resumed_dir = _fork(work / "first", steps // 2, work / "resumed")
    _, resumed = _train(data, resumed_dir, *common, "determinism=exact")
    _, fast = _train(data, work / "fast", *common, "determinism=fast")
    weights = {name: _final_weights(work / name, steps) for name in ("first", "again", "resumed")}
    late = range(steps // 2 + 1, steps + 1)  # the steps the resumed run trained

    def step_time(recs: dict[int, dict]) -> float:  # after compilation's first steps
        return statistics.median(recs[s]["time_compute"] for s in range(3, steps + 1))

    return {
        "preset": run[0].split("=")[1], "steps": steps,
        "losses": [first[s]["loss"] for s in range(1, steps + 1)],
        "rerun_bitwise": all(first[s]["loss"] == again[s]["loss"] for s in first)
        and _equal(weights["first"], weights["again"]),
        "resume_bitwise": all(first[s]["loss"] == resumed[s]["loss"] for s in late)
        and _equal(weights["first"], weights["resumed"]),
        "exact_step_s": step_time(first), "fast_step_s": step_time(fast),
        "exact_cost": step_time(first) / step_time(fast),
        # issue 44's two figures, each mode's: the gradient reduction's share of the step and
        # the bytes it put on the wire per parameter (one device: no collectives, so 0 bytes
        # and the fold alone; `bench dp-scaling` measures the wire at dp 2)
        **{f"{mode}_{k}": v for mode, name in (("exact", "first"), ("fast", "fast"))
           for k, v in reduction_cost(str(work / name), 2).items()},
        "fast_vs_exact_max_abs_loss_diff": max(abs(first[s]["loss"] - fast[s]["loss"])
                                               for s in first),
    }


def _final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from relaytrain.checkpoint.store import CheckpointStore

    return CheckpointStore(str(run_dir / "checkpoints")).read(step)[1]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def format_report(r: dict[str, Any]) -> str:
    """The headline numbers; the whole result is in the JSON file."""
    lines = [f"bench gpu on {r['device']} ({r['environment']}); full result: {r['json']}"]
    for name in SECTIONS:
        if name not in r:
            continue
        s = r[name]
        if "error" in s:
            lines.append(f"{name}: FAILED {s['error']}")
            continue
        brief = {k: v for k, v in s.items() if k not in ("report", "traceback")
                 and not isinstance(v, dict | list)}
        lines.append(f"{name}: {json.dumps(brief, default=str)}")
    return "\n".join(lines)
