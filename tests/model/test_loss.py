"""lm_loss and the fused lm_head_loss: fp32 cross-entropy plus z-loss, both means over the
non-ignored tokens."""

import math

import pytest
import torch

from relaytrain.model import cpu_kernels
from relaytrain.model.loss import lm_head_loss, lm_loss


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


@pytest.mark.parametrize("padded", [False, True])
def test_gradient_equals_autograd_of_the_unfused_loss(padded):
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(2, 9, 40 if padded else 37, generator=g) * 4).requires_grad_()
    labels = torch.randint(0, 37, (2, 9), generator=g)
    labels[1, :3] = -100
    ref_leaf = full.detach().clone().requires_grad_()
    logits = full[..., :37] * 1.0  # a non-leaf, non-contiguous when padded (as the model's)
    before = logits.detach().clone()
    total, _, _ = lm_loss(logits, labels, 1e-2)
    (0.5 * total).backward()
    ref = unfused(ref_leaf[..., :37], labels, 1e-2)
    (0.5 * ref).backward()
    assert total.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(full.grad, ref_leaf.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(logits.detach(), before)  # the caller's logits are left alone


# --- lm_head_loss: the LM head fused with the loss, chunk by chunk ----------------------------

def head_case(n=18, d=16, v=40, n_logits=37, seed=3):
    """Hidden states [n, d] (two sequences), a head [v, d] whose rows past n_logits are padding,
    labels with ignored tokens."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n // 2, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.5
    labels = torch.randint(0, n_logits, (2, n // 2), generator=g)
    labels[0, :2] = labels[1, -1] = -100
    return h, w, labels


def head_and_grads(fn, h, w):
    """fn(h, w) -> (total, ce, z): values, and the gradients of 0.5 * total to h and w."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    total, ce, z = fn(h, w)
    (0.5 * total).backward()
    return (total.item(), ce.item(), z.item()), h.grad, w.grad


def rel_diff(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("chunk", [4, 5, 18, 64])  # divides 18, does not, one chunk, > N
@pytest.mark.parametrize("softmax", ["torch", pytest.param("kernels", marks=pytest.mark.skipif(
    cpu_kernels.unavailable() is not None, reason="no fused CPU kernels here"))])
def test_fused_head_loss_equals_the_loss_of_the_logits(z_loss, padded, chunk, softmax):
    """The softmax through torch's ops or the fused CPU kernels (`model.kernels`), over 37
    logits a row (two vectors and a ragged tail of floats)."""
    h, w, labels = head_case(v=40 if padded else 37)
    unfused_values, unfused_h, unfused_w = head_and_grads(
        lambda h, w: lm_loss(h @ w[:37].t(), labels, z_loss), h, w)
    values, grad_h, grad_w = head_and_grads(
        lambda h, w: lm_head_loss(h, w, labels, z_loss, n_logits=37, chunk=chunk,
                                  fused=softmax == "kernels"), h, w)
    assert values == pytest.approx(unfused_values, rel=1e-6, abs=1e-9)
    assert (values[2] == 0.0) == (z_loss == 0.0)
    assert grad_h.shape == h.shape and grad_w.shape == w.shape
    assert rel_diff(grad_h, unfused_h) < 1e-6 and rel_diff(grad_w, unfused_w) < 1e-6
    assert torch.equal(grad_w[37:], torch.zeros_like(grad_w[37:]))  # padding: no gradient
    assert torch.all(grad_h[0, :2] == 0.0)  # ignored tokens' predictions get no gradient


def test_fused_head_loss_is_bit_identical_across_runs_and_padding_never_matters():
    h, w, labels = head_case(n=60, v=40)

    def run(w):
        return head_and_grads(lambda h, w: lm_head_loss(h, w, labels, 1e-3, 37, chunk=7), h, w)

    a, b = run(w), run(w)
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    w2 = w.clone()
    w2[37:] = 1e4  # any values in the padded rows: same loss and gradients, bit for bit
    c = run(w2)
    assert a[0] == c[0] and torch.equal(a[1], c[1]) and torch.equal(a[2], c[2])


def test_fused_head_loss_without_grad_computes_only_the_values():
    h, w, labels = head_case()
    with_grad = lm_head_loss(h.requires_grad_(), w, labels, 1e-2, 37)
    with torch.no_grad():
        total, ce, z = lm_head_loss(h, w, labels, 1e-2, 37)
    assert not total.requires_grad and total.item() == with_grad[0].item()
    assert (ce.item(), z.item()) == (with_grad[1].item(), with_grad[2].item())


def test_fused_head_loss_custom_ignore_index_and_all_ignored():
    h, w, labels = head_case()
    labels = labels.clamp(min=0)
    labels[0, 3:] = 7
    ref = lm_loss(h @ w[:37].t(), labels, 1e-3, ignore_index=7)
    got = lm_head_loss(h, w, labels, 1e-3, 37, ignore_index=7)
    assert [t.item() for t in got] == pytest.approx([t.item() for t in ref], rel=1e-6)
    values, grad_h, grad_w = head_and_grads(
        lambda h, w: lm_head_loss(h, w, torch.full((2, 9), -100), 1e-3, 37), h, w)
    assert values == (0.0, 0.0, 0.0)
    assert not grad_h.any() and not grad_w.any()


def test_fused_head_loss_under_bf16_autocast_runs_the_head_in_bf16():
    """The GPU path, on the CPU: bf16 matmuls, fp32 softmax, grad W summed in fp32."""
    h, w, labels = head_case(n=40, d=32, v=40)
    ref_values, ref_h, ref_w = head_and_grads(
        lambda h, w: lm_loss(h.bfloat16() @ w[:37].bfloat16().t(), labels, 1e-2), h, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values, grad_h, grad_w = head_and_grads(
            lambda h, w: lm_head_loss(h, w, labels, 1e-2, 37, chunk=6), h, w)
    assert grad_h.dtype == grad_w.dtype == torch.float32  # the dtypes of h and w
    assert values == pytest.approx(ref_values, rel=1e-5)  # the same bf16 logits, fp32 after
    assert rel_diff(grad_h, ref_h) < 1e-2 and rel_diff(grad_w, ref_w) < 1e-2
    assert torch.equal(grad_w[37:], torch.zeros_like(grad_w[37:]))


@pytest.mark.parametrize("fused", [False, True])
def test_a_second_backward_through_a_retained_graph_fails_loudly(fused):
    h, w, labels = head_case()
    w.requires_grad_()
    total = (lm_head_loss(h, w, labels, 1e-3, 37) if fused
             else lm_loss(h @ w[:37].t(), labels, 1e-3))[0]
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()


def test_fused_head_loss_rejects_a_bad_chunk_or_head_shape():
    h, w, labels = head_case()
    with pytest.raises(ValueError, match="chunk=0"):
        lm_head_loss(h, w, labels, 0.0, 37, chunk=0)
    with pytest.raises(ValueError, match="n_logits=41"):
        lm_head_loss(h, w, labels, 0.0, 41)
