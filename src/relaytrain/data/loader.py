"""A DP rank's view of the global order, read ahead in a background thread.

The loader holds no state beyond the next batch index: `get(k)` for any k returns exactly the
rank's part of pure global batch k, so resume, recovery and a change of world size are a
reposition, O(1). Per batch the work is O(global batch): the epoch permutation is computed once
per epoch and cached, and tokens come from a memory map (or byte ranges of remote files).

Two orders (`data.order`): "relay" (order.py: rank parts and micro-batches contiguous) and
"olmo-core" (olmo_order.py: OLMo-core's order and rank slicing, on an indexed OLMo-core mix).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from relaytrain.data import olmo_order
from relaytrain.data.dataset import TokenDataset, TokenSplit
from relaytrain.data.order import Order, micro_batch_indices, rank_part
from relaytrain.data.packing import Docs, PackedSplit, micro_batch_documents
from relaytrain.data.token_arrays import ArraySplit
from relaytrain.errors import DataError

ORDERS = ("relay", "olmo-core")


Split = TokenSplit | ArraySplit | PackedSplit


def _check_split(split: Split, order: str) -> None:
    if order == "olmo-core" and not isinstance(split, ArraySplit | PackedSplit):
        raise DataError(f"data.order olmo-core reads OLMo-core token arrays, but {split.root} "
                        "was written by `data prepare`; index its token files with `relaytrain "
                        "data index` or use data.order relay")


def check_order(dataset: TokenDataset, order: str) -> None:
    """Refuse, before anything is written, an order the data set cannot be read in."""
    _check_split(dataset.split("train"), order)


@dataclass(frozen=True)
class Batch:
    """One DP rank's share of global batch `batch_index` (optimizer step batch_index + 1)."""

    batch_index: int
    ids: np.ndarray  # this rank's instance ids, int64, in the order's rank order
    epochs: np.ndarray  # the epoch of each id
    # (global micro-batch index, LongTensor [micro_batch, seq_len + 1]); inputs [:, :-1],
    # labels [:, 1:]
    micro_batches: list[tuple[int, torch.Tensor]]
    # packed instances: global micro-batch index -> its documents; empty for concatenated ones
    documents: dict[int, Docs] = field(default_factory=dict)


class Loader:
    """Rank `dp_rank` of `dp_world`'s batches of `split`, `prefetch` global batches ahead."""

    def __init__(self, split: Split, seq_len: int, seed: int,
                 global_batch: int, micro_batch: int, dp_rank: int, dp_world: int,
                 prefetch: int = 2, order: str = "relay") -> None:
        self.split = split
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.global_batch = int(global_batch)
        self.micro_batch = int(micro_batch)
        self.order_name = order
        self.n_instances = split.require_instances(self.seq_len)
        m = self.micro_batch
        if order == "olmo-core":
            _check_split(split, order)
            olmo = olmo_order.OlmoOrder(seed, self.n_instances, global_batch)
            self._global_batch = olmo.global_batch
            self.positions = olmo_order.rank_positions(global_batch, dp_rank, dp_world)
            self.micro_indices = olmo_order.rank_micro_batches(global_batch, m, dp_rank,
                                                               dp_world)
            rows = [olmo_order.micro_positions(global_batch, m, j) for j in self.micro_indices]
        elif order == "relay":
            relay = Order(seed, self.n_instances)
            self._global_batch = lambda k: relay.global_batch(self.global_batch, k)
            part = rank_part(global_batch, dp_rank, dp_world)
            self.positions = np.arange(part.start, part.stop, dtype=np.int64)
            self.micro_indices = micro_batch_indices(global_batch, m, dp_rank, dp_world)
            rows = [np.arange(j * m, (j + 1) * m, dtype=np.int64) for j in self.micro_indices]
        else:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self._rows = np.concatenate(rows)  # global-batch positions of the micro-batches' rows
        self.prefetch = max(0, int(prefetch))
        self._cv = threading.Condition()
        self._ready: dict[int, Batch] = {}
        self._produce = 0  # the next batch index the thread makes
        self._generation = 0  # bumped on every reposition; stale results are dropped
        self._running = False  # the thread makes batches only after the first get()
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    # ---- the pure part ----------------------------------------------------------------------
    def ids(self, batch_index: int) -> np.ndarray:
        """The instance ids of this rank's part of batch `batch_index` (what the ledger records
        of it), without reading a token: the control plane's simulated workers."""
        return self._global_batch(batch_index)[1][self.positions]

    def make(self, batch_index: int) -> Batch:
        """Build batch `batch_index` synchronously (the thread calls this)."""
        epochs, ids = self._global_batch(batch_index)
        rows = self.split.instances(ids[self._rows], self.seq_len)
        tokens = torch.from_numpy(rows)
        m = self.micro_batch
        micro = [(j, tokens[i * m:(i + 1) * m]) for i, j in enumerate(self.micro_indices)]
        docs = {}
        if isinstance(self.split, PackedSplit):
            docs = {j: micro_batch_documents(self.split, ids[self._rows][i * m:(i + 1) * m],
                                             rows[i * m:(i + 1) * m])
                    for i, j in enumerate(self.micro_indices)}
        return Batch(batch_index, ids[self.positions], epochs[self.positions], micro, docs)

    # ---- the read-ahead ---------------------------------------------------------------------
    def get(self, batch_index: int) -> Batch:
        """This rank's part of global batch `batch_index`; out of sequence just repositions."""
        if batch_index < 0:
            raise ValueError(f"batch_index must be >= 0, got {batch_index}")
        if self.prefetch == 0:
            batch = self.make(batch_index)
            return batch
        with self._cv:
            if self._closed:
                raise RuntimeError("Loader.get() after close()")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="relaytrain-loader",
                                                daemon=True)
                self._thread.start()
            if batch_index not in self._ready and not (
                    self._running and batch_index == self._produce):
                self._generation += 1
                self._ready.clear()
                self._produce = batch_index
                self._running = True
                self._error = None
                self._cv.notify_all()
            while batch_index not in self._ready and self._error is None:
                self._cv.wait()
            if batch_index not in self._ready:  # the read-ahead failed making this batch
                error, self._error, self._running = self._error, None, False
                self._generation += 1
                self._ready.clear()
                raise error
            batch = self._ready.pop(batch_index)
            for k in [k for k in self._ready if k < batch_index]:
                del self._ready[k]
            self._cv.notify_all()
            return batch

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._running or self._error is not None
                                            or len(self._ready) >= self.prefetch):
                    self._cv.wait()
                if self._closed:
                    return
                generation, index = self._generation, self._produce
            try:
                batch = self.make(index)
            except BaseException as e:  # handed to the consumer's get()
                with self._cv:
                    if generation == self._generation:
                        self._error = e
                        self._cv.notify_all()
                continue
            with self._cv:
                if generation == self._generation:
                    self._ready[index] = batch
                    self._produce = index + 1
                    self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
