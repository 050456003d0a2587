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
sum = hi_sum * 2^-30 + lo_sum * 2^-60. Overflow is detected: a micro-batch gradient element
above 2^32 / (micro-batches) would overflow the int64 sum, so the step is reported as
overflowed (like a NaN) instead of silently wrapping.

Packed: the two sums travel and accumulate in one int64, hi_sum * 2^S + lo_sum with
S = 30 + bits(M) (M the global batch's micro-batches, bits(M) = M.bit_length()): lo_sum is
at most M * 2^30 < 2^S, so the two fields never carry into each other and decode back to the
very same integers (hi_sum = P >> S, lo_sum = P mod 2^S). That holds while |hi_sum| stays
below 2^(63 - S), which every value below `pack_bound(M)` = 2^(3 - 2 bits(M)) in magnitude
guarantees (M such values sum below 2^(33 - bits(M)) * 2^-30). So only such values are summed
packed; the others (rare: gradients are mostly far smaller) go into two limbs' sums of their
parameter, which the packed sums are added to at the end, the same integers again. The packed
sums travel in bucketed all-reduces, the last with, in its tail, the overflow flag and which
parameters hold two-limb sums on any rank (a second all-reduce carries those). So the
accumulator and the all-reduce take 8 bytes a parameter instead of 16 (fast mode: 4), and the
fold is one pass over the gradient and the accumulator: a fused CPU kernel
(model/cpu_kernels.cpp) where it builds, on CUDA torch's ops compiled into one kernel
(`compiled_fold`: inductor's Triton) where that builds, torch's ops as they are otherwise (the
same integers every way). Within `GradReducer.overlapping` (the unpipelined step,
train/step.py) each parameter's gradient folds as soon as autograd has accumulated it, still in
cache, and is dropped, instead of in one pass over every gradient after the backward; and, told
how many backwards the step runs, in the last one each bucket's all-reduce starts as soon as its
sums are final (`_seal`), under the rest of the backward. ReduceStats counts the time and
bytes; `relaytrain bench dp-scaling` measures the cost.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from relaytrain.model import cpu_kernels

_SHIFT = float(2**30)
_INV_HI = 2.0**-30
_INV_LO = 2.0**-60
BUCKET_VALUES = 2**19  # packed sums an all-reduce bucket holds, about (4 MiB)


@dataclass
class ReduceStats:
    """What one step's reduction cost: seconds folding gradients into the accumulator and
    converting the sums back (exact; fast: copying gradients into and out of the flat buffer),
    seconds in collectives, and bytes of the tensors reduced (the wire's payload; 0 alone), for
    `params` parameter values."""

    params: int = 0
    fold_s: float = 0.0
    comm_s: float = 0.0
    wire_bytes: int = 0


class GradReducer:
    """Sums the gradients of all micro-batches of a global batch over the DP group into .grad.

    The loss of each micro-batch is pre-scaled by 1 / (micro-batches in the global batch), so the
    sum is the global mean gradient. `fused`: fold with the CPU kernel (default: where it
    applies and builds). Exact mode all-reduces the packed sums in buckets of about
    `bucket_values` values (`buckets`), each as soon as its sums are final.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None,
                 exact: bool, total_micro_batches: int, fused: bool | None = None,
                 bucket_values: int = BUCKET_VALUES):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.exact = exact
        self.limit = overflow_limit(total_micro_batches)
        self.shift = pack_shift(total_micro_batches)
        self.bound = pack_bound(total_micro_batches)
        self.numel = sum(p.numel() for p in self.params)
        # the accumulator: the flags (overflow, then one a parameter: two limbs' sums on some
        # rank), then each parameter's packed slice; flags first, so that they travel in the
        # tail of the last bucket (the one holding parameter 0)
        self._flags = slice(0, 1 + len(self.params))
        ends = list(itertools.accumulate((p.numel() for p in self.params),
                                         initial=self._flags.stop))
        self._slices = [slice(a, b) for a, b in itertools.pairwise(ends)]
        self._buckets = buckets([p.numel() for p in self.params], bucket_values)
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        on_cpu = bool(self.params) and self.params[0].device.type == "cpu"
        self.fused = (exact and on_cpu and fold_kernel_builds()) if fused is None else fused
        self.overflow = False
        self.stats = ReduceStats(self.numel)
        self._acc: torch.Tensor | None = None  # the flags, then packed sums, one int64 a value
        self._fresh: list[bool] = []  # no micro-batch folded into the parameter's slice yet
        self._folded: list[bool] = []  # the parameter's gradient folded in this micro-batch
        # parameter index -> the [2, n] limbs' sums of its values the packed sums left out
        self._wide: dict[int, torch.Tensor] = {}
        self._left: int | None = None  # backwards to come this global batch, where known
        self._final: list[bool] = []  # the parameter's packed sum is final (last fold done)
        self._waiting: list[int] = []  # per bucket: its parameters whose sums are not final
        self._sealed = 0  # buckets sealed so far, in order
        self._works: list[dist.Work] = []  # the sealed buckets' all-reduces in flight

    def start(self) -> None:
        """Begin a global batch."""
        self.overflow = False
        self.stats = ReduceStats(self.numel)
        for p in self.params:
            p.grad = None
        if self.exact:
            if self._acc is None:
                self._acc = torch.empty(self._flags.stop + self.numel, dtype=torch.int64,
                                        device=self.params[0].device)
            self._fresh = [True] * len(self.params)  # the first fold writes over the slice
            self._folded = [False] * len(self.params)
            self._wide = {}
            self._left = None
            self._final = [False] * len(self.params)
            self._waiting = [len(members) for members in self._buckets]
            self._sealed = 0
            self._works = []

    @contextlib.contextmanager
    def overlapping(self, micro_batches: int | None = None) -> Iterator[None]:
        """Within (exact mode): each parameter's micro-batch gradient is folded the moment
        autograd has accumulated it (a post-accumulate-grad hook), while it is hot in cache, and
        dropped, so the rest of the backward can reuse its memory; `after_backward` then folds
        only gradients set otherwise (by hand). The same integers: each gradient is folded
        once, whole. A parameter whose gradient autograd accumulates twice in one micro-batch
        (two backward calls, reentrant checkpointing) would sum as two folds, not the fold of
        one float sum, and raises instead. Given the `micro_batches` (backwards) this rank
        runs, the last one's backward also starts each bucket's all-reduce once every
        parameter of the bucket (and of the buckets before it) has had its last fold."""
        if not self.exact:
            yield
            return
        self._left = micro_batches
        handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                   for i, p in enumerate(self.params)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _on_grad(self, i: int, p: nn.Parameter) -> None:
        t0 = time.perf_counter()
        self._fold(i, p.grad)
        p.grad = None
        self.stats.fold_s += time.perf_counter() - t0
        if self._left == 1:  # the last backward: parameter i's sum is final
            self._finalize([i])

    def after_backward(self) -> None:
        """Fold this micro-batch's gradient into the integer accumulator (exact mode), parameter
        by parameter, one pass each over its gradient and its slice of the accumulator (no
        float64 copy or temporaries: page-faulting those in afresh at every micro-batch
        dominated the fold's time, docs/MEASURED.md)."""
        if not self.exact:
            return
        t0 = time.perf_counter()
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._fold(i, p.grad)
            p.grad = None
        self._folded = [False] * len(self.params)
        self.stats.fold_s += time.perf_counter() - t0
        if self._left is not None:
            self._left -= 1
            if self._left == 0:  # the last backward: every sum is final
                self._finalize(range(len(self.params)))

    def _fold(self, i: int, g: torch.Tensor) -> None:
        """Parameter i's gradient `g` into its packed slice; its values at or above the packing
        bound (rare) into the parameter's two limbs' sums."""
        if self._folded[i] or self._final[i]:
            raise RuntimeError(
                f"exact mode: parameter {i}'s gradient was accumulated twice in one "
                "micro-batch's backward, which the overlapped fold cannot sum bit-exactly; "
                "run one backward a micro-batch (non-reentrant checkpointing)")
        left = fold_packed(g, self._acc[self._slices[i]], self.shift, self.bound,
                           self._fresh[i], self.fused)
        self._fresh[i] = False
        self._folded[i] = True
        if left == 0:
            return
        hi, lo, over = rest_limbs(g, self.bound, self.limit)
        self.overflow |= over
        wide = self._widen(i)
        wide[0] += hi
        wide[1] += lo

    def _widen(self, i: int) -> torch.Tensor:
        """Parameter i's two limbs' sums, zeros at first."""
        if i not in self._wide:
            self._wide[i] = torch.zeros((2, self._slices[i].stop - self._slices[i].start),
                                        dtype=torch.int64, device=self._acc.device)
        return self._wide[i]

    def _finalize(self, params: Iterable[int]) -> None:
        """Mark these parameters' sums final; seal, in order, every bucket whose sums all are."""
        for i in params:
            if not self._final[i]:
                self._final[i] = True
                self._waiting[self._bucket_of[i]] -= 1
        while self._sealed < len(self._buckets) and self._waiting[self._sealed] == 0:
            self._seal(self._sealed)
            self._sealed += 1

    def _seal(self, b: int) -> None:
        """Bucket b's sums are final: a parameter no micro-batch folded into sums to zero; the
        last bucket carries the flags (every fold is done by then); its all-reduce starts
        (every rank seals the same buckets in the same order, so the collectives pair up)."""
        members = self._buckets[b]
        for i in members:
            if self._fresh[i]:
                self._acc[self._slices[i]].zero_()
                self._fresh[i] = False
        last = b == len(self._buckets) - 1
        if last:
            flags = self._acc[self._flags]
            flags.zero_()
            flags[0] = int(self.overflow)
            flags[[1 + i for i in self._wide]] = 1
        if self.world > 1:
            t0 = time.perf_counter()
            start = self._flags.start if last else self._slices[min(members)].start
            part = self._acc[start:self._slices[max(members)].stop]
            self._works.append(dist.all_reduce(part, group=self.group, async_op=True))
            self.stats.wire_bytes += part.nbytes
            self.stats.comm_s += time.perf_counter() - t0

    def finish(self) -> bool:
        """All-reduce and write the global mean gradient into .grad; False on overflow."""
        if self.exact:
            self._finish_exact()
        elif self.world > 1:
            t0 = time.perf_counter()
            flat = torch.cat([_grad_or_zeros(p).reshape(-1) for p in self.params])
            t1 = time.perf_counter()
            dist.all_reduce(flat, group=self.group)
            t2 = time.perf_counter()
            _scatter(flat, self.params)
            self.stats.fold_s += (t1 - t0) + (time.perf_counter() - t2)
            self.stats.comm_s += t2 - t1
            self.stats.wire_bytes += flat.nbytes
        return not self.overflow

    def _finish_exact(self) -> None:
        assert self._acc is not None
        self._finalize(range(len(self.params)))  # those not sealed yet (no overlap: all)
        if self.world > 1:
            self._agree()
        t0 = time.perf_counter()
        for i, p in enumerate(self.params):
            packed = self._acc[self._slices[i]]
            if i in self._wide:
                limbs = self._wide[i] + torch.stack(unpack(packed, self.shift))
                p.grad = from_limbs(limbs[0], limbs[1]).view_as(p).to(p.dtype)
            else:
                p.grad = unpack_float(packed, self.shift, p.dtype, self.fused).view_as(p)
        self.stats.fold_s += time.perf_counter() - t0

    def _agree(self) -> None:
        """Wait for the buckets' all-reduces; read the summed flags (the overflow, which
        parameters have two limbs' sums on any rank) and all-reduce those limbs' sums."""
        t0 = time.perf_counter()
        for work in self._works:
            work.wait()
        agreed = self._acc[self._flags].tolist()
        self.overflow = agreed[0] > 0
        wide = [i for i in range(len(self.params)) if agreed[1 + i] > 0]
        if wide:
            limbs = torch.cat([self._widen(i) for i in wide], dim=1)
            dist.all_reduce(limbs, group=self.group)
            self.stats.wire_bytes += limbs.nbytes
            for i, part in zip(wide, limbs.split([self._wide[i].shape[1] for i in wide], dim=1),
                               strict=True):
                self._wide[i] = part
        self.stats.comm_s += time.perf_counter() - t0

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradient to `max_norm` by its global norm (returned)."""
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)


def buckets(sizes: list[int], values: int) -> list[list[int]]:
    """The parameters (indices into `sizes`, their value counts) in all-reduce buckets: in
    reverse order, the order the backward makes their gradients, each bucket closed once it
    holds `values` values or more; each bucket is consecutive parameters, so one slice of the
    accumulator."""
    out: list[list[int]] = []
    size = values
    for i in reversed(range(len(sizes))):
        if size >= values:
            out.append([])
            size = 0
        out[-1].append(i)
        size += sizes[i]
    return out


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


def rest_limbs(g: torch.Tensor, bound: float,
               limit: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The limbs (hi, lo) of `g`'s values the packed sums leave out (at or above `bound` in
    magnitude, or not finite; the others as 0), and whether any overflows `limit` (then all are
    clamped: `to_limbs`)."""
    rest = torch.where(g.abs() < bound, 0.0, g)
    over = exceeds([rest], limit)
    hi, lo = to_limbs(rest, limit, over)
    return hi, lo, over


def from_limbs(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float64 value of summed limbs."""
    return hi.double().mul_(_INV_HI).add_(lo.double().mul_(_INV_LO))


def pack_shift(total_micro_batches: int) -> int:
    """S of the packed sums hi_sum * 2^S + lo_sum (module docstring)."""
    return 30 + max(1, total_micro_batches).bit_length()


def pack_bound(total_micro_batches: int) -> float:
    """The magnitude below which a value's limbs are summed packed (module docstring); 0
    (nothing packs) for 2^16 micro-batches or more, where 2^(63 - S) leaves no room."""
    bits = max(1, total_micro_batches).bit_length()
    return 2.0 ** (3 - 2 * bits) if bits <= 16 else 0.0


@functools.cache
def fold_kernel_builds() -> bool:
    """Whether the fused CPU fold (model/cpu_kernels.cpp) is loaded here (built once per host
    where it is not: model/cpu_kernels.py)."""
    return cpu_kernels.unavailable() is None


def fold_packed(g: torch.Tensor, acc: torch.Tensor, shift: int, bound: float, assign: bool,
                fused: bool) -> int:
    """Add (`assign`: write) the packed limbs of `g`'s values below `bound` in magnitude into
    `acc` (int64, one slot a value); the others' slots take nothing (`assign`: 0). Returns how
    many values were left out. `fused`: the CPU kernel's one pass, where it takes `g` (fp32);
    on CUDA the compiled fold (`compiled_fold`) where it builds; torch's ops otherwise, to the
    same integers."""
    if fused and g.dtype == torch.float32:
        return torch.ops.relaytrain_cpu.fold_packed_(g.contiguous(), acc, shift, bound, assign)
    if g.device.type == "cuda" and (fold := compiled_fold()) is not None:
        try:
            return int(fold(g, acc, shift, bound, assign))
        except Exception as e:  # inductor or Triton could not build it here: today's ops
            _no_compiled_fold(e)
    return int(fold_ops(g, acc, shift, bound, assign))


def fold_ops(g: torch.Tensor, acc: torch.Tensor, shift: int, bound: float,
             assign: bool) -> torch.Tensor:
    """`fold_packed` in torch's ops (the count left out as a tensor): run as they are, or
    lowered by torch.compile into one kernel (`compiled_fold`)."""
    small = g.abs() < bound  # NaN: False
    hi, lo = to_limbs(torch.where(small, g, 0.0), 0.0, False)
    packed = hi.bitwise_left_shift_(shift).add_(lo)
    if assign:
        acc.copy_(packed)
    else:
        acc.add_(packed)
    return g.numel() - small.sum()


_compile_failed: list[str] = []  # why the compiled fold is not used here, once it failed


@functools.cache
def compiled_fold() -> Callable[..., torch.Tensor] | None:
    """`fold_ops` compiled by torch.compile for any length, as the GPU's fold: inductor fuses
    it (on the CPU into one C++ kernel: a loop counting the values left out, a loop folding;
    Triton on CUDA), without the float64 temporaries of torch's ops (37 bytes a value); None
    where torch.compile is unavailable or has failed here before (today's ops then)."""
    if _compile_failed or not hasattr(torch, "compile"):
        return None
    return torch.compile(fold_ops, dynamic=True, fullgraph=True)


def _no_compiled_fold(e: Exception) -> None:
    _compile_failed.append(f"{type(e).__name__}: {e}")
    compiled_fold.cache_clear()
    warnings.warn(f"exact mode: the compiled gradient fold failed ({_compile_failed[0][:200]}); "
                  "folding with torch's ops (the same integers, slower)", stacklevel=3)


def unpack(packed: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (hi_sum, lo_sum) limbs' sums a packed sum holds, the very same integers."""
    return packed.bitwise_right_shift(shift), packed.bitwise_and((1 << shift) - 1)


def unpack_float(packed: torch.Tensor, shift: int, dtype: torch.dtype,
                 fused: bool) -> torch.Tensor:
    """`from_limbs(*unpack(packed, shift))` in `dtype`: the fused CPU kernel's one pass where it
    applies (float32 out)."""
    if fused and dtype == torch.float32 and packed.device.type == "cpu":
        return torch.ops.relaytrain_cpu.unpack_float(packed, shift)
    return from_limbs(*unpack(packed, shift)).to(dtype)


def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _scatter(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset: offset + n].view_as(p).to(p.dtype).clone()
        offset += n
