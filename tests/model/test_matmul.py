"""The GEMM backends (`model.matmul`): oneDNN computes the same products as torch's own GEMM to
float rounding, reproducibly (whatever the thread count or memory alignment), and anything it
does not cover falls back to torch's path unchanged."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import relaytrain.model.matmul as matmul_module
from relaytrain.config import load_config
from relaytrain.errors import ConfigError
from relaytrain.model.backend_choice import choose_matmul
from relaytrain.model.config import PRESETS
from relaytrain.model.init import init_weights
from relaytrain.model.loss import lm_head_loss, lm_loss
from relaytrain.model.matmul import (
    Linear,
    add_weight_grad,
    deferred_backward,
    deferring,
    linear,
    mm_t,
    onednn_available,
    weight_grad,
)
from relaytrain.model.olmo3 import Olmo3

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# (tokens, in, out): both orientations of the weight gradient, and the head's shape
SHAPES = [(96, 32, 80), (96, 80, 32), (64, 16, 512), (7, 5, 3)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def test_the_config_key_is_checked():
    assert load_config(None, ["run_dir=x"]).model.matmul == "auto"
    assert load_config(None, ["run_dir=x", "model.matmul=onednn"]).model.matmul == "onednn"
    with pytest.raises(ConfigError, match="'model.matmul'.*'onednn'"):
        load_config(None, ["run_dir=x", "model.matmul=mkl"])
    with pytest.raises(ConfigError, match="'model.matmul': got 'onednn' with train.device=cuda"):
        load_config(None, ["run_dir=x", "model.matmul=onednn", "train.device=cuda"])


def test_onednn_asked_of_a_torch_without_it_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no oneDNN"):
        load_config(None, ["run_dir=x", "model.matmul=onednn"])
    assert load_config(None, ["run_dir=x"]).model.matmul == "auto"  # auto falls back instead
    assert choose_matmul("auto", PRESETS["tiny"].with_vocab(64), CPU, 1).backend == "aten"


@needs_onednn
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_a_linear_layer_through_onednn_is_torchs_to_float_rounding(m, k, n):
    gen = torch.Generator().manual_seed(m * k * n)
    x = torch.randn(2, m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    up = torch.randn(2, m, n, generator=gen)
    outs = {}
    for backend in ("aten", "onednn"):
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = linear(xb, wb, backend)
        # autograd.grad, as the pipeline runtime takes them: no AccumulateGrad to fix layouts
        outs[backend] = (y.detach(), *torch.autograd.grad(y, (xb, wb), up))
    for got, ref in zip(outs["onednn"], outs["aten"], strict=True):
        assert got.shape == ref.shape and got.is_contiguous()  # fused AdamW reads it flat
        assert rel_err(got, ref) < 1e-5


@needs_onednn
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_onednn_products_do_not_depend_on_threads_or_alignment(m, k, n):
    """What bit-identical resumes and exact mode's DP invariance rest on."""
    gen = torch.Generator().manual_seed(1)
    x, w, g = (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen),
               torch.randn(m, n, generator=gen))

    def products(x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        return [mm_t(x, w, "onednn"), mm_t(g, w.t(), "onednn"), weight_grad(g, x, "onednn")]

    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            runs.append(products(x, g))
    finally:
        torch.set_num_threads(threads)
    # The same values at storage offsets that break every vector alignment.
    xo = torch.empty(x.numel() + 3)[3:].view_as(x).copy_(x)
    go = torch.empty(g.numel() + 1)[1:].view_as(g).copy_(g)
    runs.append(products(xo, go))
    for run in runs[1:]:
        for a, b in zip(run, runs[0], strict=True):
            assert torch.equal(a, b)


class Products(TorchDispatchMode):
    """Counts the matrix products run while entered (aten's or oneDNN's)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name().split(".")[0] in ("aten::mm", "relaytrain::onednn_mm_t"):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["aten", pytest.param("onednn", marks=needs_onednn)])
def test_chunked_weight_gradients_sum_to_the_whole_product(backend):
    gen = torch.Generator().manual_seed(2)
    g, x = torch.randn(50, 300, generator=gen), torch.randn(50, 24, generator=gen)
    total = None
    for s in range(0, 50, 16):
        total = add_weight_grad(total, g[s:s + 16], x[s:s + 16], backend, torch.float32)
    assert total.shape == (300, 24)
    assert rel_err(total, g.t() @ x) < 1e-5


@pytest.mark.parametrize("backend", ["aten", pytest.param("onednn", marks=needs_onednn)])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_a_deferred_weight_gradient_is_autograds_bit_for_bit(backend, m, k, n):
    """Under `deferring` the backward gives the input gradient only (one product: the weight's
    is not formed there) and leaves the weight's to `DeferredGrad.weight_grad`: both are what
    one whole backward gives, to the bit (zb-h1's W relies on it); outside it, nothing is
    recorded."""
    gen = torch.Generator().manual_seed(3)
    layer = Linear(k, n)
    layer.matmul = backend
    x = torch.randn(2, m, k, generator=gen, requires_grad=True)
    g = torch.randn(2, m, n, generator=gen)
    layer(x).backward(g)
    want_w, want_x = layer.weight.grad, x.grad
    layer.weight.grad = x.grad = None
    with deferring(records := []):
        y = layer(x)
    with Products() as products:
        (got_x,) = deferred_backward(y, [x], g, records)
    assert products.count == 1
    assert layer.weight.grad is None and len(records) == 1
    assert torch.equal(got_x, want_x)
    assert torch.equal(records[0].weight_grad(), want_w)
    with deferring(None):
        layer(x)
    assert len(records) == 1


def test_a_checkpointed_block_defers_nothing():
    """A checkpointed block's recompute must run the forward's ops, so its linear layers keep
    their weights in the graph under `deferring` (their gradients come with the backward); the
    others' are deferred, and together the gradients are a plain backward's, to the bit."""
    cfg = PRESETS["tiny"].with_vocab(64)
    model = Olmo3(cfg)
    init_weights(model, 0)
    model.configure(checkpointing="selective")  # block 0 checkpointed, block 1 not
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    model(tokens[:, :-1], labels=tokens[:, 1:])[0].backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with deferring(records := []):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])[0]
    deferred = {d.layer for d in records}
    rest = [p for p in model.parameters() if p not in {d.layer.weight for d in records}]
    for p, g in zip(rest, deferred_backward(loss, rest, None, records), strict=True):
        p.grad = g
    assert deferred == {m for m in model.layers["1"].modules() if isinstance(m, Linear)}
    for d in records:
        d.layer.weight.grad = d.weight_grad()
    assert all(torch.equal(p.grad, want[n]) for n, p in model.named_parameters())


def test_what_onednn_does_not_cover_goes_through_torch_unchanged():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 8, 16, generator=gen), torch.randn(12, 16, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear(xb, wb, "onednn"), F.linear(xb, wb))  # not fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides the dtype
        assert torch.equal(linear(x, w, "onednn"), F.linear(x, w))
    assert torch.equal(linear(x, w, "aten"), F.linear(x, w))


def model_pair() -> tuple[Olmo3, Olmo3]:
    cfg = PRESETS["tiny"].with_vocab(300)  # padded to 384: the head's padding rows
    models = []
    for matmul in ("aten", "onednn"):
        m = Olmo3(cfg)
        init_weights(m, 0)
        m.configure(matmul=matmul)
        models.append(m)
    return models[0], models[1]


@needs_onednn
def test_configure_sets_every_product_and_names_stay_the_same():
    aten, onednn = model_pair()
    linears = [m for m in onednn.modules() if isinstance(m, Linear)]
    assert len(linears) == 7 * onednn.cfg.n_layers + 1  # q k v o gate up down, and the head
    assert {m.matmul for m in linears} == {"onednn"} and onednn.matmul == "onednn"
    assert list(onednn.state_dict()) == list(aten.state_dict())
    with pytest.raises(ValueError, match="matmul"):
        onednn.configure(matmul="mkl")


@needs_onednn
def test_training_losses_and_gradients_match_the_aten_model(monkeypatch):
    aten, onednn = model_pair()
    x = torch.randint(0, 300, (2, 49), generator=torch.Generator().manual_seed(4))
    calls = []
    inner = matmul_module._inner
    monkeypatch.setattr(matmul_module, "_inner", lambda a, b: calls.append(1) or inner(a, b))
    losses, products = [], []
    for m in (aten, onednn):
        total, ce, z = m(x[:, :-1], labels=x[:, 1:], z_loss=1e-4)
        total.backward()
        losses.append(ce.item())
        products.append(len(calls))
    # Every product went through oneDNN, and none of the aten model's: 3 per linear layer
    # (forward, input and weight gradients) and per head chunk (one chunk here).
    assert products == [0, 3 * (7 * onednn.cfg.n_layers + 1)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    grads = dict(aten.named_parameters())
    for name, p in onednn.named_parameters():
        assert p.grad.is_contiguous(), name
        assert rel_err(p.grad, grads[name].grad) < 1e-4, name
    assert torch.count_nonzero(onednn.lm_head.weight.grad[300:]) == 0  # padded rows inert


@needs_onednn
@pytest.mark.parametrize("n_logits", [50, 64])  # with padded rows, and without
def test_the_fused_head_through_onednn_is_the_loss_on_whole_logits(n_logits):
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(37, 16, generator=gen, requires_grad=True)
    w = torch.randn(64, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, n_logits, (37,), generator=gen)
    labels[3] = -100
    total, ce, z = lm_head_loss(h, w, labels, 1e-3, n_logits=n_logits, chunk=8,
                                matmul="onednn")
    grad_h, grad_w = torch.autograd.grad(total, (h, w))
    assert grad_w.is_contiguous()
    h.grad, w.grad = grad_h, grad_w
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref_total, ref_ce, ref_z = lm_loss(h2 @ w2[:n_logits].t(), labels, 1e-3)
    ref_total.backward()
    assert ce.item() == pytest.approx(ref_ce.item(), rel=1e-6)
    assert z.item() == pytest.approx(ref_z.item(), rel=1e-5)
    assert rel_err(h.grad, h2.grad) < 1e-5 and rel_err(w.grad, w2.grad) < 1e-5


@needs_onednn
@pytest.mark.timeout(240)
def test_compiled_blocks_keep_the_onednn_products():
    """`model.compile=blocks` on the CPU: Inductor compiles each block around our oneDNN op
    (it lowers the mkldnn op itself only for frozen weights) and trains as the eager model."""
    import dataclasses

    from torch._dynamo.utils import counters

    cfg = dataclasses.replace(PRESETS["tiny"].with_vocab(300), max_seq_len=48, sliding_window=16,
                              n_layers=1, layer_types=())  # one block: one graph to compile
    eager, compiled = Olmo3(cfg), Olmo3(cfg)
    for m in (eager, compiled):
        init_weights(m, 0)
        m.configure(matmul="onednn")
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_blocks()
    x = torch.randint(0, 300, (2, 49), generator=torch.Generator().manual_seed(6))
    for m in (eager, compiled):
        m(x[:, :-1], labels=x[:, 1:], z_loss=1e-4)[0].backward()
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    grads = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        assert rel_err(p.grad, grads[name].grad) < 1e-4, name
