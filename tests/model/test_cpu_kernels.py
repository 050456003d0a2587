"""The fused CPU kernels (`model.kernels`): SwiGLU and RoPE round exactly as torch's ops they
replace, RMSNorm and the sliding-window attention agree to float rounding, no result depends on
the thread count, the build is the host's, and `auto` falls back to torch's ops where the
kernels cannot be built."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from relaytrain.model import cpu_kernels
from relaytrain.model.config import PRESETS
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import MLP, Attention, Olmo3, RMSNorm, _RMSNormFunction, apply_rope
from relaytrain.model.sliding_chunks import Window

torch.set_num_threads(2)
CPU = torch.device("cpu")
built = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                           reason=f"no fused CPU kernels here: {cpu_kernels.unavailable()}")


def grads_of(fn, *inputs, grad):
    """fn's output and the gradients of its inputs for the output gradient `grad`."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [x.grad for x in leaves]


@built
def test_swiglu_rounds_exactly_as_silu_times_up():
    """Bit for bit where torch's kernels run vectorised throughout (every model width is a
    multiple of 32 floats); a ragged tail, which torch computes with scalar code, to rounding."""
    gen = torch.Generator().manual_seed(0)
    for width, exact in ((64, True), (37, False)):
        gate, up, g = (torch.randn(3, 5, width, generator=gen) * 4 for _ in range(3))
        out, (dg, du) = grads_of(cpu_kernels.swiglu, gate, up, grad=g)
        ref, (rg, ru) = grads_of(lambda a, b: F.silu(a) * b, gate, up, grad=g)
        if exact:
            assert torch.equal(out, ref) and torch.equal(dg, rg) and torch.equal(du, ru)
        for a, b in ((out, ref), (dg, rg), (du, ru)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@built
@pytest.mark.parametrize("layout", ["heads first", "tokens first"])
def test_rope_rounds_exactly_as_the_rotate_half_form_in_either_layout(layout):
    """Attention rotates [B, H, T, hd] views of a [B, T, H, hd] projection ("tokens first");
    the result keeps x's layout."""
    gen = torch.Generator().manual_seed(1)
    b, h, t, hd = 2, 3, 7, 40  # half = 20: one vector of 16 and a tail of 4
    x = torch.randn(b, h, t, hd, generator=gen)
    if layout == "tokens first":
        x = torch.randn(b, t, h, hd, generator=gen).transpose(1, 2)
    cos, sin = torch.randn(t, hd, generator=gen), torch.randn(t, hd, generator=gen)
    g = torch.randn(b, h, t, hd, generator=gen)
    out = cpu_kernels.rope(x, cos, sin)
    assert out.stride() == x.stride()
    fused, (dx,) = grads_of(lambda v: cpu_kernels.rope(v, cos, sin), x, grad=g)
    ref, (rx,) = grads_of(lambda v: apply_rope(v, cos, sin), x, grad=g)
    assert torch.equal(fused, ref) and torch.equal(dx, rx)


@built
def test_rms_norm_agrees_with_torch_to_float_rounding():
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(5, 9, 37, generator=gen) * 3, torch.randn(5, 9, 37, generator=gen)
    w = torch.rand(37, generator=gen) + 0.5
    out, (dx, dw) = grads_of(lambda a, b: cpu_kernels.rms_norm(a, b, 1e-6), x, w, grad=g)
    ref, (rx, rw) = grads_of(lambda a, b: _RMSNormFunction.apply(a, b, 1e-6), x, w, grad=g)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rw, rtol=1e-5, atol=1e-4)


