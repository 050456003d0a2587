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


def unfused(logits, labels, z_loss, ignore_index=-100):
    """The textbook composition the fused function replaces: cross_entropy + logsumexp."""
    import torch.nn.functional as F

    flat, labels = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
    valid = labels != ignore_index
    count = valid.sum().clamp(min=1)
    ce = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum") / count
    lse = torch.logsumexp(flat, dim=-1)
    return ce + z_loss * torch.where(valid, lse.square(), 0.0).sum() / count


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_gradient_equals_autograd_of_the_unfused_loss(overwrite, padded):
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(2, 9, 40 if padded else 37, generator=g) * 4).requires_grad_()
    labels = torch.randint(0, 37, (2, 9), generator=g)
    labels[1, :3] = -100
    ref_leaf = full.detach().clone().requires_grad_()
    logits = full[..., :37] * 1.0  # a non-leaf, non-contiguous when padded (as the model's)
    before = logits.detach().clone()
    total, _, _ = lm_loss(logits, labels, 1e-2, overwrite_logits=overwrite)
    (0.5 * total).backward()
    ref = unfused(ref_leaf[..., :37], labels, 1e-2)
    (0.5 * ref).backward()
    assert total.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(full.grad, ref_leaf.grad, rtol=1e-5, atol=1e-7)
    if not overwrite:
        assert torch.equal(logits.detach(), before)  # the caller's logits are left alone


def test_overwriting_gives_the_same_bits_and_a_second_backward_fails_loudly():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(16, 50, generator=g)
    labels = torch.randint(0, 50, (16,), generator=g)
    out = {}
    for overwrite in (False, True):
        x = base.clone().requires_grad_()
        total, ce, z = lm_loss(x * 1.0, labels, 1e-3, overwrite_logits=overwrite)
        total.backward(retain_graph=True)
        out[overwrite] = (total.item(), ce.item(), z.item(), x.grad.clone())
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            total.backward()
    assert out[False][:3] == out[True][:3] and torch.equal(out[False][3], out[True][3])
