"""Gradient reduction over the data-parallel group, in two modes.

`fast`: gradients accumulate in `.grad` in float32 and one flat all-reduce sums them across
ranks. Float addition is not associative, so the result depends on how micro-batches are split
over ranks: equal across world sizes only within float noise.

`exact`: every micro-batch's gradient is converted to fixed point and summed as integers.
Integer addition is associative and commutative, so the sum is the same whatever the split over
ranks and whatever order the all-reduce uses: the loss curve and weights are bit-identical for
any data-parallel size. Each float32 value g is split into two int64 limbs,
hi = floor(g * 2^30) and lo = round((g * 2^30 - hi) * 2^30), which keep every bit of g down to
2^-60 (a float32 gradient has 24 significant bits, so only values below ~1e-18 lose anything).
The limbs are summed separately (no carries needed) and recombined in float64 once:
sum = hi_sum * 2^-30 + lo_sum * 2^-60. The cost is a few elementwise passes per micro-batch and
an all-reduce of 4x the bytes of float32 (`relaytrain bench dp-scaling` measures it). Overflow
is detected: a micro-batch gradient element above 2^32 / (micro-batches) would overflow the
int64 sum, so the step is reported as overflowed (like a NaN) instead of silently wrapping.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

_SHIFT = float(2**30)
_INV_HI = 2.0**-30
_INV_LO = 2.0**-60


class GradReducer:
    """Sums the gradients of all micro-batches of a global batch over the DP group into .grad.

    The loss of each micro-batch is pre-scaled by 1 / (micro-batches in the global batch), so the
    sum is the global mean gradient.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None,
                 exact: bool, total_micro_batches: int):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.exact = exact
        self.limit = overflow_limit(total_micro_batches)
        self.numel = sum(p.numel() for p in self.params)
        self._offsets = [0, *itertools.accumulate(p.numel() for p in self.params)][:-1]
        self.overflow = False
        self._acc: torch.Tensor | None = None

    def start(self) -> None:
        """Begin a global batch."""
        self.overflow = False
        for p in self.params:
            p.grad = None
        if self.exact:
            device = self.params[0].device
            if self._acc is None:
                self._acc = torch.zeros(2 * self.numel, dtype=torch.int64, device=device)
            else:
                self._acc.zero_()

    def after_backward(self) -> None:
        """Fold this micro-batch's gradient into the integer accumulator (exact mode).

        Parameter by parameter and in place, the same arithmetic as on one flat float64 copy of
        the whole gradient, without that copy and its temporaries, which were page-faulted in
        afresh at every micro-batch and dominated the fold's time (docs/MEASURED.md)."""
        if not self.exact:
            return
        assert self._acc is not None
        grads = [(p.grad, off) for p, off in zip(self.params, self._offsets, strict=True)
                 if p.grad is not None]
        over = exceeds([g for g, _ in grads], self.limit)
        self.overflow |= over
        hi_acc, lo_acc = self._acc[: self.numel], self._acc[self.numel:]
        for g, off in grads:
            hi, lo = to_limbs(g, self.limit, over)
            n = hi.numel()
            hi_acc[off: off + n] += hi
            lo_acc[off: off + n] += lo
        for p in self.params:
            p.grad = None

    def finish(self) -> bool:
        """All-reduce and write the global mean gradient into .grad; False on overflow."""
        world = dist.get_world_size(self.group) if self.group is not None else 1
        if self.exact:
            assert self._acc is not None
            if world > 1:
                self.overflow = any_rank(self.overflow, self.group, self._acc.device)
                dist.all_reduce(self._acc, group=self.group)
            hi_acc, lo_acc = self._acc[: self.numel], self._acc[self.numel:]
            for p, off in zip(self.params, self._offsets, strict=True):
                limbs = slice(off, off + p.numel())
                p.grad = from_limbs(hi_acc[limbs], lo_acc[limbs]).view_as(p).to(p.dtype)
        elif world > 1:
            flat = torch.cat([_grad_or_zeros(p).reshape(-1) for p in self.params])
            dist.all_reduce(flat, group=self.group)
            _scatter(flat, self.params)
        return not self.overflow

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradient to `max_norm` by its global norm (returned)."""
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)


def overflow_limit(total_micro_batches: int) -> float:
    """The largest micro-batch gradient value whose sum over the global batch cannot overflow
    the int64 hi limb (values are scaled by 2^30)."""
    return float(2**32) / max(1, total_micro_batches)


def any_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether `flag` is set on any rank of `group` (a collective)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return bool(t.item())


def exceeds(grads: list[torch.Tensor], limit: float) -> bool:
    """Whether any value is non-finite or above `limit` in magnitude. NaN propagates through
    amax and NaN < limit is False: one pass and one device sync find both (in float64: the
    limit rounds in float32)."""
    peaks = [g.abs().amax().double() for g in grads]
    return bool(peaks) and not bool((torch.stack(peaks) < limit).all())


def to_limbs(g: torch.Tensor, limit: float, clamp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`g`'s values, flattened, as int64 limbs (hi, lo) (see the module docstring). With
    `clamp` (an overflowed micro-batch: its step is skipped) non-finite values become 0 and the
    others are clamped to +-`limit`, so the integer sums stay defined."""
    x = g.reshape(-1).to(torch.float64, copy=True)  # worked on in place below
    if clamp:
        x = torch.nan_to_num_(x, nan=0.0, posinf=0.0, neginf=0.0).clamp_(-limit, limit)
    x.mul_(_SHIFT)
    hi = torch.floor(x)
    lo = x.sub_(hi).mul_(_SHIFT).round_()
    return hi.to(torch.int64), lo.to(torch.int64)


def from_limbs(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float64 value of summed limbs."""
    return hi.double().mul_(_INV_HI).add_(lo.double().mul_(_INV_LO))


def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _scatter(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset: offset + n].view_as(p).to(p.dtype).clone()
        offset += n