def window_reference(q, k, v, window, scale):
    """Dense-masked attention in float64, kv heads repeated for their query heads."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - window),
                                          scale=scale)


@built
@pytest.mark.parametrize(("t", "window", "heads", "kv_heads"), [
    (70, 5, 2, 2), (70, 40, 4, 2), (33, 100, 2, 1), (64, 1, 2, 2), (257, 64, 2, 2),
    (70, 40, 10, 2)])  # the last: five query heads to a kv head, as olmo3-32b
@pytest.mark.parametrize("layout", ["heads first", "tokens first"])
def test_window_attention_equals_the_dense_mask_forward_and_backward(t, window, heads,
                                                                     kv_heads, layout):
    """Windows shorter and longer than the sequence (causal), of one key, query heads sharing
    kv heads, a length that is no multiple of the kernel's chunk or tile; the projections'
    layout ("tokens first") or contiguous heads. Gradients flow to the kv heads shared."""
    gen = torch.Generator().manual_seed(t + window)

    def make(h):
        if layout == "tokens first":
            return torch.randn(2, t, h, 64, generator=gen).transpose(1, 2)
        return torch.randn(2, h, t, 64, generator=gen)
    q, k, v, g = make(heads), make(kv_heads), make(kv_heads), make(heads)
    out, grads = grads_of(lambda a, b, c: cpu_kernels.window_attention(a, b, c, window, 0.125),
                          q, k, v, grad=g)
    ref, ref_grads = grads_of(lambda a, b, c: window_reference(a, b, c, window, 0.125),
                              q, k, v, grad=g.double())
    for a, b in ((out, ref), *zip(grads, ref_grads, strict=True)):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@built
def test_a_fused_sliding_layer_runs_the_window_kernel_and_trains_as_the_chunks(monkeypatch):
    """Head dims of 64 (the kernel's multiple), two query heads on one kv head, a window
    shorter than the sequence; the chunks (torch's ops) give the same losses and gradients."""
    cfg = dataclasses.replace(PRESETS["tiny"].with_vocab(300), d_model=128, n_heads=2,
                              n_kv_heads=1, head_dim=64)
    calls = []
    kernel = cpu_kernels.window_attention
    monkeypatch.setattr(cpu_kernels, "window_attention", lambda *a: calls.append(a[3])
                        or kernel(*a))
    x = torch.randint(0, 300, (2, 50), generator=torch.Generator().manual_seed(5))
    loss, grads = {}, {}
    for kernels in ("torch", "fused"):
        model = Olmo3(cfg)
        init_weights(model, 0)
        model.configure(attention="chunks", kernels=kernels)
        assert all(m.window_kernel == (kernels == "fused") for m in model.modules()
                   if isinstance(m, Attention))
        loss[kernels] = model(x[:, :-1], labels=x[:, 1:])[0]
        loss[kernels].backward()
        grads[kernels] = {n: p.grad for n, p in model.named_parameters()}
    assert calls == [cfg.sliding_window]  # the one sliding layer, fused only
    assert cfg.sliding_window < x.shape[1] - 1
    torch.testing.assert_close(loss["fused"], loss["torch"], rtol=1e-6, atol=1e-6)
    for name, g in grads["torch"].items():
        torch.testing.assert_close(grads["fused"][name], g, rtol=1e-4, atol=1e-6)


@built
def test_no_result_depends_on_the_thread_count():
    """RMSNorm's weight gradient sums 200 rows: fixed blocks of rows, then the blocks in order,
    whichever thread ran each; attention's key gradients sum over queries and query heads
    within one (batch, kv head)."""
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(200, 64, generator=gen), torch.randn(200, 64, generator=gen)
    w = torch.rand(64, generator=gen)
    gate, up, q = (torch.randn(40, 1000, generator=gen) for _ in range(3))
    aq, ak, av, ag = (torch.randn(2, h, 100, 64, generator=gen) for h in (4, 2, 2, 4))

    def run():
        return [*grads_of(lambda a, b: cpu_kernels.rms_norm(a, b, 1e-6), x, w, grad=g)[1],
                *grads_of(cpu_kernels.swiglu, gate, up, grad=q)[1],
                *grads_of(lambda a, b, c: cpu_kernels.window_attention(a, b, c, 30, 0.125),
                          aq, ak, av, grad=ag)[1]]

    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(2)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@built
def test_a_fused_model_trains_as_the_torch_one_to_float_rounding():
    cfg = PRESETS["tiny"].with_vocab(300)
    losses, weights = {}, {}
    for kernels in ("torch", "fused"):
        model = Olmo3(cfg)
        init_weights(model, 0)
        model.configure(kernels=kernels)
        assert all(m.fused == (kernels == "fused") for m in model.modules()
                   if isinstance(m, RMSNorm | MLP | Attention))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(4)
        losses[kernels] = []
        for _ in range(3):
            x = torch.randint(0, 300, (2, 33), generator=gen)
            loss = model(x[:, :-1], labels=x[:, 1:])[0]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[kernels].append(loss.item())
        weights[kernels] = dict(model.named_parameters())
    assert losses["fused"] == pytest.approx(losses["torch"], abs=1e-5)
    for name, w in weights["torch"].items():
        torch.testing.assert_close(weights["fused"][name], w, rtol=1e-4, atol=1e-5)
    # The kernels did run: RMSNorm's last bits differ.
    assert any(not torch.equal(weights["fused"][n], w) for n, w in weights["torch"].items())


@built
def test_auto_is_fused_on_the_cpu_and_never_inside_compiled_blocks_or_autocast():
    """Nor are sliding layers attended in chunks in compiled blocks."""
    model = Olmo3(PRESETS["tiny"].with_vocab(300))
    model.configure(kernels="auto")
    assert model.fused
    assert isinstance(model.sliding_mask(40, CPU), Window)
    model.compile_blocks(backend="eager")
    assert not any(m.fused for m in model.layers.modules()
                   if isinstance(m, RMSNorm | MLP | Attention))
    assert isinstance(model.sliding_mask(40, CPU), torch.Tensor)  # the dense mask to trace
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_kernels.cpu_fp32(x)
    assert cpu_kernels.cpu_fp32(x) and not cpu_kernels.cpu_fp32(x.double())


def test_torch_is_never_fused_and_fused_is_refused_off_the_cpu():
    assert not cpu_kernels.resolve("torch", CPU)
    assert not cpu_kernels.resolve("auto", torch.device("cuda"))
    with pytest.raises(ValueError, match="kernels='fused' runs on the CPU only"):
        cpu_kernels.resolve("fused", torch.device("cuda"))
    with pytest.raises(ValueError, match="expected one of"):
        cpu_kernels.resolve("triton", CPU)


def test_where_the_kernels_cannot_be_built_auto_falls_back_and_fused_says_why(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda: "CalledProcessError: no c++")
    with pytest.warns(UserWarning, match=r"auto: .*\(CalledProcessError: no c\+\+\); running "
                                         "torch's ops"):
        assert not cpu_kernels.resolve("auto", CPU)
    with pytest.raises(ValueError, match=r"cannot be built here \(CalledProcessError: no c\+\+\)"):
        cpu_kernels.resolve("fused", CPU)


def _load_in_a_new_process(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "from relaytrain.model import cpu_kernels; print(cpu_kernels.unavailable())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


@built
@pytest.mark.timeout(150)
def test_a_new_process_loads_the_hosts_build_without_compiling():
    assert (cpu_kernels.build_dir() / "built").exists()
    r = _load_in_a_new_process({})
    assert r.stdout.strip() == "None" and "compiling" not in r.stderr


@pytest.mark.timeout(150)
def test_a_failed_build_is_reported_and_leaves_no_build_behind(tmp_path):
    r = _load_in_a_new_process({"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false"})
    assert r.returncode == 0 and r.stdout.strip() != "None"
    assert "Error" in r.stdout  # the reason, on one line
    assert not list(tmp_path.glob("*/built"))
