"""The model's dense products (linear layers and the LM head) on the CPU through oneDNN.

Why: torch's fp32 GEMM on the CPU is MKL's, and MKL runs its AVX2 kernels on AMD processors
even where they have AVX-512. oneDNN, which torch ships for its own mkldnn ops and Inductor's
CPU backend, picks kernels by instruction set, so on such hosts it runs the same products at
about twice MKL's rate (docs/MEASURED.md; `relaytrain bench train-throughput` measures the
step both ways).

The products are the same fp32 IEEE products either way (no reduced precision); only their
summation order, hence the last bits, differs (float rounding). oneDNN's results do not depend
on the thread count or on memory alignment, so runs remain bit-reproducible and exact mode's DP
invariance holds (`tests/model/test_matmul.py`).

Backends: `aten` is torch's own (MKL on the CPU, cuBLAS on a GPU) and the one whose logits are
bit-identical with HF's on the CPU; `onednn` is this module's CPU path (fp32 only: anything
else, a GPU tensor or an autocast region falls back to `aten` call by call); `auto` is the
faster of the two on this host's CPU, measured (`model.backend_choice`): on an Intel Xeon, whose
MKL runs AVX-512 itself, that is usually `aten`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from relaytrain.model.cpu_kernels import cpu_fp32
from relaytrain.model.prediction import predicted

MATMUL_BACKENDS = ("auto", "aten", "onednn")


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN CPU kernels this module calls."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_applies(backend: str, *tensors: Tensor) -> bool:
    return backend == "onednn" and cpu_fp32(*tensors)


@torch.library.custom_op("relaytrain::onednn_mm_t", mutates_args=())
def _inner(a: Tensor, b: Tensor) -> Tensor:
    """a @ b.T through oneDNN's inner product (a [M, K], b [N, K]; transposed views allowed).

    An op of our own, opaque to torch.compile: Inductor lowers the mkldnn op itself only for
    frozen (constant) weights, and compiled blocks train theirs. The call's overhead is small
    beside the products it wraps (docs/MEASURED.md)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


@_inner.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], b.shape[0])


def mm_t(a: Tensor, b: Tensor, backend: str, scratch: Tensor | None = None) -> Tensor:
    """`a @ b.T` for matrices a [M, K] and b [N, K] (either may be a transposed view).

    `scratch`, an [M, N] buffer, receives the product on the `aten` path (oneDNN allocates
    its own result)."""
    if _onednn_applies(backend, a, b):
        return _inner(a, b)
    return torch.mm(a, b.t(), out=scratch)


def weight_grad(g: Tensor, x: Tensor, backend: str) -> Tensor:
    """`g.T @ x` [N, K] for a linear layer's output gradient g [M, N] and input x [M, K].

    Through oneDNN the product is formed with the smaller of N and K as its rows (transposed
    back as a view when that is K, so the result may not be contiguous): both operands are
    transposed views, and oneDNN is faster in that orientation than in the other (README
    "Measured").
    """
    if not _onednn_applies(backend, g, x):
        return torch.mm(g.t(), x)
    if g.shape[1] > x.shape[1]:
        return _inner(x.t(), g.t()).t()
    return _inner(g.t(), x.t())


def add_weight_grad(total: Tensor | None, g: Tensor, x: Tensor, backend: str,
                    dtype: torch.dtype) -> Tensor:
    """`total + g.T @ x`, summed in place into `total` (a new tensor in `dtype` when it is
    None): the weight gradient of a product whose rows come in chunks (the LM head's tokens).

    Through oneDNN every chunk's product has the same orientation as the first (see
    `weight_grad`), so the sum is one contiguous pass; on the `aten` path the GEMM adds into
    `total` itself when the dtypes agree.
    """
    if total is None:
        return weight_grad(g, x, backend).to(dtype)
    if _onednn_applies(backend, g, x):
        return total.add_(weight_grad(g, x, backend))
    if total.dtype == g.dtype:
        return total.addmm_(g.t(), x)
    return total.add_(g.t() @ x)


