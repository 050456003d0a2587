"""One optimizer step of an unpipelined model replica: gradient accumulation over this rank's
micro-batches, the DP reduction, clipping and the update; and what a step computed
(`StepOutcome`, with a pipeline stage's measurements, `PipelineStats`, train/pipeline_stage.py)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from relaytrain.data.packing import Docs, model_inputs
from relaytrain.parallel.context import ContextGroup, label_share, sequence_mean
from relaytrain.parallel.reduce import GradReducer, ReduceStats
from relaytrain.train.optim import AdamW
from relaytrain.train.skip_step import global_ce

if TYPE_CHECKING:  # imported only by workers that shard (parallel/shards.py says why)
    from relaytrain.parallel.fsdp import ShardedGradReducer


@dataclass(frozen=True)
class PipelineStats:
    """A pipeline stage's schedule measurements for one step: those of the span it ran in
    (shared by the span's steps) and its own micro-batches' staleness."""

    bubble: float  # time blocked in receives and in the global-norm all-reduce / span time
    wait_s: float  # that blocked time, in seconds
    span_s: float
    staleness_bound: int  # the schedule's bound on `staleness` at this stage
    updates: int  # this stage's updates in the span
    peak_memory: int  # peak bytes held for in-flight micro-batches (and stashed weights)
    weight_versions: int  # peak distinct weight storages referenced (live + stashed)
    forward_s: float  # mean seconds per F, B and U action (waits excluded)
    backward_s: float
    update_s: float
    staleness: list[int]  # per micro-batch of the step: this stage's updates between F and B
    weight_s: float = 0.0  # mean seconds per W (split lists: the weight-gradient half of B)


@dataclass
class StepOutcome:
    # global micro-batch index -> (total, ce, z) losses, as Python floats (exact fp32 values)
    losses: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    grad_norm: float = 0.0
    finite: bool = True
    skipped: bool = False  # optim.skip_spikes held the update back (train/skip_step.py)
    pipeline: PipelineStats | None = None  # a pipeline stage's schedule measurements
    reduction: ReduceStats | None = None  # the gradient reduction's cost (unpipelined steps)


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast with fp32 master weights on GPU; plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(model: nn.Module, optimizer: AdamW,
               reducer: GradReducer | ShardedGradReducer,
               micro_batches: list[tuple[int, torch.Tensor]], total_micro_batches: int,
               z_loss: float, clip: float, device: torch.device,
               skip: Callable[[float, float], bool] | None = None,
               documents: Mapping[int, Docs] | None = None,
               mask_documents: bool = False,
               context: ContextGroup | None = None) -> StepOutcome:
    """Accumulate, reduce, clip, update. A non-finite loss or gradient skips the update so the
    weights (and the last good checkpoint) stay intact; so does `skip`(global CE loss, gradient
    norm) when true (optim.skip_spikes: the optimizer's state untouched, as OLMo-core's).
    `documents`: packed micro-batches' document lengths (`Batch.documents`): their padding is
    no label, and with `mask_documents` attention stays within documents. With a `context`
    (parallel.cp) this rank computes its part of every sequence; a micro-batch's losses are
    the means over all its tokens, whatever the split."""
    out = StepOutcome()
    reducer.start()
    # exact mode folds each gradient as the backward makes it, and all-reduces in the last
    with reducer.overlapping(len(micro_batches)):
        for index, tokens in micro_batches:
            docs = (documents or {}).get(index)
            losses, share = _forward_backward(model, tokens, z_loss, total_micro_batches,
                                              device, docs, mask_documents, context)
            reducer.after_backward()
            out.losses[index] = sequence_mean([float(x.detach()) for x in losses], share,
                                              context, device)
    ok = reducer.finish()
    out.reduction = reducer.stats
    out.grad_norm = float(reducer.clip(clip if clip > 0 else math.inf))
    # every rank joins the loss's collective, whatever its own losses hold (a cp group's ranks
    # hold the same: its first fills the slots)
    own = out.losses if context is None or context.split.rank == 0 else {}
    ce = global_ce(own, total_micro_batches, reducer.group, device) if skip is not None else 0.0
    out.finite = ok and math.isfinite(out.grad_norm) and all(
        math.isfinite(v[0]) for v in out.losses.values())
    out.skipped = out.finite and skip is not None and skip(ce, out.grad_norm)
    if out.finite and not out.skipped:
        optimizer.step()
    optimizer.zero_grad()
    return out


def _forward_backward(model: nn.Module, tokens: torch.Tensor, z_loss: float, scale: int,
                      device: torch.device, docs: Docs | None = None,
                      mask_documents: bool = False, context: ContextGroup | None = None,
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], float]:
    """One micro-batch's losses and this rank's share of its scored tokens, its gradients
    (divided by `scale`) accumulated. With a `context`, of this rank's part of the sequences
    (packed instances whole, as OLMo-core feeds them, so that they split): its loss is the
    mean over its part's scored tokens, so the gradient of the whole sequences' mean is its
    own times its share of them (`label_share`), summed over the cp ranks by the reducer."""
    inputs, labels, doc_lens = model_inputs(tokens.to(device, non_blocking=True), docs,
                                            whole=context is not None)
    kwargs: dict = {"doc_lens": doc_lens} if mask_documents and doc_lens is not None else {}
    share = 1.0
    if context is not None:
        share = label_share(labels, context)
        inputs, labels = context.split.local(inputs), context.split.local(labels)
        kwargs["context"] = context
    with autocast_for(device):  # the fused head + loss: no [tokens, vocab] logits held
        total, ce, z = model(inputs, labels=labels, z_loss=z_loss, **kwargs)
    (total * share / scale).backward()
    return (total, ce, z), share


def warm_kernels(model: nn.Module, micro_batch: int, seq_len: int, z_loss: float,
                 device: torch.device) -> None:
    """One forward and backward of a micro-batch of the run's shape (token 0 throughout),
    its gradients dropped: weights, optimizer and random streams untouched.

    Why: a process's first products of a shape build their kernels (oneDNN JIT-compiles
    each primitive: 1.1-1.3 s for the tiny preset on an AMD EPYC, against 0.02-0.04 s for
    a step after), so a spare or the standby promoted after a failure would pay that in the
    first step of the recovery (docs/MEASURED.md: recovery time)."""
    tokens = torch.zeros(micro_batch, seq_len + 1, dtype=torch.long)
    _forward_backward(model, tokens, z_loss, 1, device)
    model.zero_grad(set_to_none=True)
