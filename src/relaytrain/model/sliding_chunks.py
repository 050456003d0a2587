"""Sliding-window attention on the CPU, a chunk of queries at a time over only the keys in their
windows (`model.attention: chunks`, what `auto` runs on the CPU).

Why: SDPA's CPU flash kernel given a dense mask scores every query against every key and masks
the rest away, so a sliding layer cost as much as a causal one (at T = 256 and a 64-token
window, the `small` preset). Here each chunk of `CHUNK` queries attends to the keys its window
reaches (`spans`, a pure function), with the same flash kernels forward and backward (their
per-row log-sum-exp kept between the two): O(T * (CHUNK + window)) scores instead of T^2
(docs/MEASURED.md). The result equals the dense mask's to float rounding (the kernel's blocks
of keys start at other positions), and, like it, depends on nothing but T and the window.
With the fused CPU kernels, sliding layers whose head dims they take run their own window
kernel instead (`cpu_kernels.window_attention`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

CHUNK = 32  # queries per chunk: the fastest of 32, 64 and 128 at the small preset's shapes
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class Window:
    """What sliding layers receive for a mask under `chunks`: the window, nothing of size T^2."""

    size: int


def spans(seq_len: int, window: int, chunk: int = CHUNK) -> list[tuple[int, int, int]]:
    """(first query, end of queries, first key) per chunk: queries [s, e) see keys [k, e),
    k = max(0, s - window + 1), every key some query of the chunk may see."""
    return [(s, min(seq_len, s + chunk), max(0, s - window + 1))
            for s in range(0, seq_len, chunk)]


def _band(start: int, end: int, first_key: int, window: int) -> Tensor:
    """The additive fp32 mask of queries [start, end) over keys [first_key, end): 0 where
    query q sees key k (q - window < k <= q), -inf elsewhere."""
    return _relative_band(start - first_key, end - first_key, window)


@functools.lru_cache(maxsize=64)
def _relative_band(start: int, end: int, window: int) -> Tensor:
    """`_band` with positions counted from the first key: every interior chunk shares one."""
    q = torch.arange(start, end)[:, None]
    k = torch.arange(end)[None, :]
    return torch.zeros(end - start, end).masked_fill_((k > q) | (k <= q - window), float("-inf"))


class _SlidingChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> Tensor:
        out = torch.empty_like(q)
        lses = []
        for s, e, first in spans(q.shape[2], window):
            o, lse = _flash(q[:, :, s:e], k[:, :, first:e], v[:, :, first:e], 0.0, False,
                            attn_mask=_band(s, e, first, window), scale=scale)
            out[:, :, s:e] = o
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (s, e, first), lse in zip(spans(q.shape[2], ctx.window), lses, strict=True):
            a, b, c = _flash_backward(grad[:, :, s:e], q[:, :, s:e], k[:, :, first:e],
                                      v[:, :, first:e], out[:, :, s:e], lse, 0.0, False,
                                      attn_mask=_band(s, e, first, ctx.window), scale=ctx.scale)
            dq[:, :, s:e] = a
            dk[:, :, first:e] += b
            dv[:, :, first:e] += c
        return dq, dk, dv, None, None


def sliding_attention(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> Tensor:
    """Attention of q [B, H, T, hd] over k, v [B, H, T, hd] (as many heads: GQA expanded)
    restricted to q - window < k <= q, scores scaled by `scale`."""
    return _SlidingChunks.apply(q, k, v, window, scale)
