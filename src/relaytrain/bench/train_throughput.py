"""`relaytrain bench train-throughput`: our training step against HF transformers' training
step of the same Olmo 3, side by side in one process.

Both models hold the same weights (`parity.hf.hf_twin`), see the same batches (random tokens
from a seeded generator, `micro_batch` sequences of `seq_len` + 1 tokens, the next-token labels
already shifted) and are trained by the same optimizer: torch's fused AdamW kernel, ours through
`train.optim.AdamW` as our worker builds it (Olmo parameter groups), HF's through
`torch.optim.AdamW(fused=True)` with the same groups mapped onto HF's parameter names. A step
is forward, loss, backward, global-norm clip (1.0), AdamW update, gradients cleared, and the
loss read back as a float.

- Ours: `train.step.train_step` exactly as the worker calls it (a no-op gradient reduction,
  the fused chunked LM head + loss), with the z-loss on (1e-5, the default) that HF does not
  have: ours does a little more work. Executed as a run is by default
  (`train.execution.prepare_model`): on the CPU its linear layers and LM head run their GEMMs
  through the backend `model.matmul: auto` picks on this host (`model.backend_choice`: torch's
  own or oneDNN, whichever measured faster on the model's products; reported with both
  timings), and its RMSNorm, SwiGLU, RoPE and softmax through the fused CPU kernels and its
  sliding layers in chunks where `model.kernels: auto` and `model.attention: auto` measure
  them faster (`train.auto_backends`). So that what each lever contributes is not
  mistaken for the rest, the same step with the other GEMM backend is measured beside it
  wherever oneDNN is available (`ours_aten` and `ratio_aten`, or `ours_onednn` and
  `ratio_onednn`), and with torch's elementwise ops (`ours_torch_kernels`,
  `ratio_torch_kernels`).
- HF: `Olmo3ForCausalLM(input_ids, labels=..., shift_labels=...)` with SDPA attention and its
  own `ForCausalLMLoss`, `use_cache=False`, `clip_grad_norm_`, `optimizer.step()`,
  `zero_grad(set_to_none=True)`: the loop a user writes around a HF model.
- On CUDA (issue 9): bf16 autocast with fp32 master weights for both, and a third
  variant, HF's model under `torch.compile` (sharing the HF model's weights and optimizer).
  Ours runs as a training run does by default (`train.execution.prepare_model`): compiled
  blocks and FlexAttention for sliding layers on CUDA (cuBLAS GEMMs: `matmul: auto` is aten
  there).

The process keeps freed memory as a worker process does (`train.execution.retain_freed_memory`:
without it our step page-faulted its buffers back in every step); the setting is process-wide,
so HF's step gets it too (its [2048, 8192] logits exceed glibc's 32 MiB limit and are still
mapped afresh every step).

The machine may be shared, so the variants are interleaved: every round runs `steps` steps of
each, in an order that alternates between rounds, and the ratio is the median of the per-round
ratios (a load change hits both sides of a round alike); tokens/s are medians over rounds. Each
variant's turn starts with one untimed step: the first step after the other model ran pays for
the memory and cache state that model left behind, a cost neither has when it trains alone
(docs/MEASURED.md). Also reported: the best round of each (interference only
ever slows a step down, so the best is the least disturbed) and their ratio, the CPU seconds
each step burned (all threads), the memory each step page-faulted in (minor faults x page
size), and the load average before and after. HF's step faults in memory every step, ours
none, so the ratio moves with the host's cost of a page fault; quote the figure with its
rounds.
MFU uses `model.accounting.flops_per_token` (the same for both models) against
`train.metrics.peak_flops` (on the CPU: a measured fp32 matmul at the same thread count, the
better of torch's GEMM and oneDNN's, the best of one measurement per round).
Memory: on CUDA the allocator's peak during each variant's steps (and above what was resident
when its step began); on the CPU, which keeps no allocator statistics, the bytes each model
saves for its backward in one forward (activations, parameters excluded).

One file past ~550 lines on purpose: it is one scripted measurement (the plan, the variants,
their interleaved rounds, the report of what was measured), each step a function of its own,
and a third of the file is this account of what is measured and why.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from relaytrain.bench import progress
from relaytrain.config.sections import ModelSection, OptimSection, TrainSection
from relaytrain.errors import UserError
from relaytrain.model.accounting import flops_per_token, param_count
from relaytrain.model.backend_choice import Choice
from relaytrain.model.config import PRESETS, Olmo3Config
from relaytrain.model.hf import ours_to_hf_name
from relaytrain.model.init import init_weights
from relaytrain.model.matmul import onednn_available
from relaytrain.model.memory import SavedBytes
from relaytrain.model.olmo3 import Attention, Olmo3
from relaytrain.model.sliding_chunks import Window
from relaytrain.parallel.reduce import GradReducer
from relaytrain.train.auto_backends import choose_backends, settled
from relaytrain.train.execution import compiles, prepare_model, retain_freed_memory
from relaytrain.train.metrics import peak_flops
from relaytrain.train.optim import AdamW, build_optimizer
from relaytrain.train.step import autocast_for, train_step

DEFAULT_TOKENIZER_VOCAB = 8192  # the demo's BPE vocabulary, for presets sized by the data
TARGET_RATIO = 1.25  # issue 4: ours at least this much faster on the CPU, `small` preset
POOL = 4  # distinct batches, cycled
PAGE = resource.getpagesize()
OPTIM, TRAIN = OptimSection(), TrainSection()  # a run's defaults: AdamW, clip, z-loss


def _hf_optimizer(hf: nn.Module, ours: nn.Module, ours_opt: AdamW) -> torch.optim.Optimizer:
    """torch's fused AdamW (the kernel ours drives) over HF's parameters with our optimizer's
    groups and settings, name for name."""
    hf_params = dict(hf.named_parameters())
    group_of = {id(p): i for i, g in enumerate(ours_opt.param_groups) for p in g["params"]}
    groups: list[dict[str, Any]] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": []}
        for g in ours_opt.param_groups]
    for name, p in ours.named_parameters():
        groups[group_of[id(p)]]["params"].append(hf_params[ours_to_hf_name(name)])
    return torch.optim.AdamW(groups, fused=True)


def _saved_bytes(run: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> int:
    """Bytes of distinct storages saved for backward by `run()` (parameters excluded)."""
    meter = SavedBytes(params)
    with meter.counting():
        loss = run()
    del loss
    return meter.nbytes


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass(frozen=True)
class _Plan:
    """What one benchmark runs: the model, the device, each step's batch (`micro_batch`
    sequences of `seq_len` tokens) and the schedule (`warmup` untimed steps per variant, then
    `rounds` rounds of `steps` steps per variant)."""

    cfg: Olmo3Config
    preset: str
    dev: torch.device
    seq_len: int
    micro_batch: int
    warmup: int
    rounds: int
    steps: int
    threads: int
    seed: int
    quick: bool  # no compiled-blocks variant on the CPU

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


def bench_train_throughput(device: str = "cpu", quick: bool = False, preset: str = "small",
                           *, seq_len: int | None = None, micro_batch: int | None = None,
                           threads: int = 2, rounds: int | None = None,
                           steps: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Tokens/s, MFU and memory of our training step and HF's, and their ratio (see module doc).

    Defaults: CPU: sequences of min(256, max_seq_len) tokens, micro-batch 8, `threads` torch
    threads, 12 rounds of 1 step per variant after 2 warm-up steps (`quick`: 2 rounds after 1,
    and not the compiled-blocks variant).
    CUDA: min(4096, max_seq_len) tokens, micro-batch 4, 5 rounds of 5 steps after 3.
    """
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise UserError("bench train-throughput needs HF transformers (pip install "
                        "'relaytrain[parity]')") from e
    from relaytrain.parity.hf import hf_twin

    if preset not in PRESETS:
        raise UserError(f"bench train-throughput: unknown model preset {preset!r}; expected one "
                        f"of {sorted(PRESETS)}")
    dev = _device(device)
    cuda = dev.type == "cuda"
    cfg = PRESETS[preset]
    if cfg.vocab_size is None:
        cfg = cfg.with_vocab(DEFAULT_TOKENIZER_VOCAB)
    plan = _Plan(cfg, preset, dev, seq_len=seq_len or min(4096 if cuda else 256, cfg.max_seq_len),
                 micro_batch=micro_batch or (4 if cuda else 8),
                 warmup=1 if quick else (3 if cuda else 2),
                 rounds=rounds or (2 if quick else (5 if cuda else 12)),
                 steps=steps or (5 if cuda and not quick else 1), threads=threads, seed=seed,
                 quick=quick)
    progress.start("train-throughput", f"preset {preset}, {plan.rounds} rounds x {plan.steps} "
                   f"step(s) per variant after {plan.warmup} warm-up step(s)")
    prev_threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(threads)
    try:
        return _run(plan, hf_twin)
    finally:
        torch.set_num_threads(prev_threads)


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise UserError(f"bench train-throughput: --device {device!r}; expected cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("bench train-throughput: --device cuda, but CUDA is not available")
    return dev


def _run(plan: _Plan, hf_twin: Callable[[nn.Module], nn.Module]) -> dict[str, Any]:
    """Build the variants, warm them up, time them in interleaved rounds, report."""
    retain_freed_memory()  # as a worker process does (process-wide: HF's step gets it too)
    # What a run gets by default: auto compile, and the GEMMs, kernels and attention that
    # `auto` measures (or finds in the cache) for this host and shape, as a run's controller
    # chooses them (`train.auto_backends`).
    progress.report("model.matmul, kernels, attention auto: measuring (or reading the cache)")
    choices = choose_backends(ModelSection(), plan.cfg, plan.dev, plan.threads,
                              plan.micro_batch, plan.seq_len)
    for c in choices.values():
        progress.report(f"auto: {c.describe()}")
    execution = settled(ModelSection(), choices)
    batches = _Batches.draw(plan)
    ours, hf, variants = _variants(plan, execution, batches, hf_twin)
    measured = _Measured.of(variants)
    if not plan.cuda:  # memory: what each model saves for its backward, before any timing
        measured.saved = _saved_activations(ours, hf, batches, _other_gemms(execution))
    measured.warm_up(plan, variants)
    measured.time_rounds(plan, variants)
    return _report(plan, choices, execution, ours, measured)


@dataclass(frozen=True)
class _Batches:
    """`POOL` batches of random tokens from the seeded generator (`micro_batch` sequences of
    `seq_len` + 1 tokens) on the device, and their next-token labels, already shifted; step `i`
    takes batch `i % POOL`."""

    tokens: list[torch.Tensor]
    labels: list[torch.Tensor]

    @staticmethod
    def draw(plan: _Plan) -> _Batches:
        gen = torch.Generator().manual_seed(plan.seed)
        n_tokens = plan.cfg.tokenizer_vocab or plan.cfg.vocab_size
        tokens = [torch.randint(0, n_tokens, (plan.micro_batch, plan.seq_len + 1), generator=gen)
                  for _ in range(POOL)]
        tokens = [b.to(plan.dev) if plan.cuda else b for b in tokens]
        return _Batches(tokens, [b[:, 1:].contiguous() for b in tokens])


def _variants(plan: _Plan, execution: ModelSection, batches: _Batches,
              hf_twin: Callable[[nn.Module], nn.Module],
              ) -> tuple[Olmo3, nn.Module, dict[str, Callable[[int], float]]]:
    """Our model executed as a run's default and HF's twin of it (same weights), and every
    variant's step: ours, HF's, and beside them what isolates each lever (see the module
    docstring)."""
    ours, ours_opt, ours_step = _our_step(plan, execution, batches)
    hf = hf_twin(ours)
    hf.to(plan.dev).train()
    hf_opt = _hf_optimizer(hf, ours, ours_opt)
    hf_params = list(hf.parameters())
    variants = {"ours": ours_step, "hf": _hf_step(hf, hf_params, hf_opt, batches, plan.dev)}
    other = _other_gemms(execution)
    if not plan.cuda and onednn_available():  # what the choice of GEMMs gives, apart from the rest
        variants[f"ours_{other}"] = _our_step(plan, replace(execution, matmul=other), batches)[2]
    if ours.fused:  # what the fused elementwise kernels give, apart from the rest
        variants["ours_torch_kernels"] = _our_step(plan, replace(execution, kernels="torch"),
                                                   batches)[2]
    if plan.cuda:
        variants["hf_compiled"] = _hf_step(torch.compile(hf), hf_params, hf_opt, batches,
                                           plan.dev)
    elif not (plan.quick or compiles(execution.compile, plan.dev)) and _cpp_compiler():
        # The lever left on the CPU, measured beside the default (its compile takes ~30 s).
        variants["ours_compiled"] = _our_step(plan, replace(execution, compile="blocks"),
                                              batches)[2]
    return ours, hf, variants


def _other_gemms(execution: ModelSection) -> str:
    """The GEMM backend `execution` does not run, measured beside it."""
    return "aten" if execution.matmul == "onednn" else "onednn"


def _our_step(plan: _Plan, section: ModelSection, batches: _Batches,
              ) -> tuple[Olmo3, AdamW, Callable[[int], float]]:
    """Our model (seed weights) executed per `section`, its optimizer and its step."""
    dev = plan.dev
    model = Olmo3(plan.cfg)
    init_weights(model, plan.seed)
    model = prepare_model(model, section, dev)
    model.train()
    opt = build_optimizer(model, OPTIM)
    reducer = GradReducer(list(model.parameters()), None, exact=False, total_micro_batches=1)

    def step(i: int) -> float:
        out = train_step(model, opt, reducer, [(0, batches.tokens[i % POOL])], 1, TRAIN.z_loss,
                         TRAIN.clip, dev)
        return out.losses[0][1]  # the cross-entropy (HF's loss has no z-loss)
    return model, opt, step


def _hf_step(model: nn.Module, params: list[torch.Tensor], opt: torch.optim.Optimizer,
             batches: _Batches, dev: torch.device) -> Callable[[int], float]:
    """The loop a user writes around HF's `model` (`params` and `opt`: the uncompiled one's)."""
    def step(i: int) -> float:
        b, labels = batches.tokens[i % POOL], batches.labels[i % POOL]
        with autocast_for(dev):
            out = model(input_ids=b[:, :-1], labels=labels, shift_labels=labels, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, TRAIN.clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())
    return step


def _saved_activations(ours: Olmo3, hf: nn.Module, batches: _Batches, other: str,
                       ) -> dict[str, int | None]:
    """The bytes each model saves for its backward in one forward of the first batch (none
    for the variants that share a model's code)."""
    b0, labels = batches.tokens[0], batches.labels[0]
    saved: dict[str, int | None] = {
        "ours": _saved_bytes(lambda: ours(b0[:, :-1], labels=labels, z_loss=TRAIN.z_loss)[0],
                             list(ours.parameters())),
        "hf": _saved_bytes(lambda: hf(input_ids=b0[:, :-1], labels=labels, shift_labels=labels,
                                      use_cache=False).loss, list(hf.parameters()))}
    saved["hf_compiled"] = saved[f"ours_{other}"] = saved["ours_torch_kernels"] = None
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    return saved


@dataclass
class _Measured:
    """What the warm-up and the timed rounds measure per variant, the peak FLOP/s and the load
    average (`saved`: the CPU's saved activations, `_saved_activations`)."""

    step_s: dict[str, list[float]]  # each round's wall seconds per step
    cpu_s: dict[str, list[float]]  # each round's CPU seconds per step (all threads)
    faults: dict[str, list[int]]  # each round's minor page faults per step
    peak: dict[str, int]  # CUDA: the allocator's peak during the variant's steps
    over: dict[str, int]  # CUDA: that peak above what was resident when its step began
    first_loss: dict[str, float] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)
    saved: dict[str, int | None] = field(default_factory=dict)
    peak_rate: float = 0.0
    peak_source: str = ""
    load_before: list[float] | None = None
    load_after: list[float] | None = None

    @classmethod
    def of(cls, variants: dict[str, Callable[[int], float]]) -> _Measured:
        return cls({k: [] for k in variants}, {k: [] for k in variants},
                   {k: [] for k in variants}, dict.fromkeys(variants, 0),
                   dict.fromkeys(variants, 0))

    def warm_up(self, plan: _Plan, variants: dict[str, Callable[[int], float]]) -> None:
        """`plan.warmup` steps of each variant (and its compilation), all from the same first
        batch: their first losses and seconds."""
        progress.report(f"warm-up of {', '.join(variants)}")
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for i in range(plan.warmup):
                loss = fn(i)
                self.first_loss.setdefault(name, loss)
            _sync(plan.dev)
            self.warmup_s[name] = time.perf_counter() - t0

    def time_rounds(self, plan: _Plan, variants: dict[str, Callable[[int], float]]) -> None:
        """`plan.rounds` rounds, each a turn of every variant in an order that alternates."""
        self.load_before = _load()
        # The peak is measured between rounds too: a contended moment can only lower it, so
        # the best of them is the machine's (on CUDA it is the spec sheet's figure).
        self.peak_rate, self.peak_source = peak_flops(plan.dev, plan.threads)
        i = plan.warmup
        for r in range(plan.rounds):
            progress.report("timed rounds", r + 1, plan.rounds)
            for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                self._turn(plan, name, variants[name], i)
            i += plan.steps + 1
            if not plan.cuda:
                self.peak_rate = max(self.peak_rate, peak_flops(plan.dev, plan.threads)[0])
        self.load_after = _load()

    def _turn(self, plan: _Plan, name: str, fn: Callable[[int], float], i: int) -> None:
        """One variant's turn in a round: one untimed step from batch `i`, then `plan.steps`
        timed ones."""
        dev = plan.dev
        if plan.cuda:
            resident = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        fn(i)  # settles the allocator after the other variant (see the module docstring)
        _sync(dev)
        w0, c0, f0 = time.perf_counter(), time.process_time(), _minor_faults()
        for k in range(plan.steps):
            fn(i + 1 + k)
        _sync(dev)
        self.step_s[name].append((time.perf_counter() - w0) / plan.steps)
        self.cpu_s[name].append((time.process_time() - c0) / plan.steps)
        self.faults[name].append((_minor_faults() - f0) // plan.steps)
        if plan.cuda:
            p = torch.cuda.max_memory_allocated(dev)
            self.peak[name] = max(self.peak[name], p)
            self.over[name] = max(self.over[name], p - resident)

    def figures(self, name: str, plan: _Plan, flops_per_token: float) -> dict[str, Any]:
        """`name`'s report: medians over rounds, the best round, MFU, memory, first loss."""
        tokens, med = plan.tokens, statistics.median(self.step_s[name])
        return {
            "tokens_per_s": tokens / med, "step_s": med,
            "tokens_per_s_best": tokens / min(self.step_s[name]),
            "step_s_all": [round(x, 4) for x in self.step_s[name]],
            "cpu_s_per_step": statistics.median(self.cpu_s[name]),
            "faulted_bytes_per_step": int(statistics.median(self.faults[name])) * PAGE,
            "mfu": flops_per_token * tokens / med / self.peak_rate if self.peak_rate else None,
            "peak_memory_bytes": self.peak[name] if plan.cuda else None,
            "step_memory_bytes": self.over[name] if plan.cuda else None,
            "saved_activation_bytes": self.saved.get(name),
            "first_loss": self.first_loss[name],
            "warmup_s": self.warmup_s[name],
        }

    def paired(self, faster: str, baseline: str) -> list[float]:
        """Per round, how many times `faster`'s step time fits in `baseline`'s."""
        return [b / f for f, b in zip(self.step_s[faster], self.step_s[baseline], strict=True)]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _report(plan: _Plan, choices: dict[str, Choice], execution: ModelSection, ours: Olmo3,
            m: _Measured) -> dict[str, Any]:
    """The benchmark's JSON: settings, peak and load, each variant's figures, the ratios."""
    fpt = flops_per_token(plan.cfg, plan.seq_len)
    out: dict[str, Any] = {
        "bench": "train-throughput", "device": str(plan.dev), "preset": plan.preset,
        "settings": _settings(plan, choices, execution, ours),
        "flops_per_token": fpt, "peak_flops": m.peak_rate, "peak_source": m.peak_source,
        "load_before": m.load_before, "load_after": m.load_after, "cpus": os.cpu_count(),
    }
    for name in m.step_s:
        out[name] = m.figures(name, plan, fpt)
    out["ratio"] = statistics.median(m.paired("ours", "hf"))
    out["ratio_rounds"] = [round(x, 4) for x in m.paired("ours", "hf")]
    out["ratio_of_medians"] = out["ours"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    out["ratio_best"] = out["ours"]["tokens_per_s_best"] / out["hf"]["tokens_per_s_best"]
    out["cpu_ratio"] = out["hf"]["cpu_s_per_step"] / out["ours"]["cpu_s_per_step"]
    other = _other_gemms(execution)
    for key, faster, baseline in (("ratio_vs_compiled", "ours", "hf_compiled"),
                                  (f"ratio_{other}", f"ours_{other}", "hf"),
                                  ("ratio_torch_kernels", "ours_torch_kernels", "hf"),
                                  ("ratio_compiled", "ours_compiled", "hf")):
        if faster in m.step_s and baseline in m.step_s:
            out[key] = statistics.median(m.paired(faster, baseline))
    out["target_ratio"] = TARGET_RATIO if (plan.preset == "small" and not plan.cuda) else None
    return out


def _settings(plan: _Plan, choices: dict[str, Choice], execution: ModelSection,
              ours: Olmo3) -> dict[str, Any]:
    """What was measured: the model, the batch, the optimizer, how ours executed."""
    cfg, seq_len, dev = plan.cfg, plan.seq_len, plan.dev
    return {
        "d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
        "head_dim": cfg.head_dim, "mlp_hidden": cfg.mlp_hidden,
        "tokenizer_vocab": cfg.tokenizer_vocab, "vocab_size": cfg.vocab_size,
        "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
        "params": param_count(cfg), "seq_len": seq_len, "micro_batch": plan.micro_batch,
        "tokens_per_step": plan.tokens,
        "threads": torch.get_num_threads() if not plan.cuda else None,
        "dtype": "bf16 autocast, fp32 master weights" if plan.cuda else "float32",
        "optimizer": {"name": "AdamW", "lr": OPTIM.lr, "betas": list(OPTIM.betas),
                      "eps": OPTIM.eps, "weight_decay": OPTIM.weight_decay,
                      "embeddings_decayed": OPTIM.decay_embeddings, "impl": "fused"},
        "clip": TRAIN.clip, "z_loss_ours": TRAIN.z_loss,
        "ours_sliding_attention": _sliding_kind(ours, seq_len, dev)
        if seq_len > cfg.sliding_window else "causal (seq_len <= window)",
        "ours_compiled_blocks": compiles(execution.compile, dev),
        "ours_matmul": ours.matmul,
        "choices": {k: asdict(c) for k, c in choices.items()},
        "ours_kernels": "fused" if ours.fused else "torch",
        "hf_attn_implementation": "sdpa", "transformers": _transformers_version(),
        "torch": torch.__version__, "warmup_steps": plan.warmup, "rounds": plan.rounds,
        "steps_per_round": plan.steps,
    }


def _sliding_kind(model: Olmo3, seq_len: int, dev: torch.device) -> str:
    """How our sliding layers attend, from the mask the model hands them (and, for a window,
    whether its layers' fused window kernel takes it)."""
    mask = model.sliding_mask(seq_len, dev)
    if isinstance(mask, BlockMask):
        return "flex"
    if isinstance(mask, Window):
        attention = next(m for m in model.modules() if isinstance(m, Attention))
        return "window kernel" if attention.window_kernel else "chunks"
    return "sdpa mask"


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor would build CPU kernels with, if there is one."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def format_report(r: dict[str, Any]) -> str:
    s = r["settings"]
    where = (f"{r['device']}, {s['threads']} threads" if s["threads"] else r["device"])
    lines = [
        f"train throughput, preset {r['preset']} ({s['params'] / 1e6:.1f}M params, d_model "
        f"{s['d_model']}, {s['n_layers']} layers, vocab {s['tokenizer_vocab']} padded "
        f"{s['vocab_size']}), seq {s['seq_len']} x micro-batch {s['micro_batch']} = "
        f"{s['tokens_per_step']} tokens/step, {where}, {s['dtype']}, AdamW "
        f"{s['optimizer']['impl']}",
        f"{'':20}{'tokens/s':>10}{'step ms':>10}{'CPU s/step':>12}{'MFU':>8}"
        f"{'memory':>14}{'faulted/step':>14}  first loss",
    ]
    names = {"ours": f"relaytrain ({s['ours_matmul']}, {s['ours_kernels']})",
             "ours_aten": "relaytrain (aten)", "ours_onednn": "relaytrain (onednn)",
             "ours_torch_kernels": "relaytrain (torch ops)", "ours_compiled": "relaytrain compiled",
             "hf": "HF transformers", "hf_compiled": "HF compiled"}
    for key, label in names.items():
        if key not in r:
            continue
        v = r[key]
        mem = v["peak_memory_bytes"] if v["peak_memory_bytes"] is not None else \
            v["saved_activation_bytes"]
        mfu = "-" if v["mfu"] is None else f"{100 * v['mfu']:.1f}%"
        lines.append(f"{label:<20}{v['tokens_per_s']:>10,.0f}{1e3 * v['step_s']:>10,.0f}"
                     f"{v['cpu_s_per_step']:>12.2f}{mfu:>8}{_mib(mem):>14}"
                     f"{_mib(v['faulted_bytes_per_step']):>14}  "
                     f"{v['first_loss']:.4f}")
    memory_kind = ("allocator peak" if r["ours"]["peak_memory_bytes"] is not None
                   else "saved for backward in one forward")
    target = (f"; target >= {r['target_ratio']:.2f}x: "
              f"{'met' if r['ratio'] >= r['target_ratio'] else 'NOT met'}"
              if r.get("target_ratio") else "")
    lines.append(f"ours / HF: {r['ratio']:.2f}x tokens/s (median of {len(r['ratio_rounds'])} "
                 f"paired rounds {r['ratio_rounds']}; ratio of medians "
                 f"{r['ratio_of_medians']:.2f}x, of best rounds {r['ratio_best']:.2f}x "
                 f"({r['ours']['tokens_per_s_best']:,.0f} vs {r['hf']['tokens_per_s_best']:,.0f}"
                 f" tokens/s); CPU time {r['cpu_ratio']:.2f}x){target}")
    if "ratio_vs_compiled" in r:
        lines.append(f"ours / HF compiled: {r['ratio_vs_compiled']:.2f}x")
    for c in s["choices"].values():
        lines.append(f"auto: {Choice(**c).describe()}")
    for other in ("aten", "onednn"):
        if f"ratio_{other}" in r:
            lines.append(f"ours with the other GEMMs (model.matmul={other}) / HF: "
                         f"{r[f'ratio_{other}']:.2f}x (median of paired rounds)")
    if "ratio_torch_kernels" in r:
        lines.append(f"ours with torch's elementwise ops (model.kernels=torch) / HF: "
                     f"{r['ratio_torch_kernels']:.2f}x (median of paired rounds)")
    if "ratio_compiled" in r:
        lines.append(
            f"ours with compiled blocks (model.compile=blocks) / HF: {r['ratio_compiled']:.2f}x "
            f"(median of paired rounds); not the CPU default: its {s['warmup_steps']} warm-up "
            f"steps took {r['ours_compiled']['warmup_s']:.1f} s against "
            f"{r['ours']['warmup_s']:.1f} s eager (Inductor's compile, once per worker "
            "process; its on-disk cache shortens later ones)")
    lines.append(f"memory column: {memory_kind}; MFU peak {r['peak_flops'] / 1e9:,.0f} GFLOP/s "
                 f"({r['peak_source']}), {r['flops_per_token'] / 1e6:,.1f} MFLOP/token")
    lines.append(f"load average before {r['load_before']}, after {r['load_after']} on "
                 f"{r['cpus']} CPUs ({s['rounds']} rounds x {s['steps_per_round']} steps per "
                 f"variant, interleaved, after {s['warmup_steps']} warm-up)")
    return "\n".join(lines)
