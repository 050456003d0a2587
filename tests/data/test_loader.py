"""Reading prepared data: instances are fixed windows of the stream, a broken directory is a
clear DataError, and every rank's loader serves its part of the pure global batch, at any batch
index, in any order, at any world size."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.loader import Loader
from relaytrain.data.order import global_batch, heldout_ids
from relaytrain.errors import DataError

SEQ = 64


@pytest.fixture(scope="module")
def train(prepared: Path):
    return TokenDataset.open(prepared).split("train")


def broken_copy(prepared: Path, tmp_path: Path, how: str) -> Path:
    d = tmp_path / "d"
    shutil.copytree(prepared, d)
    index = json.loads((d / "index.json").read_text())
    if how == "no index":
        (d / "index.json").unlink()
    elif how == "corrupt index":
        (d / "index.json").write_text('{"format_version": 1,')
    elif how == "future version":
        (d / "index.json").write_text(json.dumps({**index, "format_version": 99}))
    elif how == "truncated tokens":
        with open(d / "train.bin", "r+b") as f:
            f.truncate(100)
    elif how == "missing split":
        del index["splits"]["heldout"]
        (d / "index.json").write_text(json.dumps(index))
    return d


@pytest.mark.parametrize("how,message", [
    ("missing dir", "does not exist"),
    ("no index", "has no index.json"),
    ("corrupt index", "index.json: corrupt"),
    ("future version", "format_version 99 is not supported"),
    ("truncated tokens", "train.bin: 100 bytes, but the index says"),
    ("missing split", "no 'heldout' split"),
])
def test_an_unusable_data_dir_is_a_clear_error(prepared: Path, tmp_path, how, message):
    path = tmp_path / "nothing" if how == "missing dir" else broken_copy(prepared, tmp_path, how)
    with pytest.raises(DataError, match=message):
        TokenDataset.open(path)


def test_instance_i_is_a_window_of_seq_len_plus_one_tokens(train):
    n = train.num_instances(SEQ)
    assert n == (train.num_tokens - 1) // SEQ
    got = train.instances([0, 5, n - 1], SEQ)
    assert got.dtype == np.int64 and got.shape == (3, SEQ + 1)
    for row, i in zip(got, (0, 5, n - 1), strict=True):
        assert np.array_equal(row, train.tokens[i * SEQ:i * SEQ + SEQ + 1])
    with pytest.raises(IndexError):
        train.instances([n], SEQ)


def test_heldout_instances_are_fixed_and_a_too_short_split_says_what_fits(prepared: Path):
    ds = TokenDataset.open(prepared)
    heldout = ds.split("heldout")
    n = heldout.num_instances(SEQ)
    assert heldout_ids(n, 4).tolist() == [0, n // 4, n // 2, 3 * n // 4]
    with pytest.raises(DataError, match=rf"{heldout.num_tokens} tokens.*seq_len <= "
                                        rf"{heldout.num_tokens - 1}.*--heldout-frac"):
        heldout.require_instances(heldout.num_tokens)


def test_a_split_survives_pickling_for_remote_workers(train):
    clone = pickle.loads(pickle.dumps(train))
    assert np.array_equal(clone.instances([1, 2], SEQ), train.instances([1, 2], SEQ))


def rank_batches(train, world: int, k: int, **kw) -> list:
    loaders = [Loader(train, SEQ, 7, 8, 2, r, world, **kw) for r in range(world)]
    try:
        return [ld.get(k) for ld in loaders]
    finally:
        for ld in loaders:
            ld.close()


def test_ranks_serve_their_parts_of_the_pure_global_batch(train):
    n = train.num_instances(SEQ)
    for k in (0, 3, n // 8 + 1):  # the last one straddles an epoch boundary
        _, want = global_batch(7, n, 8, k)
        for world in (1, 2, 4):
            batches = rank_batches(train, world, k)
            assert np.array_equal(np.concatenate([b.ids for b in batches]), want)
            micro = [mb for b in batches for mb in b.micro_batches]
            assert [j for j, _ in micro] == [0, 1, 2, 3]
            tokens = torch.cat([t for _, t in micro])
            assert tokens.dtype == torch.int64
            assert torch.equal(tokens, torch.from_numpy(train.instances(want, SEQ)))


def test_get_in_any_order_repositions_and_prefetch_changes_nothing(train):
    reference = Loader(train, SEQ, 7, 8, 2, 1, 2, prefetch=0)
    with Loader(train, SEQ, 7, 8, 2, 1, 2, prefetch=3) as loader:
        for k in [0, 1, 2, 3, 1, 9, 10, 10, 0, 40]:
            got, want = loader.get(k), reference.make(k)
            assert got.batch_index == k and np.array_equal(got.ids, want.ids)
            assert all(torch.equal(a[1], b[1])
                       for a, b in zip(got.micro_batches, want.micro_batches, strict=True))


def test_a_failure_in_the_read_ahead_thread_reaches_get(train, monkeypatch):
    loader = Loader(train, SEQ, 7, 8, 2, 0, 1)
    real = loader.make

    def flaky(k):
        if k == 2:
            raise OSError("disk went away")
        return real(k)

    monkeypatch.setattr(loader, "make", flaky)
    assert loader.get(0).batch_index == 0 and loader.get(1).batch_index == 1
    with pytest.raises(OSError, match="disk went away"):
        loader.get(2)
    assert loader.get(3).batch_index == 3  # a later get repositions and works
    loader.close()
    assert not loader._thread.is_alive()
    with pytest.raises(RuntimeError, match="after close"):
        loader.get(4)


def test_a_bad_layout_is_refused_up_front(train):
    with pytest.raises(ValueError, match="does not split"):
        Loader(train, SEQ, 7, 8, 2, 0, 3)
    with pytest.raises(ValueError, match="micro_batch"):
        Loader(train, SEQ, 7, 8, 3, 0, 2)
    with pytest.raises(DataError, match="no instance of seq_len"):
        Loader(train, train.num_tokens, 7, 8, 2, 0, 1)
