"""A training step in exact mode: the gradient folded during the backward, as autograd makes each
parameter's, trains to the very bits of the fold after each micro-batch's backward."""

from __future__ import annotations

import contextlib

import pytest
import torch

from relaytrain.config import load_config
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3
from relaytrain.parallel.reduce import GradReducer
from relaytrain.train.optim import build_optimizer
from relaytrain.train.step import train_step

pytestmark = pytest.mark.timeout(60)
VOCAB = 64


def _train(checkpointing: str, overlap: bool, steps: int = 3) -> tuple[list, dict]:
    """Every step's losses and gradient norm, and the weights after `steps` exact steps of four
    micro-batches; `overlap` False keeps every gradient for `after_backward`'s fold."""
    torch.manual_seed(0)
    cfg = load_config(None, ["model.preset=tiny", "model.attention=sdpa",
                             f"model.checkpointing={checkpointing}"])
    model = Olmo3(cfg.model_config(VOCAB))
    init_weights(model, 0)
    model.configure(cfg.model.attention, cfg.model.checkpointing, cfg.model.matmul,
                    cfg.model.kernels)
    opt = build_optimizer(model, cfg.optim)
    red = GradReducer(list(model.parameters()), None, exact=True, total_micro_batches=4)
    if not overlap:
        red.overlapping = contextlib.nullcontext
    gen = torch.Generator().manual_seed(1)
    curve = []
    for _ in range(steps):
        mbs = [(j, torch.randint(0, VOCAB, (2, 17), generator=gen)) for j in range(4)]
        out = train_step(model, opt, red, mbs, 4, 1e-4, 1.0, torch.device("cpu"))
        assert out.finite and out.reduction.fold_s > 0
        curve.append((out.losses, out.grad_norm))
    return curve, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_fold_during_the_backward_trains_to_the_bits_of_the_fold_after_it(checkpointing):
    """With and without activation checkpointing (whose recompute runs inside the backward):
    the same losses, gradient norms and weights, to the bit."""
    curve, weights = _train(checkpointing, overlap=True)
    want_curve, want_weights = _train(checkpointing, overlap=False)
    assert curve == want_curve
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[n], want_weights[n]) for n in weights)
