"""The exact gradient reduction: integer fixed-point sums that do not depend on order, packed
two limbs to an int64 where the values allow, folded by a fused kernel to today's integers,
during the backward as each gradient is made or after it."""

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from relaytrain.parallel.reduce import (
    GradReducer,
    buckets,
    compiled_fold,
    exceeds,
    fold_kernel_builds,
    fold_packed,
    from_limbs,
    overflow_limit,
    pack_bound,
    pack_shift,
    to_limbs,
    unpack,
    unpack_float,
)


def _grads(m: int, shape=(7, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes: float32 addition of these is visibly order-dependent.
    return [torch.randn(shape, generator=g) * 10.0 ** torch.randint(-8, 3, shape, generator=g)
            for _ in range(m)]


def _reduce(grads, order, exact):
    p = nn.Parameter(torch.zeros_like(grads[0]))
    red = GradReducer([p], group=None, exact=exact, total_micro_batches=len(grads))
    red.start()
    for i in order:
        if p.grad is None:
            p.grad = grads[i].clone()
        else:
            p.grad += grads[i]
        red.after_backward()
    assert red.finish()
    return p.grad.clone()


def test_exact_sum_is_bit_identical_for_any_order():
    grads = _grads(12)
    base = _reduce(grads, range(12), exact=True)
    for perm_seed in range(5):
        order = torch.randperm(12, generator=torch.Generator().manual_seed(perm_seed)).tolist()
        assert torch.equal(_reduce(grads, order, exact=True), base)


def test_float_sum_does_depend_on_order_so_exact_mode_is_needed():
    grads = _grads(12)
    outs = {_reduce(grads, torch.randperm(12, generator=torch.Generator().manual_seed(s))
                    .tolist(), exact=False).numpy().tobytes() for s in range(5)}
    assert len(outs) > 1


def test_exact_sum_matches_the_float64_sum_to_float32_rounding():
    grads = _grads(8)
    exact = _reduce(grads, range(8), exact=True)
    ref = torch.stack([g.double() for g in grads]).sum(0)
    assert torch.allclose(exact.double(), ref, rtol=1e-6, atol=1e-17)


def test_overflow_and_non_finite_are_reported_not_wrapped():
    big = [torch.full((3,), 2.0**40), torch.ones(3)]
    p = nn.Parameter(torch.zeros(3))
    red = GradReducer([p], group=None, exact=True, total_micro_batches=2)
    red.start()
    for g in big:
        p.grad = g.clone()
        red.after_backward()
    assert not red.finish()
    red.start()
    p.grad = torch.tensor([float("nan"), 0.0, 0.0])
    red.after_backward()
    assert not red.finish()


def test_each_parameter_reduces_as_if_alone_and_one_without_a_gradient_gets_zeros():
    shapes = [(7, 5), (3,), (4, 2, 2)]
    per_param = [_grads(6, shape, seed=i) for i, shape in enumerate(shapes)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    unused = nn.Parameter(torch.zeros(2, 2))  # never receives a gradient
    red = GradReducer([params[0], unused, *params[1:]], group=None, exact=True,
                      total_micro_batches=6)
    red.start()
    for k in range(6):
        for p, grads in zip(params, per_param, strict=True):
            p.grad = grads[k].clone()
        red.after_backward()
    assert red.finish()
    for p, grads in zip(params, per_param, strict=True):
        assert torch.equal(p.grad, _reduce(grads, range(6), exact=True))
    assert torch.equal(unused.grad, torch.zeros(2, 2))


def test_a_non_finite_value_in_any_parameter_is_reported():
    for bad in (float("nan"), float("inf")):
        a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
        red = GradReducer([a, b], group=None, exact=True, total_micro_batches=1)
        red.start()
        a.grad, b.grad = torch.ones(3), torch.tensor([0.0, bad, 0.0])
        red.after_backward()
        assert not red.finish()


def test_the_overflow_limit_is_exact_not_rounded_to_float32():
    # 2^32 / 25 = 171798691.84; float32 rounds it down to 171798688, a value that is in range.
    p = nn.Parameter(torch.zeros(1))
    red = GradReducer([p], group=None, exact=True, total_micro_batches=25)
    red.start()
    p.grad = torch.tensor([171798688.0])
    red.after_backward()
    assert red.finish()
    assert p.grad.item() == 171798688.0


def _awkward_values(m: int, n: int = 40_000, seed: int = 0) -> list[torch.Tensor]:
    """`m` micro-batches' gradients of `n` values: random magnitudes from 1e-30 to 1e2 of both
    signs, and in every micro-batch zeros of both signs, subnormals, ties of the low limb's
    rounding (odd multiples of 2^-61), values at and beside the packing bound, at the overflow
    limit and just below it."""
    g = torch.Generator().manual_seed(seed)
    bound, limit = pack_bound(m), overflow_limit(m)
    below = lambda x: torch.nextafter(torch.tensor(x), torch.tensor(0.0)).item()  # noqa: E731
    at = torch.tensor(limit).item()  # float32 rounds the limit: the least value not below it
    at = at if at >= limit else torch.nextafter(torch.tensor(at), torch.tensor(2 * at)).item()
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 2.0**-126,
                            3 * 2.0**-61, 5 * 2.0**-61, -5 * 2.0**-61, 7 * 2.0**-61,
                            2.0**-31 + 2.0**-61,
                            bound, -bound, below(bound), -below(bound), at, -at,
                            below(limit), -below(limit)], dtype=torch.float32)
    out = []
    for _ in range(m):
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 3, (n,), generator=g)
        x[torch.randperm(n, generator=g)[: len(special)]] = special
        out.append(x)
    return out


