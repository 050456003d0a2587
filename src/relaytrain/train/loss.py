"""Language-model loss: cross-entropy in fp32 plus OLMo's z-loss.

The z-loss, `z_loss * logsumexp(logits)^2`, keeps the softmax normaliser near 1 so bf16
logits do not drift; it is reported apart from the cross-entropy so curves stay comparable with
runs (and reference implementations) that do not use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def lm_loss(logits: Tensor, labels: Tensor, z_loss: float, ignore_index: int = -100,
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(total, ce, z) for logits [..., V] and next-token labels [...] (already shifted).

    Both terms are means over the tokens whose label is not `ignore_index` (0 when there are
    none, rather than NaN). `total = ce + z` carries the gradient; `ce` and `z` are detached.
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    count = valid.sum().clamp(min=1)
    ce = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum") / count
    if z_loss:
        lse = torch.logsumexp(flat, dim=-1)
        z = z_loss * torch.where(valid, lse.square(), 0.0).sum() / count
    else:
        z = torch.zeros((), device=flat.device)
    return ce + z, ce.detach(), z.detach()
