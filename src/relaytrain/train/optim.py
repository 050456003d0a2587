"""AdamW with the Olmo recipe's parameter groups, the learning-rate schedule, and the optimizer
state as flat tensors keyed by global parameter name (the checkpoint format)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from relaytrain.checkpoint.keys import optim_key
from relaytrain.config.sections import OptimSection
from relaytrain.parallel.shards import as_like, local_tensor

MOMENTS = ("exp_avg", "exp_avg_sq")  # shaped as the parameter (sharded as it is)
STATE_KEYS = (*MOMENTS, "step")


class AdamW:
    """AdamW on torch's fused kernel (`torch._fused_adamw_`), the one `torch.optim.AdamW(...,
    fused=True)` runs, called the same way: the same bits and the same state layout
    (`exp_avg`, `exp_avg_sq`, and `step` as a float32 scalar on the parameter's device).

    Not `torch.optim`: its first use imports torch._dynamo (Optimizer's methods are wrapped to
    keep the compiler out), 0.9-2 s of every worker's start, paid again by every replacement in
    a recovery. Sharded parameters (DTensors) are updated through their local chunks."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float],
                 eps: float):
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, **g,
                              "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            by_kind: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p) or self._init_state(p)
                lists = by_kind.setdefault((p.device, p.dtype), [[], [], [], [], []])
                for out, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                          state["step"]), strict=True):
                    out.append(local_tensor(t))
            beta1, beta2 = group["betas"]
            for params, grads, exp_avgs, exp_avg_sqs, steps in by_kind.values():
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                                    amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
                                    weight_decay=group["weight_decay"], eps=group["eps"],
                                    maximize=False, grad_scale=None, found_inf=None)

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p] = {
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            "step": torch.zeros((), dtype=torch.float32, device=p.device)}
        return state

    def zero_grad(self) -> None:
        """Gradients dropped, not zeroed (freed memory; the next backward writes them anew)."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def build_optimizer(model: nn.Module, cfg: OptimSection) -> AdamW:
    """AdamW; embeddings are not decayed unless `decay_embeddings` (the Olmo 3 recipe).

    The fused kernel on every device: one kernel per parameter group instead of a dozen passes
    over the state (faster than `foreach` on the CPU too, docs/MEASURED.md); deterministic."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.startswith("embed.") and not cfg.decay_embeddings else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return AdamW(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps)


def lr_at(step: int, cfg: OptimSection, max_steps: int) -> float:
    """Linear warm-up, then `optim.schedule` down to `lr * final_lr_frac` at `optim.t_max`
    (default `max_steps`), flat after (1-based step).

    OLMo-core's `CosWithWarmup` / `LinearWithWarmup` / `HalfCosWithWarmup` with `alpha_f =
    final_lr_frac` and their `t_max` (default: the trainer's max steps), as the official Olmo 3
    scripts run them. The half cosine warms up to the cosine's midpoint (its `lr` is the whole
    cosine's peak) and runs the cosine's second half: the schedule an extended run (the 7B
    pre-training's part 2) continues on from its resumed step."""
    floor = cfg.lr * cfg.final_lr_frac
    peak = (floor + (cfg.lr - floor) / 2) if cfg.schedule == "half-cosine" else cfg.lr
    if cfg.warmup > 0 and step <= cfg.warmup:
        return peak * step / cfg.warmup
    horizon = max_steps if cfg.t_max is None else cfg.t_max
    span = max(1, horizon - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * progress
    if cfg.schedule == "half-cosine":
        progress = (1.0 + progress) / 2
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: AdamW, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_state_tensors(model: nn.Module, optimizer: AdamW) -> dict[str, torch.Tensor]:
    """`optim.<param name>.<state>` for every parameter that has state."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        if not state:
            continue
        for key in STATE_KEYS:
            out[optim_key(name, key)] = state[key]
    return out


def load_optimizer_state(model: nn.Module, optimizer: AdamW, tensors: dict[str, torch.Tensor],
                         local: bool = False, owned: bool = False) -> None:
    """Inverse of optimizer_state_tensors: whole tensors, or with `local` this rank's rows of
    the sharded ones (parallel/shards.py); parameters without saved state start fresh.
    `owned`: the tensors are the caller's to give away (a checkpoint read made them), so they
    become the state as they are instead of being copied."""
    for name, p in model.named_parameters():
        keys = [optim_key(name, k) for k in STATE_KEYS]
        if not all(k in tensors for k in keys):
            continue
        optimizer.state[p] = {
            "exp_avg": as_like(tensors[keys[0]], p, local, copy=not owned),  # sharded as `p`
            "exp_avg_sq": as_like(tensors[keys[1]], p, local, copy=not owned),
            "step": tensors[keys[2]].to(device=p.device, dtype=torch.float32, copy=not owned)}
