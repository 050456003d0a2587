"""The Olmo 3 module: names, shapes, attention windows, RoPE, GQA, init, dtypes, fused loss."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from relaytrain.model.config import FULL, PRESETS, SLIDING
from relaytrain.model.init import init_weights
from relaytrain.model.loss import lm_loss
from relaytrain.model.olmo3 import (
    Olmo3,
    RMSNorm,
    apply_rope,
    rope_cos_sin,
    sliding_window_mask,
)
from relaytrain.model.sliding_chunks import Window

torch.set_num_threads(1)
TINY = PRESETS["tiny"].with_vocab(500)  # 2 layers: sliding (window 16), full; vocab 500 -> 512


def small(**kw):
    return dataclasses.replace(TINY, **kw)


def model_of(cfg, seed=0):
    m = Olmo3(cfg)
    init_weights(m, seed)
    return m


def test_parameter_names_are_the_global_contract_names():
    names = {n for n, _ in Olmo3(TINY).named_parameters()}
    per_layer = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "attn.q_norm",
                 "attn.k_norm", "attn_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 "mlp_norm"]
    expected = {"embed.weight", "norm.weight", "lm_head.weight"} | {
        f"layers.{i}.{p}.weight" for i in range(TINY.n_layers) for p in per_layer}
    assert names == expected


def test_logits_cover_the_tokenizer_vocabulary_not_the_padding():
    m = model_of(TINY)
    assert m.embed.weight.shape[0] == m.lm_head.weight.shape[0] == 512
    logits = m(torch.randint(0, 500, (2, 20)))
    assert logits.shape == (2, 20, 500)
    logits.sum().backward()
    assert m.lm_head.weight.grad[500:].abs().max() == 0  # padded rows are inert


def test_softmax_rows_padded_takes_every_embedding_row_into_the_loss_as_olmo_core_does():
    """`softmax_rows: padded`: the logits span the padded rows too, so the loss is the
    cross-entropy over all 512 and the padded rows are trained (pushed down)."""
    ids = torch.randint(0, 500, (2, 21), generator=torch.Generator().manual_seed(3))
    padded = model_of(small(softmax_rows="padded"))
    logits = padded(ids[:, :-1])
    assert logits.shape == (2, 20, 512)
    total, ce, _ = padded(ids[:, :-1], labels=ids[:, 1:], z_loss=0.0)
    assert ce == pytest.approx(F.cross_entropy(logits.reshape(-1, 512).float(),
                                               ids[:, 1:].reshape(-1)).item(), rel=1e-6)
    total.backward()
    assert padded.lm_head.weight.grad[500:].abs().min() > 0
    tokenizer = model_of(TINY)  # the same weights (seed 0), 500 rows in the softmax
    assert tokenizer(ids[:, :-1], labels=ids[:, 1:], z_loss=0.0)[1] < ce
    with pytest.raises(ValueError, match="softmax_rows"):
        Olmo3(small(softmax_rows="all"))


def test_building_needs_a_vocabulary():
    with pytest.raises(ValueError, match="vocab_size"):
        Olmo3(PRESETS["tiny"])


def test_stage_modules_hold_only_their_part_under_global_names():
    mid = Olmo3(small(n_layers=4, layer_types=()), layers=range(1, 3), first=False, last=False)
    names = {n for n, _ in mid.named_parameters()}
    assert {n.split(".")[1] for n in names} == {"1", "2"}
    assert not any(n.startswith(("embed", "norm", "lm_head")) for n in names)
    h = torch.randn(2, 5, TINY.d_model)
    assert mid(h).shape == h.shape


# --- attention windows ------------------------------------------------------------------------

def test_sliding_window_mask_shows_exactly_the_last_w_keys():
    t, w = 11, 4
    mask = sliding_window_mask(t, w, torch.device("cpu"))
    for q in range(t):
        assert [k for k in range(t) if mask[q, k]] == list(range(max(0, q - w + 1), q + 1))


@pytest.mark.parametrize("layer_type, window", [(SLIDING, 4), (SLIDING, 100), (FULL, 4)])
def test_a_token_influences_exactly_the_queries_that_see_it(layer_type, window):
    """One-layer model: changing token k changes output q iff key k is visible to query q."""
    cfg = small(n_layers=1, layer_types=(layer_type,), sliding_window=window)
    m = model_of(cfg)
    t = 12
    x = torch.randint(2, 500, (1, t))
    base = m(x)
    for k in range(t):
        y = x.clone()
        y[0, k] = 1 if x[0, k] != 1 else 0
        changed = (m(y) - base).abs().amax(-1)[0] > 0
        last = t - 1 if layer_type == FULL else min(t - 1, k + window - 1)
        assert changed.tolist() == [k <= q <= last for q in range(t)], k


def naive_attention(attn, x, cos, sin, visible):
    """Textbook attention with explicit loops over heads: the specification of `Attention`."""
    b, t, _ = x.shape
    hd, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads

    def rms(v, norm):
        return norm.weight * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)

    q = rms(attn.q_proj(x), attn.q_norm).view(b, t, nh, hd)
    k = rms(attn.k_proj(x), attn.k_norm).view(b, t, nkv, hd)
    v = attn.v_proj(x).view(b, t, nkv, hd)
    out = torch.zeros(b, t, nh, hd)
    for h in range(nh):
        g = h // (nh // nkv)  # the kv head serving query head h
        qh = apply_rope(q[:, :, h].unsqueeze(1), cos, sin)[:, 0]
        kh = apply_rope(k[:, :, g].unsqueeze(1), cos, sin)[:, 0]
        scores = qh @ kh.transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, :, h] = scores.softmax(-1) @ v[:, :, g]
    return attn.o_proj(out.reshape(b, t, nh * hd))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_equals_the_textbook_formula_causal_and_windowed(n_kv_heads):
    cfg = small(n_kv_heads=n_kv_heads)
    attn = model_of(cfg).layers["0"].attn
    t = 24
    x = torch.randn(2, t, cfg.d_model)
    cos, sin = rope_cos_sin(cfg, False, t, x.device)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    window = sliding_window_mask(t, 5, x.device)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin, None), naive_attention(attn, x, cos, sin,
                                                                            causal))
        torch.testing.assert_close(attn(x, cos, sin, window),
                                   naive_attention(attn, x, cos, sin, window))


def test_gqa_model_trains():
    m = model_of(small(n_kv_heads=1))
    assert m.layers["0"].attn.k_proj.weight.shape == (TINY.head_dim, TINY.d_model)
    m(torch.randint(0, 500, (2, 40))).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in m.parameters())


# --- RoPE and norms ---------------------------------------------------------------------------

def test_rope_rotates_each_pair_i_i_plus_half_by_position_times_theta_power():
    cfg = TINY
    d, t = cfg.head_dim, 9
    cos, sin = rope_cos_sin(cfg, False, t, torch.device("cpu"))
    x = torch.randn(1, 1, t, d)
    y = apply_rope(x, cos, sin)
    for p in range(t):
        for i in range(d // 2):
            angle = p * cfg.rope_theta ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[0, 0, p, i].item(), x[0, 0, p, i + d // 2].item()
            assert y[0, 0, p, i].item() == pytest.approx(a * c - b * s, abs=1e-5)
            assert y[0, 0, p, i + d // 2].item() == pytest.approx(b * c + a * s, abs=1e-5)


def test_yarn_changes_only_full_attention_layers():
    yarn = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
            "beta_slow": 1}
    cfg = small(rope_scaling=yarn)
    assert [b.yarn for b in Olmo3(cfg).layers.values()] == [False, True]
    plain, scaled = (rope_cos_sin(cfg, y, 40, torch.device("cpu"))[0] for y in (False, True))
    assert not torch.equal(plain, scaled)


def test_rmsnorm_normalises_in_fp32_and_returns_the_input_dtype():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2, 8))
    x = torch.randn(3, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    xf = x.float()
    # HF Olmo3RMSNorm's formula: x * rsqrt(mean(x^2) + eps), which x / sqrt rounds differently
    ref = (norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)))
    assert norm(x).dtype == torch.bfloat16
    torch.testing.assert_close(norm(x), ref.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, weight_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16)])  # the last: FSDP2's bf16 gathers (parallel/fsdp.py)
def test_norm_and_rope_gradients_are_autograd_of_the_reference_formulas(dtype, weight_dtype):
    """The hand-written backwards of RMSNorm and RoPE against autograd through the formulas."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(16, eps=1e-6).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
    w_ref = norm.weight.detach().clone().requires_grad_()
    x = torch.randn(3, 5, 16, generator=g).to(dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    up = torch.randn(3, 5, 16, generator=g).to(dtype)
    norm(x).backward(up)
    xf = x_ref.float()
    (w_ref * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(dtype).backward(up)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    assert x.grad.dtype == dtype and norm.weight.grad.dtype == weight_dtype
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(norm.weight.grad, w_ref.grad, **tol)

    cos, sin = rope_cos_sin(TINY, False, 5, torch.device("cpu"))
    q = torch.randn(3, 2, 5, TINY.head_dim, generator=g).to(dtype).requires_grad_()
    q_ref = q.detach().clone().requires_grad_()
    up = torch.randn(q.shape, generator=g).to(dtype)
    rotated = apply_rope(q, cos, sin)
    qf = q_ref.float()
    half = TINY.head_dim // 2
    ref = (qf * cos + torch.cat((-qf[..., half:], qf[..., :half]), -1) * sin).to(dtype)
    assert torch.equal(rotated, ref)  # the forward rounds exactly as the rotate-half form
    rotated.backward(up)
    ref.backward(up)
    assert torch.equal(q.grad, q_ref.grad)


def test_runs_under_bf16_autocast_with_fp32_norm_and_rope():
    m = model_of(TINY)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(torch.randint(0, 500, (1, 40)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_forward_traces_without_graph_breaks():
    m = model_of(TINY)
    explanation = torch._dynamo.explain(m)(torch.randint(0, 500, (1, 40)))
    assert explanation.graph_break_count == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpointing, bf16", [("none", False), ("selective", True)])
def test_compiled_blocks_train_as_the_eager_model(checkpointing, bf16):
    """What CUDA runs by default (`model.compile: auto`, bf16 autocast) traced on the CPU:
    each block's forward and backward through dynamo and AOTAutograd in one graph (custom norm
    and RoPE functions, the sliding mask, checkpointing), the fused head + loss eager."""
    from torch._dynamo.utils import counters

    cfg = small(max_seq_len=48, sliding_window=16)
    eager, compiled = model_of(cfg), model_of(cfg)
    compiled.configure(checkpointing=checkpointing)
    torch._dynamo.reset()
    counters.clear()  # reset() keeps them: earlier tests' graphs would count here
    compiled.compile_blocks(backend="aot_eager")
    x = torch.randint(0, 500, (2, 49), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for m in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = m(x[:, :-1], labels=x[:, 1:], z_loss=1e-4)[0]
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for name, g in grads[0].items():
        if bf16:  # a bf16 rounding may land the other way in a few elements (seen: 5 of 32k)
            assert ((grads[1][name] - g).norm() / g.norm()).item() < 1e-4, name
        else:
            torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


# --- init -------------------------------------------------------------------------------------

def test_init_is_a_function_of_seed_and_name_only():
    cfg = small(n_layers=3, layer_types=())
    full = model_of(cfg, seed=7)
    stage = Olmo3(cfg, layers=range(1, 3), first=False, last=True)
    init_weights(stage, 7)
    full_params = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full_params[name]), name
    other = model_of(cfg, seed=8)
    assert not torch.equal(other.embed.weight, full.embed.weight)


def test_init_is_truncated_normal_with_unit_norms():
    m = model_of(TINY)
    w = m.embed.weight
    std = TINY.init_std
    assert w.abs().max() <= 3 * std and w.std().item() == pytest.approx(std, rel=0.05)
    assert F.cosine_similarity(m.lm_head.weight.flatten(), w.flatten(), dim=0).abs() < 0.05
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in m.named_parameters()
               if n.endswith("norm.weight"))


# --- the loss from the fused head --------------------------------------------------------------

def test_given_labels_the_model_returns_the_loss_of_its_logits():
    """forward(x, labels) = lm_loss(forward(x), labels) in value and in every gradient, with
    padded head rows and ignored tokens (chunking itself: tests/model/test_loss.py)."""
    m = model_of(TINY)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 500, (3, 21), generator=g)
    labels = torch.randint(0, 500, (3, 21), generator=g)
    labels[1, 5:9] = -100

    def run(fused):
        m.zero_grad(set_to_none=True)
        out = m(x, labels=labels, z_loss=1e-3) if fused else lm_loss(m(x), labels, 1e-3)
        out[0].backward()
        return [t.item() for t in out], {n: p.grad for n, p in m.named_parameters()}

    (values, grads), (ref_values, ref_grads) = run(True), run(False)
    assert values == pytest.approx(ref_values, rel=1e-6)
    for name, ref in ref_grads.items():
        assert ((grads[name] - ref).norm() / ref.norm()).item() < 1e-5, name
    assert grads["lm_head.weight"][500:].abs().max() == 0  # padded rows are inert


def test_labels_need_the_last_stage():
    first = Olmo3(TINY, layers=range(0, 1), last=False)
    with pytest.raises(ValueError, match="labels"):
        first(torch.randint(0, 500, (1, 5)), labels=torch.zeros(1, 5, dtype=torch.long))


# --- attention backends and activation checkpointing --------------------------------------------

def visible_pairs(block_mask, t):
    """The [T, T] pairs a block mask lets through: a listed tile that is full, or a listed
    partial tile where its mask_mod says yes (FlexAttention's semantics)."""
    bq, bk = block_mask.BLOCK_SIZE
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    elementwise = block_mask.mask_mod(0, 0, q, k)
    out = torch.zeros(t, t, dtype=torch.bool)
    for counts, indices, full in ((block_mask.kv_num_blocks, block_mask.kv_indices, False),
                                  (block_mask.full_kv_num_blocks,
                                   block_mask.full_kv_indices, True)):
        for i in range(counts.shape[-1]):
            for j in indices[0, 0, i, : counts[0, 0, i]].tolist():
                rows, cols = slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk)
                out[rows, cols] |= True if full else elementwise[rows, cols]
    return out


@pytest.mark.parametrize("t, window, block", [(200, 40, 16), (64, 16, 16), (100, 7, 32),
                                              (600, 300, 128), (50, 100, 128)])
def test_sliding_block_mask_lets_through_exactly_the_window(t, window, block):
    from relaytrain.model.olmo3 import sliding_block_mask

    bm = sliding_block_mask(t, window, torch.device("cpu"), block)
    assert torch.equal(visible_pairs(bm, t), sliding_window_mask(t, window, torch.device("cpu")))
    n = -(-t // block)  # tile counts only: nothing of size T x T is built
    assert bm.kv_indices.shape == bm.full_kv_indices.shape == (1, 1, n, n)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("t, window", [(48, 16), (600, 300)])
def test_flex_attention_agrees_with_the_dense_mask_path(t, window):
    """GQA (4 query heads on 2 kv heads), window < T; 600 tokens span several 128-tiles, some
    of them full. FlexAttention runs eagerly (forward only) on the CPU."""
    m = model_of(small(n_kv_heads=2, sliding_window=window, max_seq_len=t))
    x = torch.randint(0, 500, (2, t))
    outs = {}
    for backend in ("sdpa", "flex"):
        m.configure(attention=backend)
        with torch.no_grad():
            outs[backend] = m(x)
    torch.testing.assert_close(outs["flex"], outs["sdpa"], rtol=1e-5, atol=1e-5)


def test_auto_attention_is_chunks_on_the_cpu_and_sdpa_the_dense_mask():
    from torch.nn.attention.flex_attention import BlockMask

    m = model_of(TINY)
    assert m.sliding_mask(40, torch.device("cpu")) == Window(TINY.sliding_window)
    m.configure(attention="sdpa")
    assert isinstance(m.sliding_mask(40, torch.device("cpu")), torch.Tensor)
    m.configure(attention="flex")
    assert isinstance(m.sliding_mask(40, torch.device("cpu")), BlockMask)
    with pytest.raises(ValueError, match="attention"):
        m.configure(attention="flash")


def saved_bytes(fn):
    """Bytes of distinct storages autograd keeps for the backward of `fn()` (params too)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_checkpointing_policies_give_bitwise_equal_losses_and_gradients_for_less_memory():
    cfg = small(n_layers=4, layer_types=())
    m = model_of(cfg)
    x = torch.randint(0, 500, (2, 41), generator=torch.Generator().manual_seed(1))
    results = {}
    for policy in ("none", "selective", "full"):
        m.configure(checkpointing=policy)
        m.zero_grad(set_to_none=True)
        out, saved = saved_bytes(lambda: m(x[:, :-1], labels=x[:, 1:], z_loss=1e-3))
        out[0].backward()
        results[policy] = ([v.item() for v in out], {n: p.grad.clone()
                                                     for n, p in m.named_parameters()}, saved)
    assert [b.checkpoint for b in m.layers.values()] == [True] * 4
    m.configure(checkpointing="selective")
    assert [b.checkpoint for b in m.layers.values()] == [True, False, True, False]
    losses, grads, _ = results["none"]
    for policy in ("selective", "full"):
        assert results[policy][0] == losses
        assert all(torch.equal(results[policy][1][n], g) for n, g in grads.items()), policy
    assert results["none"][2] > results["selective"][2] > results["full"][2]


def test_a_checkpointed_block_compiles_as_one_graph():
    m = model_of(TINY)
    m.configure(checkpointing="full")
    t = 40
    h = torch.randn(2, t, TINY.d_model, requires_grad=True)
    cos, sin = rope_cos_sin(TINY, False, t, h.device)
    explanation = torch._dynamo.explain(m.layers["0"])(h, cos, sin, m.sliding_mask(t, h.device))
    assert explanation.graph_break_count == 0
