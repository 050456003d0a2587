"""Language-model loss: cross-entropy in fp32 plus OLMo's z-loss.

The z-loss, `z_loss * logsumexp(logits)^2`, keeps the softmax normaliser near 1 so bf16
logits do not drift; it is reported apart from the cross-entropy so curves stay comparable with
runs (and reference implementations) that do not use it.

Both terms come from one fused autograd function over the [tokens, vocab] logits, the largest
activation of a small model: one `log_softmax` pass in the forward (the normaliser of the
z-loss is read off it, `lse = logit[label] - log_softmax[label]`, so no second `logsumexp`
pass), and in the backward the saved log-probabilities are turned into the gradient in place,
`softmax * (ce_weight + 2 z_loss lse) - ce_weight * onehot(label)`. Unfused (cross_entropy +
logsumexp, autograd adding the two gradients) this took ~10 passes over the logits and 5x
the time on the CPU; the values agree to float rounding (`tests/train/test_loss.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _CrossEntropyZLoss(torch.autograd.Function):
    """(ce, z) means over the valid tokens of fp32 logits [N, V]; gradient for both."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, z_loss: float, ignore_index: int,
                in_place: bool) -> tuple[Tensor, Tensor]:
        valid = labels != ignore_index
        count = valid.sum().clamp(min=1)
        target = torch.where(valid, labels, 0)[:, None]
        picked = logits.gather(1, target).squeeze(1) if z_loss else None
        if in_place:  # same kernel, same values; the logits buffer becomes the log-probs
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
            overwrite_logits: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(total, ce, z) for logits [..., V] and next-token labels [...] (already shifted).

    Both terms are means over the tokens whose label is not `ignore_index` (0 when there are
    none, rather than NaN). `total = ce + z` carries the gradient; `ce` and `z` are detached.
    Logits in a lower precision, or not contiguous (the padded vocabulary sliced off), are
    scored in an fp32 copy, which then holds the log-probabilities and later the gradient.
    fp32 contiguous logits are not copied: with `overwrite_logits` their buffer is used that
    way too (saving a [tokens, vocab] allocation; the caller must not read `logits` after this
    call), otherwise the log-probabilities get a buffer of their own. The values are the same.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    shared = flat.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    ce, z = _CrossEntropyZLoss.apply(flat, labels.reshape(-1), float(z_loss), ignore_index,
                                     overwrite_logits or not shared)
    return ce + z, ce.detach(), z.detach()
