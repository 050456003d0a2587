"""Weight prediction inside each op: a forward on `w + ahead x delta` without a held copy.

Why: PACI's stale micro-batches forward on weights predicted `ahead` updates on (SpecTrain,
`train/pipeline_stage.py`). A copy of the stage's predicted weights would be kept alive by every
graph built on it until that micro-batch's backward: 3-4x a stage's activation memory at the
bench's model size. Here each op that reads a weight forms its prediction just before it runs
(`predicted`; an embedding only its rows, `embedded`), and the graph saves the live weight in
its place (`Prediction.swap`, through the saved-tensor hooks that already meter what the graph
saves): the prediction is freed when the op returns, and the backward reads the weights live at
B. Gradients reach the live weight (the prediction is `w + ahead x delta`, whose derivative in
w is the identity). Under autocast the graph saves the product's cast of the prediction, as it
saves the live weight's cast without prediction.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Prediction:
    """The weights `ahead` updates on, w + ahead x delta, formed op by op while `applied`.

    `deltas`: each weight's last update, by its storage (the live weight's, which the aliases a
    stage forwards through share). `largest`: the bytes of the largest prediction formed (at
    most one is alive at a time: the op's transient)."""

    def __init__(self, deltas: Mapping[int, Tensor], ahead: int):
        self.deltas, self.ahead = deltas, ahead
        self.largest = 0
        # a prediction's storage (while alive: its address is not reused) -> the weight
        self._formed: dict[int, tuple[weakref.ref, Tensor]] = {}

    def weight(self, w: Tensor) -> Tensor:
        delta = self.deltas.get(_storage(w))
        if delta is None:
            return w
        out = torch.add(w, delta, alpha=self.ahead)
        if out.stride() != w.stride():  # `swap` lays the live weight out as the prediction
            raise RuntimeError(f"a predicted weight {list(w.shape)} is not laid out as the "
                               "weight")
        self._formed[_storage(out)] = (weakref.ref(out.untyped_storage()), w)
        self.largest = max(self.largest, out.untyped_storage().nbytes())
        return out

    def rows(self, ids: Tensor, table: nn.Embedding) -> Tensor:
        rows = table(ids)
        delta = self.deltas.get(_storage(table.weight))
        if delta is None:
            return rows
        moved = F.embedding(ids, delta)
        self.largest = max(self.largest, moved.untyped_storage().nbytes())
        return torch.add(rows, moved, alpha=self.ahead)

    def swap(self, t: Tensor) -> Tensor:
        """What the graph saves for `t`: the live weight, viewed as `t` views the prediction,
        where `t` is (a view of) one; else `t`."""
        formed = self._formed.get(_storage(t))
        if formed is None or formed[0]() is None:
            return t
        return formed[1].detach().as_strided(t.size(), t.stride(), t.storage_offset())

    @contextmanager
    def applied(self) -> Iterator[Prediction]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)
            self._formed.clear()


_ACTIVE: ContextVar[Prediction | None] = ContextVar("prediction", default=None)


def _active() -> Prediction | None:
    """The prediction applied, if any (compiled code never predicts: dynamo cannot trace a
    ContextVar; config/checks.py refuses that mix)."""
    return None if torch.compiler.is_compiling() else _ACTIVE.get()


def predicted(w: Tensor) -> Tensor:
    """`w` as the op about to run should read it: its prediction while one is applied."""
    active = _active()
    return w if active is None else active.weight(w)


def embedded(ids: Tensor, table: nn.Embedding) -> Tensor:
    """`table(ids)`, its rows predicted while a prediction is applied (the rows read only:
    the table's prediction is never formed whole)."""
    active = _active()
    return table(ids) if active is None else active.rows(ids, table)
