"""Activation memory as autograd sees it: the bytes of the distinct storages saved for backward.

Counted with saved-tensor hooks, so it is what the graph really keeps (views and re-saved
tensors count once), whatever the kernels; the weights are skipped (held anyway)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor


class SavedBytes:
    """Sums the bytes of every distinct storage saved while `counting()`, or passed to `add`."""

    def __init__(self, weights: Iterable[Tensor]):
        self.skip = {w.untyped_storage().data_ptr() for w in weights}
        self.seen: set[int] = set()
        self.nbytes = 0

    def add(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            self.nbytes += storage.nbytes()

    def _pack(self, t: Tensor) -> Tensor:
        self.add(t)
        return t

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield
