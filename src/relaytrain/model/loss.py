"""Language-model loss: cross-entropy in fp32 plus OLMo's z-loss. Part of the model, not of
training: the last stage's forward returns it when given labels (the fused head + loss).

The z-loss, `z_loss * logsumexp(logits)^2`, keeps the softmax normaliser near 1 so bf16
logits do not drift; it is reported apart from the cross-entropy so curves stay comparable with
runs (and reference implementations) that do not use it.

Two entry points compute the same numbers (to float rounding, `tests/train/test_loss.py`):

- `lm_head_loss(h, weight, labels, ...)`, what training uses: the LM head and the loss fused
  into one autograd function that never holds the [tokens, vocab] logits, the largest
  activation of a small model (and of a 7B one: 6.5 GB in fp32 for 16k tokens). The tokens
  are scored `chunk` at a time, and since the loss is a scalar the whole backward of a chunk is
  known in the forward: logits `h_c W^T`, an in-place fp32 `log_softmax` (the z-loss's
  normaliser read off it, `lse = logit[label] - log_softmax[label]`), then in the same buffer
  the logit gradient `softmax * (ce_weight + 2 z_loss lse) - ce_weight * onehot(label)`,
  `grad h_c = g_c W` and `grad W += g_c^T h_c`. The backward only scales the two stored
  gradients by the incoming one, and nothing of the weight is saved (an asynchronous pipeline
  may update it before the backward). With `model.kernels: fused` on the CPU, the softmax
  gradient takes two passes over the chunk (`model.cpu_kernels`: each row's logsumexp, then
  `exp(logit - lse) * (ce_weight + 2 z_loss lse)` in place). What is held from forward to
  backward is `grad h` [tokens, D] and `grad W` [V, D] instead of [tokens, V] logits: less
  whenever there are more tokens than D. Under autocast the matmuls run in the autocast dtype
  and `grad W` is summed in the weight's dtype (fp32 master weights).
  Chunk size: on a GPU it bounds the memory (`GPU_CHUNK_ELEMENTS`). On the CPU the head is
  matmul-bound, so the chunk is as small as keeps the matmuls efficient (`CPU_CHUNK_ELEMENTS`):
  512 tokens of the `small` preset's 8,192 logits, as fast as scoring the whole batch at once
  with MKL's GEMMs and the fastest size through oneDNN's (docs/MEASURED.md).
- `lm_loss(logits, labels, ...)`, for callers that have the logits (evaluation, parity): the
  same log-softmax and gradient over a whole [tokens, vocab] tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from relaytrain.model import cpu_kernels
from relaytrain.model.matmul import add_weight_grad, mm_t

# Logit elements per chunk of `lm_head_loss` when none is given (see the module docstring).
# CPU: 2^22 (16 MiB fp32: 512 tokens of an 8,192-token vocabulary; the `aten` path's chunk
# buffer is reused, oneDNN allocates its own, kept by `retain_freed_memory`). GPU: 2^27 (512 MiB
# fp32, ~1,300 tokens of Olmo 3's 100k vocabulary): full-speed matmuls, small memory.
CPU_CHUNK_ELEMENTS = 2**22
GPU_CHUNK_ELEMENTS = 2**27


def default_chunk(device: torch.device, n_logits: int) -> int:
    """Tokens per chunk for `lm_head_loss`: a fixed logit-element budget per device type."""
    budget = CPU_CHUNK_ELEMENTS if device.type == "cpu" else GPU_CHUNK_ELEMENTS
    return max(1, budget // n_logits)


_chunk_buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _chunk_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat scratch buffer of at least `numel` elements for a chunk's logits, kept between
    calls (one per device and dtype, grown when needed).

    Only `lm_head_loss`'s forward uses it, and nothing of it outlives the call, so handing out
    the same memory every time is safe. A fresh one per call cost page faults on the CPU: glibc
    returns freed blocks this large to the OS now and then, and the CPU allocator has no cache.
    """
    key = (device, dtype)
    buf = _chunk_buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = _chunk_buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf


