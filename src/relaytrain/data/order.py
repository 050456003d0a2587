"""The global data order: pure functions of (seed, epoch, batch index), never of the world size.

The training stream is the concatenation of one permutation of the instance ids per epoch.
Global batch k is stream positions [k*B, (k+1)*B): a batch may straddle an epoch boundary, so
nothing is dropped and nothing repeats within an epoch. DP rank r of R takes a contiguous part
of the global batch, and micro-batches are contiguous groups of `micro_batch` sequences, so the
concatenation of all ranks' parts is the same global batch for every R.
"""

from __future__ import annotations

import numpy as np

from relaytrain.errors import DataError

# Purpose tag mixed into the seed so the data order never shares a stream with other RNG uses.
ORDER_TAG = 0x0DA7A0


def _check_nonneg(**values: int) -> None:
    for name, v in values.items():
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the `n` instance ids in `epoch` (int64), from numpy's PCG64."""
    _check_nonneg(seed=seed, epoch=epoch, n=n)
    seq = np.random.SeedSequence([int(seed), int(epoch), ORDER_TAG])
    return np.random.Generator(np.random.PCG64(seq)).permutation(int(n)).astype(np.int64)


class Order:
    """The stream of instance ids for one (seed, n), caching recent epoch permutations.

    Computing a permutation is O(n) once per epoch; every batch afterwards is O(batch).
    """

    def __init__(self, seed: int, n_instances: int, cache: int = 2) -> None:
        _check_nonneg(seed=seed)
        if n_instances < 1:
            raise ValueError(f"n_instances must be >= 1, got {n_instances}")
        self.seed = int(seed)
        self.n = int(n_instances)
        self._cache: dict[int, np.ndarray] = {}
        self._cache_size = max(1, cache)

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.seed, epoch, self.n)
            if len(self._cache) >= self._cache_size:
                del self._cache[min(self._cache)]
            self._cache[epoch] = perm
        return perm

    def positions(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(epochs, ids) of stream positions [start, start + count)."""
        _check_nonneg(start=start, count=count)
        pos = np.arange(start, start + count, dtype=np.int64)
        epochs = pos // self.n
        ids = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            ids[sel] = self.permutation(int(e))[pos[sel] % self.n]
        return epochs, ids

    def global_batch(self, global_batch: int, batch_index: int) -> tuple[np.ndarray, np.ndarray]:
        """(epochs, ids) of global batch `batch_index` (0-based; optimizer step k uses k-1)."""
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        _check_nonneg(batch_index=batch_index)
        return self.positions(batch_index * global_batch, global_batch)


def global_batch(seed: int, n_instances: int, global_batch: int,
                 batch_index: int) -> tuple[np.ndarray, np.ndarray]:
    """(epochs, ids) of global batch `batch_index`: position p = batch_index * B + j has epoch
    p // n and id epoch_permutation(seed, epoch, n)[p % n]."""
    return Order(seed, n_instances).global_batch(global_batch, batch_index)


def rank_part(n: int, rank: int, world: int) -> slice:
    """The contiguous part of an n-sequence global batch that DP rank `rank` of `world` takes."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if n % world:
        raise ValueError(f"a global batch of {n} sequences does not split over {world} ranks")
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def micro_batch_indices(global_batch: int, micro_batch: int, rank: int, world: int) -> range:
    """Global micro-batch indices of rank `rank`: index j covers sequences [j*m, (j+1)*m) of the
    global batch, and a rank's micro-batches tile its part in order."""
    part = rank_part(global_batch, rank, world)
    if micro_batch < 1 or (part.stop - part.start) % micro_batch:
        raise ValueError(f"micro_batch {micro_batch} does not divide the {part.stop - part.start}"
                         f" sequences of a rank's part (global batch {global_batch}, {world} "
                         "ranks)")
    return range(part.start // micro_batch, part.stop // micro_batch)


def heldout_ids(n_heldout_instances: int, count: int) -> np.ndarray:
    """The fixed held-out instances evaluated every time: `count` (at most n) evenly spaced ids.

    Independent of seed and world size, so every evaluation of every run on the same data and
    seq_len sees the same instances.
    """
    if n_heldout_instances < 1:
        raise DataError("the held-out split has no instance at this seq_len; prepare with a "
                        "larger --heldout-frac or use a shorter data.seq_len")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    c = min(count, n_heldout_instances)
    return (np.arange(c, dtype=np.int64) * n_heldout_instances) // c