def _todays_sums(grads: list[torch.Tensor], m: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The limbs' sums and overflow of the fold before packing (every value as two limbs)."""
    limit, hi_sum, lo_sum, over = overflow_limit(m), 0, 0, False
    for g in grads:
        o = exceeds([g], limit)
        hi, lo = to_limbs(g, limit, o)
        hi_sum, lo_sum, over = hi_sum + hi, lo_sum + lo, over or o
    return hi_sum, lo_sum, over


def _fused_modes() -> list[bool]:
    return [False, True] if fold_kernel_builds() else [False]


def test_the_fold_packs_today_s_limbs_into_the_very_same_integers():
    """The packed sums decode to the limbs' sums bit for bit (the fused kernel and torch's ops
    alike), and only values at or above the bound are left out, NaN among them."""
    m = 4
    grads = _awkward_values(m)
    grads[2][5] = float("nan")
    bound, shift = pack_bound(m), pack_shift(m)
    small = [torch.where(g.abs() < bound, g, 0.0) for g in grads]
    hi_sum, lo_sum, _ = _todays_sums(small, m)
    for fused in _fused_modes():
        acc = torch.full((grads[0].numel(),), 12345, dtype=torch.int64)  # garbage: assigned
        left = [fold_packed(g, acc, shift, bound, k == 0, fused) for k, g in enumerate(grads)]
        assert left == [int((g.abs() >= bound).sum()) + int(g.isnan().sum()) for g in grads]
        hi, lo = unpack(acc, shift)
        assert torch.equal(hi, hi_sum) and torch.equal(lo, lo_sum), fused
        assert torch.equal(unpack_float(acc, shift, torch.float32, fused),
                           from_limbs(hi_sum, lo_sum).float())


@pytest.mark.parametrize("m", [1, 3, 4, 25])
def test_the_reducer_gives_today_s_gradient_and_overflow_bit_for_bit(m):
    """Packed where the values allow, two limbs for the parameters where not: the gradient is
    today's to the bit, and so is the overflow verdict (values at the limit overflow)."""
    grads = _awkward_values(m, seed=m)
    for fused in _fused_modes():
        packed = [g.where(g.abs() < pack_bound(m), 0.0) for g in grads]
        for gs in (packed, grads):  # all packed; then some wide and some at the limit
            hi_sum, lo_sum, over = _todays_sums(gs, m)
            p = nn.Parameter(torch.zeros(gs[0].shape))
            red = GradReducer([p], None, exact=True, total_micro_batches=m, fused=fused)
            red.start()
            for g in gs:
                p.grad = g.clone()
                red.after_backward()
            assert red.finish() == (not over)
            assert torch.equal(p.grad, from_limbs(hi_sum, lo_sum).float()), fused
            assert red._wide == {} if gs is packed else over


# 2**16 - 1 folds 65,535 micro-batches one call at a time (a minute): on demand
@pytest.mark.parametrize("m", [1, 3, 7, 8, 2**10 - 1,
                               pytest.param(2**16 - 1, marks=pytest.mark.soak)])
def test_packed_sums_at_the_extremes_of_the_bound_stay_exact(m):
    """Every micro-batch at the largest value that packs, of either sign, or at the tiniest
    negative one (whose low limb is the largest): the packed sums neither overflow nor carry
    between their fields."""
    top = torch.nextafter(torch.tensor(pack_bound(m)), torch.tensor(0.0)).item()
    grads = [torch.tensor([top, -top, -(2.0**-61), -(2.0**-149), 0.0])] * m
    hi_sum, lo_sum, over = _todays_sums(grads, m)
    assert not over
    for fused in _fused_modes():
        acc = torch.zeros(5, dtype=torch.int64)
        assert all(fold_packed(g, acc, pack_shift(m), pack_bound(m), False, fused) == 0
                   for g in grads)
        hi, lo = unpack(acc, pack_shift(m))
        assert torch.equal(hi, hi_sum) and torch.equal(lo, lo_sum), fused
        assert torch.equal(unpack_float(acc, pack_shift(m), torch.float32, fused),
                           from_limbs(hi_sum, lo_sum).float()), fused


def _reduce_by_autograd(grads: dict[str, list[torch.Tensor]], m: int, fused: bool,
                        overlap: bool) -> tuple[bool, dict[str, torch.Tensor]]:
    """The reducer's result for parameters whose micro-batch k gradient autograd makes as
    `grads[name][k]` exactly (the gradient of sum(p * g) is g times 1), folded during the
    backward (`overlap`) or after it."""
    params = {n: nn.Parameter(torch.zeros(gs[0].shape)) for n, gs in grads.items()}
    red = GradReducer(list(params.values()), None, exact=True, total_micro_batches=m,
                      fused=fused)
    red.start()
    with red.overlapping() if overlap else contextlib.nullcontext():
        for k in range(m):
            sum((p * grads[n][k]).sum() for n, p in params.items()).backward()
            assert all((p.grad is None) == overlap for p in params.values())  # folded, dropped
            red.after_backward()
    return red.finish(), {n: p.grad for n, p in params.items()}


@pytest.mark.parametrize("m", [1, 3, 4, 25])
def test_the_overlapped_fold_gives_today_s_gradient_and_overflow_bit_for_bit(m):
    """Each gradient folded by a hook as autograd accumulates it gives the gradient of the fold
    after the backward, and today's limbs' sum, to the bit: for a parameter whose values all
    pack and for one with zeros, subnormals, wide values and values at the overflow limit."""
    awkward = _awkward_values(m, seed=m)
    grads = {"packed": [g.where(g.abs() < pack_bound(m), 0.0) for g in awkward],
             "awkward": awkward}
    want = {n: from_limbs(*_todays_sums(gs, m)[:2]).float() for n, gs in grads.items()}
    over = _todays_sums(awkward, m)[2]
    for fused in _fused_modes():
        for overlap in (True, False):
            ok, got = _reduce_by_autograd(grads, m, fused, overlap)
            assert ok == (not over), (fused, overlap)
            assert all(torch.equal(got[n], want[n]) for n in grads), (fused, overlap)


def test_buckets_are_consecutive_parameters_in_backward_order_closed_at_the_size():
    """Each bucket is one slice of the accumulator, filled from the last parameter (whose
    gradient the backward makes first), closed once it holds the size or more."""
    assert buckets([5, 1, 2, 3, 4], 4) == [[4], [3, 2], [1, 0]]
    assert buckets([5, 1, 2], 100) == [[2, 1, 0]]
    assert buckets([2, 2], 1) == [[1], [0]]


def test_a_gradient_accumulated_twice_in_one_micro_batch_is_refused_not_folded_in_parts():
    """Two backward calls into one micro-batch's gradient would fold as two parts, not as their
    float sum: the overlapped fold raises; outside `overlapping` nothing is hooked."""
    p = nn.Parameter(torch.zeros(3))
    red = GradReducer([p], None, exact=True, total_micro_batches=2)
    red.start()
    with red.overlapping():
        (p * 2.0).sum().backward()
        with pytest.raises(RuntimeError, match="accumulated twice in one micro-batch"):
            (p * 3.0).sum().backward()
    p.grad = None
    (p * 2.0).sum().backward()
    assert torch.equal(p.grad, torch.full((3,), 2.0))  # left for after_backward, not folded


def _mixed_ranks(rank: int, world: int, port: int) -> None:
    """Rank r's micro-batches; parameter `b` gets a value above the packing bound on the last
    rank only, so every rank must reduce it as two limbs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = 6
    shapes = {"a": (300,), "b": (7, 11), "unused": (4,)}

    def grads_of(k: int) -> dict[str, torch.Tensor]:  # global micro-batch k's gradients
        gen = torch.Generator().manual_seed(k)
        out = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()
               if n != "unused"}
        if k == m - 1:
            out["b"][3, 4] = 3.0
        return out

    def reduce(group: dist.ProcessGroup | None, ks: list[int], fused: bool) -> dict:
        params = {n: nn.Parameter(torch.zeros(s)) for n, s in shapes.items()}
        red = GradReducer(list(params.values()), group, exact=True, total_micro_batches=m,
                          fused=fused)
        red.start()
        for k in ks:
            for n, g in grads_of(k).items():
                params[n].grad = g
            red.after_backward()
        assert red.finish()
        return {n: p.grad for n, p in params.items()}, red

    def overlapped(ks: list[int], fused: bool) -> dict:
        """Folded by autograd's hooks, every parameter its own bucket (`unused` first, so its
        bucket, the last, with the flags in its tail, waits for `after_backward`)."""
        params = {n: nn.Parameter(torch.zeros(shapes[n])) for n in ("unused", "a", "b")}
        red = GradReducer(list(params.values()), dist.group.WORLD, exact=True,
                          total_micro_batches=m, fused=fused, bucket_values=1)
        red.start()
        with red.overlapping(len(ks)):
            for k in ks:
                sum((params[n] * g).sum() for n, g in grads_of(k).items()).backward()
                assert red._sealed == (2 if k == ks[-1] else 0)  # b's, a's: in the backward
                red.after_backward()
        assert red._sealed == 3 and len(red._works) == 3
        assert red.finish()
        return {n: p.grad for n, p in params.items()}

    for fused in _fused_modes():
        alone, _ = reduce(None, list(range(m)), fused)
        mine, red = reduce(dist.group.WORLD, list(range(rank, m, world)), fused)
        assert all(torch.equal(mine[n], alone[n]) for n in shapes)
        assert 1 in red._wide and 0 not in red._wide  # b went wide everywhere, a did not
        assert red.stats.wire_bytes == 8 * (1 + 3) + 8 * 381 + 16 * 77
        early = overlapped(list(range(rank, m, world)), fused)
        assert all(torch.equal(early[n], alone[n]) for n in shapes)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_on_which_parameters_go_wide_and_sum_as_one_rank(world):
    """On real gloo ranks: packed sums, a parameter wide on one rank only reduced as two limbs on
    all, an unused one as zeros; the gradient that of one rank folding every micro-batch, and
    8 bytes a packed value on the wire, 16 a wide one. The same bits when each bucket's
    all-reduce starts within the last backward, as soon as its last fold is done."""
    mp.spawn(_mixed_ranks, args=(world, _free_port()), nprocs=world)


@pytest.mark.timeout(240)
def test_the_compiled_fold_packs_today_s_limbs_into_the_very_same_integers():
    """The fold torch.compile lowers into one kernel (CUDA's; compiled here by inductor's C++
    backend, 17-45 s on this host's first compile) gives the packed sums of today's limbs bit
    for bit, assigned then added, and the same count left out, NaN among them."""
    fold = compiled_fold()
    if fold is None:
        pytest.skip("torch.compile is unavailable here")
    m = 4
    bound, shift = pack_bound(m), pack_shift(m)
    grads = _awkward_values(m, 40_001)
    grads[1][7] = float("nan")
    small = [torch.where(g.abs() < bound, g, 0.0) for g in grads]
    hi_sum, lo_sum, _ = _todays_sums(small, m)
    acc = torch.full((grads[0].numel(),), 12345, dtype=torch.int64)  # garbage: assigned
    left = [int(fold(g, acc, shift, bound, k == 0)) for k, g in enumerate(grads)]
    assert left == [int((g.abs() >= bound).sum()) + int(g.isnan().sum()) for g in grads]
    hi, lo = unpack(acc, shift)
    assert torch.equal(hi, hi_sum) and torch.equal(lo, lo_sum)