class _HeadCrossEntropyZLoss(torch.autograd.Function):
    """(total, ce, z) of the logits `h @ weight[:n_logits].T`, chunk by chunk; `total` carries
    the gradient of h [N, D] and weight [V, D], formed in the forward."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, labels: Tensor, n_logits: int,
                z_loss: float, ignore_index: int, chunk: int, dtype: torch.dtype,
                need_h: bool, need_w: bool, matmul: str, fused: bool,
                ) -> tuple[Tensor, Tensor, Tensor]:
        w = weight[:n_logits].to(dtype)  # the padded rows never enter the logits
        hc = h.to(dtype)
        valid = labels != ignore_index
        count = valid.sum().clamp(min=1)
        target = torch.where(valid, labels, 0)[:, None]
        ce_weight = valid / count  # d ce / d logit[label] = -ce_weight (0 when ignored)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = None  # [n_logits, D], summed over the chunks
        sums = torch.zeros(2, device=h.device)  # sum of nll, sum of lse^2 over valid tokens
        buf = _chunk_buffer(min(chunk, h.shape[0]) * n_logits, dtype, h.device)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                e = min(s + chunk, h.shape[0])
                h_c, t, ok = hc[s:e], target[s:e], valid[s:e]
                logits = mm_t(h_c, w, matmul, scratch=buf[: (e - s) * n_logits].view(e - s, -1))
                logits = logits.float()
                picked = logits.gather(1, t).squeeze(1)
                in_kernels = fused and cpu_kernels.cpu_fp32(logits)
                if in_kernels:
                    lse = cpu_kernels.logsumexp_rows(logits)
                    nll = lse - picked
                else:
                    logp = torch.log_softmax(logits, dim=-1, out=logits)
                    nll = -logp.gather(1, t).squeeze(1)
                    lse = picked + nll
                sums += torch.stack((nll, lse.square())).where(ok, 0.0).sum(1)
                if not (need_h or need_w):
                    continue
                row = ce_weight[s:e] * (1.0 + 2.0 * z_loss * lse)
                # softmax * row, in the logits buffer
                g = (cpu_kernels.softmax_scale_(logits, lse, row) if in_kernels
                     else logp.exp_().mul_(row[:, None]))
                g.scatter_add_(1, t, -ce_weight[s:e, None])
                g = g.to(dtype)
                if grad_h is not None:
                    grad_h[s:e] = mm_t(g, w.t(), matmul)
                if need_w:
                    grad_w = add_weight_grad(grad_w, g, h_c, matmul, weight.dtype)
        if grad_w is not None and n_logits < weight.shape[0]:  # padded rows: no gradient
            grad_w = torch.cat((grad_w, weight.new_zeros(weight.shape[0] - n_logits,
                                                         weight.shape[1])))
        elif grad_w is not None:  # in the weight's layout: callers may take it as .grad
            grad_w = grad_w.contiguous()
        ce, z = sums[0] / count, z_loss * sums[1] / count
        ctx.save_for_backward(grad_h, grad_w)
        total = ce + z
        ctx.mark_non_differentiable(ce, z)
        return total, ce, z

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, _ce: Tensor, _z: Tensor
                 ) -> tuple[Tensor | None, ...]:
        # Scaled in place: unpacking checks the version counter, so a second backward through
        # a retained graph fails loudly instead of scaling twice.
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_total)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_total)
        return grad_h, grad_w, *([None] * 10)


def lm_head_loss(h: Tensor, weight: Tensor, labels: Tensor, z_loss: float,
                 n_logits: int | None = None, ignore_index: int = -100,
                 chunk: int | None = None, matmul: str = "aten", fused: bool = False,
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """(total, ce, z) of the LM head `h @ weight[:n_logits].T` on hidden states h [..., D] and
    next-token labels [...], without materialising the logits (see the module docstring).

    Same meaning as `lm_loss` on those logits: means over the tokens whose label is not
    `ignore_index`, `total = ce + z` carries the gradient (to h and weight; the rows of weight
    past `n_logits`, vocabulary padding, get zeros), `ce` and `z` are detached. `chunk` tokens
    are scored at a time (default: `default_chunk`). Under autocast the logits are computed in
    the autocast dtype, everything after them in fp32. `matmul`: the products' backend
    (`model.matmul`: `aten` or `onednn`); `fused`: the softmax through the fused CPU kernels
    (`model.kernels`; two passes over each chunk's logits where torch's ops make four).
    """
    v, d = weight.shape
    n_logits = v if n_logits is None else n_logits
    if not 0 < n_logits <= v or h.shape[-1] != d:
        raise ValueError(f"lm_head_loss: h [..., {h.shape[-1]}] and weight {list(weight.shape)} "
                         f"with n_logits={n_logits}: need h [..., {d}] and 0 < n_logits <= {v}")
    chunk = default_chunk(h.device, n_logits) if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"lm_head_loss: chunk={chunk} must be >= 1 token")
    kind = h.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
    grad = torch.is_grad_enabled()
    return _HeadCrossEntropyZLoss.apply(
        h.reshape(-1, d), weight, labels.reshape(-1), n_logits, float(z_loss), ignore_index,
        chunk, dtype, grad and h.requires_grad, grad and weight.requires_grad, matmul, fused)


class _CrossEntropyZLoss(torch.autograd.Function):
    """(ce, z) means over the valid tokens of fp32 logits [N, V]; gradient for both."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, z_loss: float, ignore_index: int,
                in_place: bool) -> tuple[Tensor, Tensor]:
        valid = labels != ignore_index
        count = valid.sum().clamp(min=1)
        target = torch.where(valid, labels, 0)[:, None]
        picked = logits.gather(1, target).squeeze(1) if z_loss else None
        if in_place:  # a private fp32 copy: it becomes the log-probs (same values)
            logp = logits.detach()
            torch.log_softmax(logp, dim=-1, out=logp)
        else:
            logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(1, target).squeeze(1)
        ce = torch.where(valid, nll, 0.0).sum() / count
        if picked is not None:
            lse = picked + nll
            z = z_loss * torch.where(valid, lse.square(), 0.0).sum() / count
        else:
            lse = None
            z = torch.zeros((), device=logits.device)
        ctx.z_loss = z_loss
        ctx.save_for_backward(logp, target, valid, count, lse)
        return ce, z

    @staticmethod
    def backward(ctx: Any, grad_ce: Tensor, grad_z: Tensor) -> tuple[Tensor | None, ...]:
        # Unpacking checks the version counter, so a second backward through a retained graph
        # fails loudly instead of reading the already-exponentiated buffer.
        logp, target, valid, count, lse = ctx.saved_tensors
        weight = torch.where(valid, grad_ce / count, 0.0)  # d loss / d logit[label] = -weight
        row = weight
        if lse is not None:
            row = weight + torch.where(valid, grad_z * (2.0 * ctx.z_loss) / count * lse, 0.0)
        grad = logp.exp_().mul_(row[:, None])  # softmax * row, in the saved buffer
        grad.scatter_add_(1, target, -weight[:, None])
        return grad, None, None, None, None


def lm_loss(logits: Tensor, labels: Tensor, z_loss: float, ignore_index: int = -100,
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(total, ce, z) for logits [..., V] and next-token labels [...] (already shifted).

    Both terms are means over the tokens whose label is not `ignore_index` (0 when there are
    none, rather than NaN). `total = ce + z` carries the gradient; `ce` and `z` are detached.
    Logits in a lower precision, or not contiguous (the padded vocabulary sliced off), are
    scored in an fp32 copy, which then holds the log-probabilities and later the gradient;
    fp32 contiguous logits are left alone and the log-probabilities get a buffer of their own.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    shared = flat.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    ce, z = _CrossEntropyZLoss.apply(flat, labels.reshape(-1), float(z_loss), ignore_index,
                                     not shared)
    return ce + z, ce.detach(), z.detach()
