"""AsyncCheckpointWriter and snapshot_to_host: overlap, back-pressure, errors, retries; a
worker's part writes as the controller collects them (PartWrites)."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from concurrent.futures import Future

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.checkpoint.writer import (
    AsyncCheckpointWriter,
    PartWrites,
    WriteReport,
    snapshot_to_host,
)

pytestmark = pytest.mark.timeout(30)


class GatedStore(CheckpointStore):
    """A real store whose part writes wait until the test opens the gate."""

    def __init__(self, url: str):
        super().__init__(url)
        self.gate = threading.Event()
        self.started = threading.Event()

    def write_part(self, step, part, tensors, shards=None, attempt=None):
        self.started.set()
        assert self.gate.wait(10), "gate never opened"
        return super().write_part(step, part, tensors, shards, attempt)


class FlakyMemoryFS(MemoryFileSystem):
    """memory:// whose next `failures` part uploads die mid-stream with a connection reset."""

    protocol = "flaky"
    failures = 0
    uploads = 0

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("flaky://"))

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "w" in mode and path.endswith(".safetensors"):
            type(self).uploads += 1
            if type(self).failures > 0:
                type(self).failures -= 1
                real_write = f.write

                def write(data):
                    real_write(bytes(data)[:10])
                    raise ConnectionResetError("injected: connection reset mid-upload")

                f.write = write
        return f


@pytest.fixture
def flaky_store():
    fsspec.register_implementation("flaky", FlakyMemoryFS, clobber=True)
    FlakyMemoryFS.failures = FlakyMemoryFS.uploads = 0
    root = f"ckpt-{uuid.uuid4().hex}"
    yield CheckpointStore(f"flaky://{root}")
    MemoryFileSystem().rm(f"/{root}", recursive=True)


def test_snapshot_is_an_independent_contiguous_cpu_copy():
    base = torch.arange(6.0).reshape(2, 3)
    param = torch.nn.Parameter(torch.ones(3))
    src = {"t": base.t(), "row": base[0], "param": param, "step": torch.tensor(3)}
    snap = snapshot_to_host(src)
    base.add_(100)  # training mutates the originals after the snapshot
    with torch.no_grad():
        param.mul_(5)
    assert torch.equal(snap["t"], torch.arange(6.0).reshape(2, 3).t())
    assert torch.equal(snap["row"], torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(snap["param"], torch.ones(3)) and not snap["param"].requires_grad
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in snap.values())


