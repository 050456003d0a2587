"""The backends a run uses for the settings chosen for speed: the GEMMs (`model.matmul`), the
elementwise kernels (`model.kernels`) and the sliding layers' attention (`model.attention`),
`auto` measured on this host. One entry point, `choose_backends` (the settings, the model,
the device and what the contests need in; the chosen backends out), used by the controller
through `settle_backends` and by the benchmarks; read top to bottom: the GEMMs, then the
kernels, then the attention, each contest run with the backends chosen before it.

`model.backend_choice` holds the machinery below it: the per-host cache, the alternating timed
rounds, keep-on-resume, and the GEMMs' contest itself (the model resolves `matmul: auto` on its
own when used directly, outside a run).

Why the kernels and attention are measured on the model's blocks at the run's micro-batch: the
fused CPU kernels make one pass over memory where torch's ops make several, and the chunked
sliding attention computes only each query's window where the dense mask computes every pair;
what that saves against what the kernels themselves cost depends on the processor, its caches
and the shapes. The kernels are timed on a stage of the model (its layers up to its first
full one, as many sliding layers to a full one as the model has, and the LM head with its
softmax: forward and backward), the attention on one sliding layer. Compiled blocks and GPUs
are not measured: compiled code fuses the elementwise work itself and traces the dense mask,
and on a GPU only torch's ops and FlexAttention apply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from relaytrain.config.sections import ModelSection, RunConfig
from relaytrain.errors import ConfigError
from relaytrain.model import backend_choice, cpu_kernels
from relaytrain.model.backend_choice import (
    Choice,
    alternate,
    choose_matmul,
    decide,
    keep_on_resume,
)
from relaytrain.model.config import FULL, SLIDING, Olmo3Config
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3
from relaytrain.train.execution import compiles, freed_memory_retained, pick_device

MAX_TOKENS = 4096  # tokens per timed forward: the run's micro-batch, fewer sequences past this


def settle_backends(cfg: RunConfig, model_cfg: Olmo3Config,
                    recorded: Mapping[str, Any] | None = None,
                    ) -> tuple[RunConfig, dict[str, Choice]]:
    """A run's config with its backends settled, and the choices: `choose_backends` for the
    run's device, threads per worker, micro-batch and sequence length, where `recorded` is the
    manifest of the checkpoint it resumes from. Decided once, by the controller, so every worker
    runs the same backends (which per-worker measurements would not guarantee) and config.yaml
    records them; ConfigError naming the key of a setting that cannot run here."""
    device = pick_device(cfg.train.device)
    if cfg.parallel.paci.predict and compiles(cfg.model.compile, device):
        raise ConfigError(f"config key 'parallel.paci.predict': got true with model.compile="
                          f"{cfg.model.compile}, which compiles the blocks on {device.type}, and "
                          "compiled blocks do not form the prediction; expected model.compile=none")
    try:
        chosen = choose_backends(cfg.model, model_cfg, device,
                                 cfg.runtime.threads_per_worker, cfg.train.micro_batch,
                                 cfg.seq_len, recorded=recorded)
    except ValueError as e:
        setting = str(e).partition("=")[0]
        raise ConfigError(f"config key 'model.{setting}': {e}") from None
    return replace(cfg, model=settled(cfg.model, chosen)), chosen


def choose_backends(section: ModelSection, cfg: Olmo3Config, device: torch.device,
                    threads: int, micro_batch: int, seq_len: int, *,
                    recorded: Mapping[str, Any] | None = None, key: str | None = None,
                    cache: Path | None = None) -> dict[str, Choice]:
    """The concrete `matmul`, `kernels` and `attention` for a run of `cfg` (micro-batches of
    `micro_batch` x `seq_len` tokens, `threads` torch threads per worker) as `section` sets
    them; ValueError naming the setting for one that cannot run here. A resumed run passes
    what its checkpoint `recorded` (`keep_on_resume`), before each later contest measures
    with it. `key` replaces the host key, `cache` the cache file (tests)."""
    def kept(choice: Choice) -> Choice:
        return keep_on_resume(choice, (recorded or {}).get(choice.setting))

    matmul = kept(choose_matmul(section.matmul, cfg, device, threads, key=key, cache=cache))
    blocks = _Blocks(cfg, device, threads, (max(1, min(micro_batch, MAX_TOKENS // seq_len)),
                                            seq_len), compiles(section.compile, device), cache)
    where = (f"{key or backend_choice.host_key(threads)} | matmul {matmul.backend} | "
             f"{_dims(cfg)} | {blocks.shape}")
    kernels = kept(_kernels(section.kernels, blocks, matmul.backend, where))
    attention = kept(_attention(section.attention, blocks, matmul.backend, kernels.backend,
                                f"{where} | kernels {kernels.backend}"))
    return {"matmul": matmul, "kernels": kernels, "attention": attention}


def settled(section: ModelSection, chosen: Mapping[str, Choice]) -> ModelSection:
    """`section` with the chosen backends in place of its settings (`auto` among them)."""
    return replace(section, **{k: c.backend for k, c in chosen.items()})


@dataclass(frozen=True)
class _Blocks:
    """Where the kernels and attention contests run: the model's blocks on `device` at
    `threads` torch threads, micro-batches of `shape`, compiled or not, cached in `cache`."""

    cfg: Olmo3Config
    device: torch.device
    threads: int
    shape: tuple[int, int]
    compiled: bool
    cache: Path | None

    def contest(self, setting: str, key: str, sliding_only: bool,
                candidates: dict[str, tuple[str, str, str]]) -> Choice:
        """`auto` for `setting`, the cache's answer for `key` or measured: one forward and
        backward of a stage of the model (`_stage`) per round under each candidate's
        (matmul, kernels, attention), in alternating rounds."""
        stage = _stage(self.cfg, sliding_only)
        return decide(setting, key, lambda: _measure(
            {name: _timed_round(stage, self.shape, *backends)
             for name, backends in candidates.items()}, self.threads), self.cache)


def _kernels(setting: str, blocks: _Blocks, matmul: str, key: str) -> Choice:
    fused = cpu_kernels.resolve(setting, blocks.device)  # checks the setting; warns if unbuilt
    if setting != "auto":
        return Choice("kernels", setting, "setting")
    if blocks.device.type != "cpu":
        return Choice("kernels", "torch", "device")
    if not fused:
        return Choice("kernels", "torch", "fused kernels not built here")
    if blocks.compiled:  # compiled blocks run their own code; the fused softmax stays the head's
        return Choice("kernels", "fused", "compiled blocks")
    return blocks.contest("kernels", key, sliding_only=False, candidates={
        k: (matmul, k, "chunks") for k in ("torch", "fused")})


def _attention(setting: str, blocks: _Blocks, matmul: str, kernels: str, key: str) -> Choice:
    cfg = blocks.cfg
    if setting != "auto":
        return Choice("attention", setting, "setting")
    if blocks.device.type == "cuda":
        return Choice("attention", "flex", "device")
    if blocks.compiled:
        return Choice("attention", "sdpa", "compiled blocks")
    if SLIDING not in cfg.layer_types or blocks.shape[1] <= cfg.sliding_window:
        return Choice("attention", "sdpa", "no sliding window at this sequence length")
    return blocks.contest("attention", key, sliding_only=True, candidates={
        a: (matmul, kernels, a) for a in ("sdpa", "chunks")})


def _measure(rounds: dict[str, Callable[[], float]], threads: int
             ) -> tuple[dict[str, float], float]:
    """`alternate` as a worker runs: freed memory kept in the process (a worker's setting,
    without which each round page-faults its buffers in again and the faults decide)."""
    with freed_memory_retained():
        return alternate(rounds, threads=threads)


def _dims(cfg: Olmo3Config) -> str:
    return (f"d {cfg.d_model} heads {cfg.n_heads}/{cfg.n_kv_heads}x{cfg.head_dim} mlp "
            f"{cfg.mlp_hidden} vocab {cfg.vocab_size} window {cfg.sliding_window} layers "
            f"{sorted(set(cfg.layer_types))}")


def _stage(cfg: Olmo3Config, sliding_only: bool) -> Olmo3:
    """What a contest times: one sliding layer alone (`sliding_only`), else the model's first
    layers up to and including its first full one (Olmo 3's pattern: three sliding layers to
    one full, so the kernels are timed on the mix of layers the model has) and the LM head;
    random weights."""
    types = cfg.layer_types
    if sliding_only:
        i = types.index(SLIDING)
        layers = range(i, i + 1)
    else:
        layers = range(types.index(FULL) + 1 if FULL in types else 1)
    stage = Olmo3(cfg, layers, first=False, last=not sliding_only)
    init_weights(stage, 0)
    return stage


def _timed_round(stage: Olmo3, shape: tuple[int, int], matmul: str, kernels: str,
                 attention: str) -> Callable[[], float]:
    """One forward and backward of `stage` on a micro-batch of `shape`, configured so."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, stage.cfg.d_model, generator=gen, requires_grad=True)
    labels = torch.randint(0, stage.n_logits, shape, generator=gen)

    def run() -> float:
        stage.configure(attention, "none", matmul, kernels)
        t0 = time.perf_counter()
        out = stage(x, labels) if stage.last else stage(x)
        (out[0] if stage.last else out.square().mean()).backward()
        seconds = time.perf_counter() - t0
        stage.zero_grad(set_to_none=True)
        x.grad = None
        return seconds
    return run
