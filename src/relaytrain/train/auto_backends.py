"""`auto` for every setting chosen for speed, resolved once for a run: the GEMMs
(`model.matmul`), the elementwise kernels (`model.kernels`) and the sliding layers' attention
(`model.attention`), each measured on this host where it is a choice (`model.backend_choice`).

Why measured on the model's blocks at the run's micro-batch: the fused CPU kernels make one
pass over memory where torch's ops make several, and the chunked sliding attention computes
only each query's window where the dense mask computes every pair; what that saves against
what the kernels themselves cost depends on the processor, its caches and the shapes. The
kernels are timed on a stage of the model (its layers up to its first full one, as many
sliding layers to a full one as the model has, and the LM head with its softmax: forward and
backward), the attention on one sliding layer, each
with the backends already chosen before it (GEMMs, then kernels, then attention). Compiled
blocks and GPUs are not measured: compiled code fuses the elementwise work itself and traces
the dense mask, and on a GPU only torch's ops and FlexAttention apply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from relaytrain.config import ModelSection
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
from relaytrain.train.execution import compiles, freed_memory_retained

MAX_TOKENS = 4096  # tokens per timed forward: the run's micro-batch, fewer sequences past this


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
    compiled = compiles(section.compile, device)
    shape = (max(1, min(micro_batch, MAX_TOKENS // seq_len)), seq_len)
    host = key or backend_choice.host_key(threads)
    where = f"{host} | matmul {matmul.backend} | {_dims(cfg)} | {shape}"
    kernels = kept(_kernels(section.kernels, cfg, device, threads, shape, matmul.backend,
                            compiled, where, cache))
    attention = kept(_attention(section.attention, cfg, device, threads, shape, matmul.backend,
                                kernels.backend, compiled, f"{where} | kernels {kernels.backend}",
                                cache))
    return {"matmul": matmul, "kernels": kernels, "attention": attention}


def _kernels(setting: str, cfg: Olmo3Config, device: torch.device, threads: int,
             shape: tuple[int, int], matmul: str, compiled: bool, key: str,
             cache: Path | None) -> Choice:
    fused = cpu_kernels.resolve(setting, device)  # checks the setting; warns where unbuilt
    if setting != "auto":
        return Choice("kernels", setting, "setting")
    if device.type != "cpu":
        return Choice("kernels", "torch", "device")
    if not fused:
        return Choice("kernels", "torch", "fused kernels not built here")
    if compiled:  # compiled blocks run their own code; the fused softmax stays the head's
        return Choice("kernels", "fused", "compiled blocks")
    stage = _stage(cfg, sliding_only=False)
    return decide("kernels", key, lambda: _measure(
        {k: _timed_round(stage, shape, matmul, k, "chunks") for k in ("torch", "fused")},
        threads), cache)


def _attention(setting: str, cfg: Olmo3Config, device: torch.device, threads: int,
               shape: tuple[int, int], matmul: str, kernels: str, compiled: bool, key: str,
               cache: Path | None) -> Choice:
    if setting != "auto":
        return Choice("attention", setting, "setting")
    if device.type == "cuda":
        return Choice("attention", "flex", "device")
    if compiled:
        return Choice("attention", "sdpa", "compiled blocks")
    if SLIDING not in cfg.layer_types or shape[1] <= cfg.sliding_window:
        return Choice("attention", "sdpa", "no sliding window at this sequence length")
    stage = _stage(cfg, sliding_only=True)
    return decide("attention", key, lambda: _measure(
        {a: _timed_round(stage, shape, matmul, kernels, a) for a in ("sdpa", "chunks")},
        threads), cache)


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