def test_snapshot_reuses_a_finished_snapshots_buffers_where_shapes_match():
    first = snapshot_to_host({"w": torch.zeros(4), "b": torch.zeros(2)})
    second = snapshot_to_host({"w": torch.ones(4), "b": torch.ones(3)}, out=first)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # no new allocation
    assert second["b"].data_ptr() != first["b"].data_ptr()  # shape changed: a new buffer
    assert torch.equal(second["w"], torch.ones(4)) and torch.equal(second["b"], torch.ones(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshot_of_cuda_tensors_lands_in_pinned_host_memory():
    x = torch.randn(1000, 10, device="cuda")
    snap = snapshot_to_host({"x": x.t()})
    x.zero_()
    assert snap["x"].is_pinned() and snap["x"].is_contiguous()
    assert snap["x"].abs().sum() > 0


def test_write_runs_in_the_background_while_the_caller_keeps_working(tmp_path):
    store = GatedStore(str(tmp_path))
    with AsyncCheckpointWriter(store) as writer:
        fut = writer.submit(1, "model", {"w": torch.full((1000,), 1.0)})
        assert store.started.wait(5)
        work = torch.ones(64, 64) @ torch.ones(64, 64)  # "training" while the write is pending
        assert not fut.done()
        store.gate.set()
        record = fut.result(timeout=10)
        commit = writer.submit_commit(1, {"model": record}, {"work": work[0, 0].item()})
        assert commit.result(timeout=10) == str(tmp_path / "step_00000001")
    assert store.read(1)[0]["work"] == 64.0


def waiting_in_submit(thread: threading.Thread) -> bool:
    """Whether `thread` is blocked in a wait inside AsyncCheckpointWriter.submit."""
    frame, names = sys._current_frames().get(thread.ident), set()
    while frame is not None:
        names.add(frame.f_code.co_qualname)
        frame = frame.f_back
    return "AsyncCheckpointWriter.submit" in names and "Condition.wait" in names


def test_submit_blocks_while_max_pending_writes_are_unfinished(tmp_path):
    store = GatedStore(str(tmp_path))
    writer = AsyncCheckpointWriter(store, max_pending=1)
    first = writer.submit(1, "model", {"w": torch.zeros(3)})
    first_done_at_return = []
    second = threading.Thread(target=lambda: (
        writer.submit(2, "model", {"w": torch.ones(3)}), first_done_at_return.append(first.done())))
    second.start()
    while second.is_alive() and not waiting_in_submit(second):
        time.sleep(0.001)
    assert second.is_alive()  # held back: only one snapshot may wait for storage
    store.gate.set()
    second.join(5)
    assert first_done_at_return == [True]  # let through by the first write finishing
    writer.wait()
    writer.close()


def test_a_failed_part_fails_its_future_wait_and_every_commit_that_lists_it(tmp_path):
    class BrokenStore(CheckpointStore):
        def write_part(self, step, part, tensors, shards=None, attempt=None):
            if part == "optim":
                raise ValueError("optimizer state is not serialisable")
            return super().write_part(step, part, tensors)

    store = BrokenStore(str(tmp_path))
    writer = AsyncCheckpointWriter(store)
    parts = {p: writer.submit(1, p, {"w": torch.zeros(2)}) for p in ("model", "optim")}
    commit = writer.submit_commit(1, parts, {})
    with pytest.raises(ValueError, match="not serialisable"):
        parts["optim"].result(timeout=10)
    with pytest.raises(ValueError, match="not serialisable"):
        commit.result(timeout=10)
    with pytest.raises(ValueError, match="not serialisable"):
        writer.wait()
    writer.wait()  # an error is re-raised once
    writer.close()
    assert store.committed_steps() == []


def test_transient_storage_error_is_retried_and_the_checkpoint_commits(flaky_store):
    FlakyMemoryFS.failures = 1
    with AsyncCheckpointWriter(flaky_store, attempts=3, backoff_s=0.01) as writer:
        part = writer.submit(1, "model", {"w": torch.arange(100.0)})
        writer.submit_commit(1, {"model": part}, {})
        writer.wait()
    assert FlakyMemoryFS.uploads == 2 and writer.retry_delays == [0.01]
    assert torch.equal(flaky_store.read(1)[1]["w"], torch.arange(100.0))


def test_persistent_storage_error_gives_up_after_the_attempts_and_never_commits(flaky_store):
    FlakyMemoryFS.failures = 100
    writer = AsyncCheckpointWriter(flaky_store, attempts=3, backoff_s=0.01)
    part = writer.submit(1, "model", {"w": torch.zeros(4)})
    commit = writer.submit_commit(1, {"model": part}, {})
    with pytest.raises(ConnectionResetError):
        commit.result(timeout=10)
    assert FlakyMemoryFS.uploads == 3
    assert writer.retry_delays == [0.01, 0.02]  # backed off between attempts, doubling
    writer.close()
    assert flaky_store.committed_steps() == []


class HandingOut:
    """A writer whose part writes are the given futures, in order (their ends are scripted)."""

    def __init__(self, *futures: Future):
        self.futures = list(futures)

    def submit(self, step, part, tensors, shards=None, attempt=None):
        return self.futures.pop(0)


def test_a_bounded_flush_reports_the_finished_writes_and_keeps_the_rest_pending():
    """Recovery waits for the survivors' writes no longer than for storage: a write stuck on
    unresponsive storage stays pending instead of holding the call past its deadline."""
    done, stuck = Future(), Future()
    done.set_result({"file": "part0.safetensors"})
    writes = PartWrites(HandingOut(done, stuck))
    for i in range(2):
        writes.submit(4, f"part{i}", {"w": torch.ones(2)}, {}, "a1")
    assert writes.collect(wait=True, timeout=0.05) == [
        WriteReport(4, "part0", info={"file": "part0.safetensors"})]
    stuck.set_exception(OSError("storage unreachable"))
    assert writes.collect(wait=True) == [
        WriteReport(4, "part1", error="OSError: storage unreachable")]
    assert writes.collect(wait=True) == []
