"""The exact gradient reduction: integer fixed-point sums that do not depend on order."""

import torch
from torch import nn

from relaytrain.parallel.reduce import GradReducer


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
