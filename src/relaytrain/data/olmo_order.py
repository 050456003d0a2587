"""OLMo-core's data order (olmo_core.data.NumpyFSLDataLoader), as pure functions of the seed.

Epoch e (1-based in OLMo-core) is the instance ids 0..n-1 shuffled by numpy's PCG64 seeded with
seed + e; the tail that does not fill a global batch is dropped; the epoch's batch b is its
positions [b*B, (b+1)*B), and DP rank r of R trains on positions r, r+R, r+2R, ... of it.

The stream of batches runs over epochs without a seam: stream batch k is batch k mod E of
epoch k // E + 1 (E batches per epoch), so the position is tokens consumed / (B * seq_len)
whatever the world size. Epochs are reported 0-based, as relaytrain's own order does.

Micro-batches: relaytrain groups a global batch into M = B/m micro-batches that are the same
whatever the world size (what keeps exact mode bit-identical across resizes). Here micro-batch
j is positions j, j+M, j+2M, ... (m of them); rank r of R owns those with j = r mod R, whose
union is exactly OLMo-core's share of rank r.
"""

from __future__ import annotations

import numpy as np

from relaytrain.errors import DataError


def epoch_indices(seed: int, epoch: int, n: int) -> np.ndarray:
    """OLMo-core's global instance order of 1-based `epoch` (uint32, as it stores it)."""
    if epoch < 1:
        raise ValueError(f"epoch must be >= 1 (OLMo-core counts from 1), got {epoch}")
    indices = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed=int(seed) + int(epoch))).shuffle(indices)
    return indices


class OlmoOrder:
    """The stream of global batches of `global_batch` instances out of `n_instances`."""

    def __init__(self, seed: int, n_instances: int, global_batch: int, cache: int = 2) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        self.seed = int(seed)
        self.n = int(n_instances)
        self.global_batch_size = int(global_batch)
        self.batches_per_epoch = self.n // self.global_batch_size
        if self.batches_per_epoch < 1:
            raise DataError(f"the data has {self.n} instances, fewer than one global batch of "
                            f"{self.global_batch_size}; use a smaller global batch or seq_len")
        self._cache: dict[int, np.ndarray] = {}
        self._cache_size = max(1, cache)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of 0-based `epoch`."""
        perm = self._cache.get(epoch)
        if perm is None:
            perm = epoch_indices(self.seed, epoch + 1, self.n)
            if len(self._cache) >= self._cache_size:
                del self._cache[min(self._cache)]
            self._cache[epoch] = perm
        return perm

    def global_batch(self, batch_index: int) -> tuple[np.ndarray, np.ndarray]:
        """(epochs, ids), int64, of stream batch `batch_index` (optimizer step k uses k-1)."""
        if batch_index < 0:
            raise ValueError(f"batch_index must be >= 0, got {batch_index}")
        epoch, b = divmod(int(batch_index), self.batches_per_epoch)
        B = self.global_batch_size
        ids = self.permutation(epoch)[b * B:(b + 1) * B].astype(np.int64)
        return np.full(B, epoch, dtype=np.int64), ids


def rank_positions(global_batch: int, rank: int, world: int) -> np.ndarray:
    """Positions within a global batch that DP rank `rank` of `world` trains on, in OLMo-core's
    order (`indices[:, rank::world]`)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if global_batch % world:
        raise ValueError(f"a global batch of {global_batch} instances does not split over "
                         f"{world} ranks")
    return np.arange(rank, global_batch, world, dtype=np.int64)


def micro_positions(global_batch: int, micro_batch: int, index: int) -> np.ndarray:
    """Positions of global micro-batch `index`: index, index + M, ... (M = global_batch /
    micro_batch), the same for every world size."""
    if micro_batch < 1 or global_batch % micro_batch:
        raise ValueError(f"micro_batch {micro_batch} does not divide global batch {global_batch}")
    count = global_batch // micro_batch
    if not 0 <= index < count:
        raise ValueError(f"micro-batch index must be in [0, {count}), got {index}")
    return np.arange(index, global_batch, count, dtype=np.int64)


def rank_micro_batches(global_batch: int, micro_batch: int, rank: int, world: int) -> range:
    """Global micro-batch indices rank `rank` of `world` owns: those equal to rank mod world."""
    rank_positions(global_batch, rank, world)  # validates rank and world
    count = global_batch // micro_batch if micro_batch >= 1 else 0
    if micro_batch < 1 or global_batch % micro_batch or count % world:
        raise ValueError(f"the {count} micro-batches of {micro_batch} in a global batch of "
                         f"{global_batch} do not split over {world} ranks")
    return range(rank, count, world)
