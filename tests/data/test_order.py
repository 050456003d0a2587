"""The data order is a pure function of (seed, epoch, batch index), never of the world size.

Checked exhaustively on small sizes against a naive reference: build the whole stream as the
concatenation of per-epoch permutations and slice it.
"""

from __future__ import annotations

import numpy as np
import pytest

from relaytrain.data.order import (
    Order,
    epoch_permutation,
    global_batch,
    heldout_ids,
    micro_batch_indices,
    rank_part,
)
from relaytrain.errors import DataError


def reference_stream(seed: int, n: int, epochs: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([epoch_permutation(seed, e, n) for e in range(epochs)])
    return np.repeat(np.arange(epochs), n), ids


def test_the_order_is_pinned():
    """Changing these numbers silently changes every run's data order (and breaks resumes)."""
    assert epoch_permutation(0, 0, 10).tolist() == [3, 7, 6, 8, 1, 2, 9, 0, 5, 4]
    assert epoch_permutation(1234, 7, 12).tolist() == [5, 2, 8, 3, 9, 11, 7, 0, 10, 4, 6, 1]


def test_each_epoch_is_a_fresh_permutation():
    p = epoch_permutation(3, 0, 1000)
    assert p.dtype == np.int64 and sorted(p.tolist()) == list(range(1000))
    assert np.array_equal(p, epoch_permutation(3, 0, 1000))
    assert not np.array_equal(p, epoch_permutation(3, 1, 1000))
    assert not np.array_equal(p, epoch_permutation(4, 0, 1000))


def test_global_batches_are_slices_of_the_concatenated_epochs():
    """No drop and no repeat: batches may straddle epochs (or span several when B > n)."""
    for n in range(1, 8):
        for B in range(1, 10):
            n_batches = 3 * n // B + 2
            ref_epochs, ref_ids = reference_stream(5, n, (n_batches * B) // n + 1)
            order = Order(5, n)
            for k in range(n_batches):
                epochs, ids = global_batch(5, n, B, k)
                assert np.array_equal(ids, ref_ids[k * B:(k + 1) * B]), (n, B, k)
                assert np.array_equal(epochs, ref_epochs[k * B:(k + 1) * B])
                assert np.array_equal(order.global_batch(B, k)[1], ids)


def test_rank_parts_concatenate_to_the_global_batch_for_every_world_size():
    for B in range(1, 13):
        _, ids = global_batch(1, 7, B, 3)
        for R in (r for r in range(1, B + 1) if B % r == 0):
            parts = [ids[rank_part(B, r, R)] for r in range(R)]
            assert np.array_equal(np.concatenate(parts), ids), (B, R)


def test_micro_batches_tile_each_rank_part_in_global_order():
    """Global micro-batch j is sequences [j*m, (j+1)*m) whichever rank runs it."""
    for B in range(1, 13):
        for m in (m for m in range(1, B + 1) if B % m == 0):
            for R in (r for r in range(1, B // m + 1) if (B // m) % r == 0):
                seen = []
                for r in range(R):
                    part = rank_part(B, r, R)
                    idx = micro_batch_indices(B, m, r, R)
                    assert idx[0] * m == part.start and idx[-1] * m + m == part.stop
                    seen.extend(idx)
                assert seen == list(range(B // m)), (B, m, R)


def test_uneven_splits_are_refused():
    with pytest.raises(ValueError, match="does not split"):
        rank_part(6, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        rank_part(8, 4, 4)
    with pytest.raises(ValueError, match="micro_batch"):
        micro_batch_indices(8, 3, 0, 2)
    with pytest.raises(ValueError):
        epoch_permutation(-1, 0, 4)


def test_heldout_ids_are_a_fixed_evenly_spaced_set():
    ids = heldout_ids(100, 8)
    assert ids.tolist() == [0, 12, 25, 37, 50, 62, 75, 87]
    assert heldout_ids(5, 32).tolist() == [0, 1, 2, 3, 4]  # capped at what exists
    with pytest.raises(DataError, match="held-out split has no instance"):
        heldout_ids(0, 8)
