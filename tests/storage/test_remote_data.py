"""Prepared data sets read from object storage: a verified, cached local copy."""

from __future__ import annotations

import numpy as np
import pytest

from relaytrain.data.dataset import TokenDataset
from relaytrain.errors import DataError
from relaytrain.storage import filesystem

pytestmark = pytest.mark.timeout(120)


def _upload(local, url) -> None:
    fs, root = filesystem(url)
    for f in sorted(local.iterdir()):
        fs.put_file(str(f), f"{root}/{f.name}")


def test_a_data_set_on_object_storage_reads_like_the_local_one(tmp_path, monkeypatch,
                                                               object_server, corpus_data):
    from pathlib import Path

    monkeypatch.setenv("RELAYTRAIN_CACHE", str(tmp_path / "cache"))
    url = object_server.url("datasets/tiny")
    _upload(Path(corpus_data), url)
    local, remote = TokenDataset.open(corpus_data), TokenDataset.open(url)
    assert remote.fingerprint == local.fingerprint
    ids = np.arange(5)
    assert np.array_equal(remote.split("train").instances(ids, 32),
                          local.split("train").instances(ids, 32))
    # A second open reuses the verified cache.
    assert TokenDataset.open(url).fingerprint == local.fingerprint


def test_a_corrupt_remote_file_is_refused(tmp_path, monkeypatch, s3_server, corpus_data):
    from pathlib import Path

    monkeypatch.setenv("RELAYTRAIN_CACHE", str(tmp_path / "cache"))
    url = s3_server.url("datasets/bad")
    _upload(Path(corpus_data), url)
    fs, root = filesystem(url)
    fs.pipe_file(f"{root}/train.bin", b"\0" * 100)
    with pytest.raises(DataError, match="train.bin: size or sha256 does not match"):
        TokenDataset.open(url)
    assert not list((tmp_path / "cache" / "data").glob("*/index.json"))