class _OneDNNLinear(torch.autograd.Function):
    """`x @ weight.T` with all three products (forward, input and weight gradients) through
    oneDNN; with `deferred`, none for the weight (W forms it: `DeferredGrad`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, deferred: bool = False) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.deferred = deferred
        return _inner(x2, weight).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x2, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _inner(g, weight.t()).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1] and not ctx.deferred:  # in the weight's layout: callers
            grad_w = weight_grad(g, x2, "onednn").contiguous()  # may take it as .grad
        return grad_x, grad_w, None


def linear(x: Tensor, weight: Tensor, backend: str, deferred: bool = False) -> Tensor:
    """`F.linear(x, weight)` (no bias) through `backend` (`aten` or `onednn`); `deferred`:
    oneDNN's backward forms no weight gradient (aten's forms none that is not asked for)."""
    if _onednn_applies(backend, x, weight):
        return _OneDNNLinear.apply(x, weight, deferred)
    return F.linear(x, weight)


@dataclass
class DeferredGrad:
    """What one linear layer's weight gradient needs, kept by a forward under `deferring`:
    the input as its product read it and, once `deferred_backward` has passed the layer, the
    gradient at its output. A zero-bubble pipeline's B computes input gradients only and frees
    the rest of the graph; its W forms the weight gradients from these (arXiv 2401.10241)."""

    layer: Linear
    x: Tensor
    backend: str  # the product's: `aten` or `onednn`
    output: GradientEdge | None = None  # where the gradient at the output arrives (until B)
    grad: Tensor | None = None

    def weight_grad(self) -> Tensor:
        """`grad.T @ x` in the weight's dtype: bit for bit the weight gradient autograd computes
        through `linear` (aten's `mm(grad.T, x)` of the folded rows, or `_OneDNNLinear`'s),
        cast as autocast's weight cast would be (tests/model/test_matmul.py)."""
        if self.grad is None:
            raise RuntimeError("no gradient reached a deferred linear layer")
        g = self.grad.reshape(-1, self.grad.shape[-1])
        w = weight_grad(g, self.x.reshape(-1, self.x.shape[-1]), self.backend)
        return w.contiguous().to(self.layer.weight.dtype)

    def held(self) -> list[Tensor]:
        return [self.x] + ([] if self.grad is None else [self.grad])


def deferred_backward(outputs: Tensor, inputs: Sequence[Tensor], grad_outputs: Tensor | None,
                      records: Collection[DeferredGrad]) -> tuple[Tensor, ...]:
    """`torch.autograd.grad(outputs, inputs, grad_outputs)` of a forward run under `deferring`
    with `records`, each of which receives the gradient at its layer's output: the B of a
    split backward. The recorded weights are not among `inputs`, so the graph forms none of
    their gradients (W does, `DeferredGrad.weight_grad`); the inputs' are the whole
    backward's, to the bit (the same graph)."""
    grads = torch.autograd.grad(outputs, [*inputs, *(d.output for d in records)], grad_outputs)
    for d, g in zip(records, grads[len(inputs):], strict=True):
        d.output, d.grad = None, g
    return grads[:len(inputs)]


_DEFERRED: ContextVar[list[DeferredGrad] | None] = ContextVar("deferred_grads", default=None)


@contextmanager
def deferring(records: list[DeferredGrad] | None) -> Iterator[list[DeferredGrad] | None]:
    """Within: every `Linear` whose weight requires a gradient appends a `DeferredGrad` to
    `records`, so that `deferred_backward` leaves its weight gradient to W (None: none does,
    e.g. inside a checkpointed block, whose recompute must see the forward's ops).

    The forward builds the whole backward's graph itself and records per layer only its input
    and where its output's gradient arrives (a gradient edge): at the small preset's shapes on
    a CPU a layer's product takes ~0.3 ms, and a detached weight, an autocast region and a
    tensor hook (the way before) cost ~40 us of Python a layer: a split stage's F + B + W
    4.3% over the whole F + B, now 2.2% (medians; docs/MEASURED.md)."""
    token = _DEFERRED.set(records)
    try:
        yield records
    finally:
        _DEFERRED.reset(token)


class Linear(nn.Linear):
    """`nn.Linear` without bias whose products go through `self.matmul` (set by
    `Olmo3.configure`); the parameter (`weight`) and its initialisation are nn.Linear's."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.matmul = "aten"

    def forward(self, x: Tensor) -> Tensor:
        # compiled code never defers (dynamo cannot trace a ContextVar; the pipeline executor
        # does not defer in compiled modules)
        records = None if torch.compiler.is_compiling() else _DEFERRED.get()
        weight = predicted(self.weight)  # weight prediction's transient (model.prediction)
        if records is None or not (torch.is_grad_enabled() and self.weight.requires_grad
                                   and x.requires_grad):
            return linear(x, weight, self.matmul)
        if not torch.is_autocast_enabled(x.device.type):
            y = linear(x, weight, self.matmul, deferred=True)
        else:  # the casts autocast would make
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                y = linear(x, weight.to(dtype), self.matmul, deferred=True)
        backend = "onednn" if _onednn_applies(self.matmul, x, weight) else "aten"
        records.append(DeferredGrad(self, x.detach(), backend, get_gradient_edge(y)))
        return y
