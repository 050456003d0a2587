"""lm_loss: fp32 cross-entropy plus z-loss, both means over the non-ignored tokens."""

import math

import pytest
import torch

from relaytrain.train.loss import lm_loss


def reference(logits, labels, z_loss, ignore_index=-100):
    """The definition, one token at a time, in float64."""
    ce, z, n = 0.0, 0.0, 0
    for row, y in zip(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1),
                      strict=True):
        if y == ignore_index:
            continue
        lse = math.log(sum(math.exp(v) for v in row.tolist()))
        ce += lse - row[y].item()
        z += lse**2
        n += 1
    return ce / n, z_loss * z / n


def test_ce_and_z_loss_follow_the_definition_skipping_ignored_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, 1] = labels[1, 4] = -100
    total, ce, z = lm_loss(logits, labels, z_loss=1e-2)
    ref_ce, ref_z = reference(logits, labels, 1e-2)
    assert ce.item() == pytest.approx(ref_ce, rel=1e-5)
    assert z.item() == pytest.approx(ref_z, rel=1e-5)
    assert total.item() == pytest.approx(ref_ce + ref_z, rel=1e-5)


def test_total_carries_the_gradient_and_the_parts_are_reports():
    logits = torch.randn(3, 7, requires_grad=True)
    total, ce, z = lm_loss(logits, torch.tensor([1, 2, 3]), z_loss=1e-4)
    assert total.requires_grad and not ce.requires_grad and not z.requires_grad
    total.backward()
    assert logits.grad is not None


def test_custom_ignore_index_and_all_ignored_give_zero_not_nan():
    logits = torch.randn(4, 6)
    total, ce, z = lm_loss(logits, torch.tensor([0, 5, 5, 2]), 1e-3, ignore_index=5)
    ref_ce, ref_z = reference(logits, torch.tensor([0, 5, 5, 2]), 1e-3, ignore_index=5)
    assert ce.item() == pytest.approx(ref_ce, rel=1e-5) and z.item() == pytest.approx(ref_z)
    total, ce, z = lm_loss(logits, torch.full((4,), -100), 1e-3)
    assert total.item() == ce.item() == z.item() == 0.0


def test_bf16_logits_are_scored_in_fp32():
    logits = torch.randn(8, 50).bfloat16()
    labels = torch.randint(0, 50, (8,))
    total, ce, _ = lm_loss(logits, labels, 0.0)
    assert total.dtype == torch.float32
    assert ce.item() == pytest.approx(reference(logits.float(), labels, 0.0)[0], rel=1e-6)
