"""Storage faults during async saves, injected with real signals to real server processes.

What must hold whatever the storage does: the training loop is not blocked, a save is retried
with backoff, a checkpoint is committed whole or not at all, and saving works again once the
server is back.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest
import torch
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

import relaytrain.checkpoint.streaming as streaming
from relaytrain import storage
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.checkpoint.writer import AsyncCheckpointWriter, snapshot_to_host

pytestmark = pytest.mark.timeout(90)
WRITER_LOG = "relaytrain.checkpoint.writer"


def state(seed: int, rows: int = 256) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.w": torch.randn(rows, 1024, generator=g), "model.step": torch.tensor(seed)}


def save(store: CheckpointStore, step: int) -> None:
    store.commit(step, {"model": store.write_part(step, "model", state(step))}, {})


def submit_save(writer: AsyncCheckpointWriter, step: int, rows: int = 256):
    """What the training loop does at a checkpoint step; returns the commit's future."""
    part = writer.submit(step, "model", snapshot_to_host(state(step, rows)))
    return writer.submit_commit(step, {"model": part}, {"data": {"batch": step}})


def submit_unanswered(writer: AsyncCheckpointWriter, server, requests, step: int):
    """A save submitted while `server` is paused, once its first request has left: the save
    is then waiting for storage, not the training loop (it got its future back)."""
    sent = threading.Event()
    requests.hook = lambda method, url: sent.set()
    server.pause()
    commit = submit_save(writer, step)
    assert sent.wait(30) and not commit.done()  # it cannot finish while nothing answers
    requests.hook = None
    return commit


def assert_restores(store: CheckpointStore, step: int, rows: int = 256) -> None:
    manifest, tensors = store.read(step)  # verifies every file's size and sha256
    assert manifest["step"] == step
    assert all(torch.equal(tensors[k], t) for k, t in state(step, rows).items())


def test_save_completes_when_a_killed_server_comes_back(object_server, http_requests) -> None:
    store = CheckpointStore(object_server.url("ckpt"))
    save(store, 1)
    with AsyncCheckpointWriter(store, attempts=5, backoff_s=0.5) as writer:
        # the save's first request is stuck in flight...
        commit = submit_unanswered(writer, object_server, http_requests, 2)
        object_server.kill()  # ...and the server vanishes under it
        time.sleep(1.0)  # an outage: requests meanwhile find nobody listening
        assert not commit.done()  # the save waits for storage to come back...
        object_server.start()  # same port; an in-memory server comes back empty
        assert commit.result(timeout=60) == object_server.url("ckpt/step_00000002")
    assert store.committed_steps() == ([1, 2] if object_server.persistent else [2])
    assert store.latest_step() == 2
    assert_restores(store, 2)


def test_part_upload_killed_between_pieces_is_redone_whole(object_server, http_requests,
                                                          monkeypatch) -> None:
    """A 20 MiB part goes up in pieces (S3 multipart upload, GCS resumable upload); the server
    dies as the second piece is sent and comes back without the upload session. The retry
    starts the part over."""
    monkeypatch.setattr(streaming, "MIN_UPLOAD", 0)  # the clients' 5 MiB pieces
    # S3: 5 MiB pieces, and no botocore retries: moto answers a lost upload id with a 500,
    # which botocore would retry for seconds before the writer gets to start over
    opts = ({"default_block_size": 5 << 20, "config_kwargs": {"retries": {"max_attempts": 1}}}
            if object_server.scheme == "s3" else {})
    store = CheckpointStore(object_server.url("ckpt"), storage_options=opts)
    piece = re.compile(r"[?&](partNumber|upload_id)=")
    pieces: list[str] = []

    def freeze_on_second_piece(method: str, url: str) -> None:
        if piece.search(url):
            pieces.append(url)
            if len(pieces) == 2:
                object_server.pause()  # before the request leaves: it never completes

    http_requests.hook = freeze_on_second_piece
    with AsyncCheckpointWriter(store, attempts=4, backoff_s=0.5) as writer:
        commit = submit_save(writer, 5, rows=5120)
        deadline = time.monotonic() + 30
        while len(pieces) < 2:
            assert time.monotonic() < deadline and not commit.done(), http_requests
            time.sleep(0.01)
        http_requests.hook = None
        object_server.kill()
        time.sleep(0.5)
        object_server.start()
        commit.result(timeout=60)
    assert_restores(store, 5, rows=5120)


def test_slow_server_delays_a_save_without_breaking_it(object_server, http_requests) -> None:
    store = CheckpointStore(object_server.url("ckpt"))
    with AsyncCheckpointWriter(store) as writer:
        commit = submit_unanswered(writer, object_server, http_requests, 3)
        object_server.resume()
        commit.result(timeout=30)
        assert writer.retry_delays == []  # the slow answer was waited for, not given up on
    assert_restores(store, 3)


def test_save_that_keeps_failing_is_never_committed(s3_server, http_requests, caplog) -> None:
    """The server stops answering for longer than the writer retries. (S3 only: gcsfs retries
    every request itself for about 30 s before the writer sees an error.)"""
    fast = {"config_kwargs": {"connect_timeout": 0.5, "read_timeout": 0.5,
                              "retries": {"max_attempts": 1}}}
    store = CheckpointStore(s3_server.url("ckpt"), storage_options=fast)
    store.fs.retries = 1  # s3fs's own retry count is a class attribute, not an option
    save(store, 1)
    caplog.set_level(logging.WARNING, logger=WRITER_LOG)
    with AsyncCheckpointWriter(store, attempts=3, backoff_s=0.2) as writer:
        commit = submit_unanswered(writer, s3_server, http_requests, 2)
        # The client's own read timeout, after the writer's last attempt (not this test's
        # deadline, a TimeoutError, which would count as transient too).
        with pytest.raises(ReadTimeoutError, match="Read timeout on endpoint URL"):
            commit.result(timeout=30)
        s3_server.resume()  # requests the client gave up on may still land now
        # three attempts, with exponential backoff between them, each retry logged
        assert writer.retry_delays == [0.2, 0.4]
        assert len([r for r in caplog.records if r.name == WRITER_LOG]) == 2
        assert store.latest_step() == 1 and store.committed_steps() == [1]

        commit = submit_save(writer, 3)  # the next save just works
        commit.result(timeout=30)
    assert store.committed_steps() == [1, 3]
    assert_restores(store, 3)


def test_unreachable_storage_at_recovery_is_reported_as_transient(s3_server) -> None:
    """A recovery that cannot reach storage gets an error it can tell from a bad checkpoint
    (and so fall back to the in-memory snapshot)."""
    fast = {"config_kwargs": {"retries": {"max_attempts": 1}}}
    store = CheckpointStore(s3_server.url("ckpt"), storage_options=fast)
    save(store, 1)
    s3_server.kill()
    with pytest.raises(EndpointConnectionError, match="Could not connect") as failure:
        store.load_latest_good()
    assert storage.is_transient(failure.value)
