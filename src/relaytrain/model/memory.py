"""Activation memory, measured two ways: the bytes of the distinct storages saved for backward
(`SavedBytes`, with saved-tensor hooks: what the graph keeps, views and re-saved tensors once),
and the peak bytes of every tensor alive at once during a step (`LiveBytes`: what the step
holds at its worst, temporaries included), each without the weights and their gradients."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class SavedBytes:
    """Sums the bytes of every distinct storage saved while `counting()`, or passed to `add`.
    `swap`: what the graph saves in place of a tensor (weight prediction saves the live weight
    for its transient prediction, `model.prediction`; one pack hook does both, as only the
    innermost saved-tensor hooks apply)."""

    def __init__(self, weights: Iterable[Tensor],
                 swap: Callable[[Tensor], Tensor] | None = None):
        self.skip = {w.untyped_storage().data_ptr() for w in weights}
        self.seen: set[int] = set()
        self.nbytes = 0
        self.swap = swap

    def add(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            self.nbytes += storage.nbytes()

    def _pack(self, t: Tensor) -> Tensor:
        if self.swap is not None:
            t = self.swap(t)
        self.add(t)
        return t

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield


class LiveBytes(TorchDispatchMode):
    """While entered, the peak of the bytes of the tensor storages that ops create and that are
    alive at once: each counted from the op that makes it until it is freed, whether autograd
    saves it or it is a temporary, in the forward and the backward (CPU's, which runs on this
    thread). The storages of `held` (weights, and gradients allocated before: a step's baseline)
    are not counted; nor is an op's internal workspace, allocated and freed within the op."""

    def __init__(self, held: Iterable[Tensor]):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in held}
        self.live: dict[int, int] = {}
        self.nbytes = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.live and ptr not in self.skip:
                    self.live[ptr] = storage.nbytes()
                    self.nbytes += storage.nbytes()
                    weakref.finalize(storage, self._freed, ptr)
        self.peak = max(self.peak, self.nbytes)
        return out

    def _freed(self, ptr: int) -> None:
        self.nbytes -= self.live.pop(ptr, 0)
