"""Checkpoint bytes hashed beside the I/O and fetched as parallel ranged reads: the same
digests and bytes as a plain sequential pass, and the safetensors format unchanged both ways."""

from __future__ import annotations

import hashlib
import json
import os
import random

import fsspec
import pytest
import safetensors.torch
import torch
import xxhash

import relaytrain.checkpoint.streaming as streaming
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.checkpoint.streaming import (
    DIGEST,
    BackgroundHash,
    RangedReader,
    block_root,
    hash_stream,
    range_size,
    upload_size,
)
from relaytrain.errors import CheckpointError


@pytest.mark.parametrize("algorithm,reference", [("xxh3_128", xxhash.xxh3_128),
                                                 ("sha256", hashlib.sha256)])
def test_background_hash_is_the_digest_of_the_chunks_in_order(algorithm, reference):
    """XXH3-128 by default (what new checkpoints record); sha256 for the ones recorded before."""
    chunks = [os.urandom(n) for n in (0, 1, 5000, 3 << 20, 17)]
    h = BackgroundHash(b"head", backlog=2, **({} if algorithm == DIGEST else
                                              {"algorithm": algorithm}))
    for c in chunks:
        h.update(memoryview(c))
    assert h.hexdigest() == reference(b"head" + b"".join(chunks)).hexdigest()


def test_hash_stream_reuses_two_buffers_without_mixing_them(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "CHUNK", 4096)  # many chunks through the two buffers
    data = os.urandom(4096 * 9 + 123)
    (tmp_path / "f").write_bytes(data)
    with open(tmp_path / "f", "rb") as f:
        assert hash_stream(f) == (len(data), xxhash.xxh3_128(data).hexdigest())


@pytest.mark.parametrize("read_size", [1, 999, 1000, 4096, 1 << 20])
def test_ranged_reader_delivers_the_file_in_order(tmp_path, monkeypatch, slow_ranges, read_size):
    monkeypatch.setattr(streaming, "MIN_RANGE", 1000)  # 11 ranges, RANGES_IN_FLIGHT at once
    data = os.urandom(10_500)
    path = str(tmp_path / "f")
    (tmp_path / "f").write_bytes(data)
    fs = fsspec.filesystem("file")
    requests = slow_ranges(fs, delay=0)
    got = bytearray()
    with RangedReader(fs, path, len(data)) as src:
        buf = bytearray(read_size)
        while n := src.readinto(buf):
            got += buf[:n]
    assert bytes(got) == data
    assert sorted(start for start, _ in requests.calls) == list(range(0, len(data), 1000))


def test_fill_puts_the_bytes_after_the_header_into_the_callers_views_in_order(
        tmp_path, monkeypatch, slow_ranges):
    """Views of any length (empty, inside one range, across ranges' ends) get the file's bytes
    from the position on, and each is given back once filled, in order; a request never spans
    more than a range, no more than RANGES_IN_FLIGHT are out at once, and a header read first
    costs no request of its own."""
    monkeypatch.setattr(streaming, "MIN_RANGE", 1000)
    data = os.urandom(10_500)
    (tmp_path / "f").write_bytes(data)
    fs = fsspec.filesystem("file")
    requests = slow_ranges(fs, delay=0.005)
    views = [memoryview(bytearray(n)) for n in (0, 1, 999, 2500, 0, 1000, 3, 5989, 0)]
    with RangedReader(fs, str(tmp_path / "f"), len(data)) as src:
        assert src.read(8) == data[:8]
        given = list(src.fill(iter(views)))
    assert all(g is v for g, v in zip(given, views, strict=True))
    assert b"".join(bytes(v) for v in views) == data[8:]
    # the header came with the first range: one request per range, none more
    assert sorted(requests.calls) == [(a, min(a + 1000, len(data))) for a in range(0, 10_500, 1000)]
    assert requests.most <= streaming.RANGES_IN_FLIGHT


def test_a_header_longer_than_a_range_is_read_whole_before_fill(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "MIN_RANGE", 16)
    data = os.urandom(300)
    (tmp_path / "f").write_bytes(data)
    with RangedReader(fsspec.filesystem("file"), str(tmp_path / "f"), len(data)) as src:
        head = src.read(8) + src.read(50) + src.read(5)  # past the first range, then within
        views = [memoryview(bytearray(n)) for n in (7, 100, 130)]
        assert list(src.fill(views)) == views
    assert head + b"".join(bytes(v) for v in views) == data


def test_fill_takes_views_only_as_requests_finish(tmp_path, monkeypatch, slow_ranges):
    """A caller may allocate its views as they are asked for: no more than RANGES_IN_FLIGHT
    requests' worth is taken ahead of the one given back."""
    monkeypatch.setattr(streaming, "MIN_RANGE", 100)
    (tmp_path / "f").write_bytes(os.urandom(2_000))
    fs = fsspec.filesystem("file")
    slow_ranges(fs, delay=0.005)
    taken = []

    def views():
        for i in range(20):
            taken.append(i)
            yield memoryview(bytearray(100))

    with RangedReader(fs, str(tmp_path / "f"), 2_000) as src:
        for n, _ in enumerate(src.fill(views())):
            assert len(taken) <= n + 1 + streaming.RANGES_IN_FLIGHT
    assert len(taken) == 20


def test_fill_past_the_end_of_the_file_is_an_eof_error(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(500))
    with RangedReader(fsspec.filesystem("file"), str(tmp_path / "f"), 500) as src:
        with pytest.raises(EOFError):
            list(src.fill([memoryview(bytearray(300)), memoryview(bytearray(300))]))


def _gcs_store(server) -> tuple[CheckpointStore, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(300_000, generator=g), "b": torch.randn(0, 3),
             "c": torch.randn(70_001, generator=g).to(torch.bfloat16)}
    store = CheckpointStore(server.url("ckpt"))
    store.commit(1, {"model": store.write_part(1, "model", state)}, {})
    return store, state


def test_a_gcs_restore_streams_each_response_into_the_tensors(gcs_server, monkeypatch,
                                                              slow_ranges):
    """No range of a GCS restore goes through `cat_file` (which assembles a response in new
    bytes before the copy): responses are copied into the tensors as they arrive, over the
    client's own session; the tensors are the checkpoint's."""
    monkeypatch.setattr(streaming, "range_size", lambda fs: 256 << 10)  # a few ranges
    store, state = _gcs_store(gcs_server)
    streamed = []
    real = streaming._streamed_get

    async def counted(fs, path, start, views):
        streamed.append(start)
        await real(fs, path, start, views)

    monkeypatch.setattr(streaming, "_streamed_get", counted)
    requests = slow_ranges(store.fs, delay=0)
    _, got = store.read(1)
    assert all(torch.equal(got[k], t) for k, t in state.items())
    assert requests.calls == [] and len(streamed) > 3


def test_a_failed_streamed_get_is_fetched_again_through_the_client(gcs_server, monkeypatch,
                                                                   slow_ranges):
    """A response that breaks off midway (its bytes half written) is fetched again through
    `cat_file`, with the client's own retries; the tensors are the checkpoint's."""
    monkeypatch.setattr(streaming, "range_size", lambda fs: 256 << 10)
    store, state = _gcs_store(gcs_server)

    async def broken(fs, path, start, views):
        views[0][:1] = b"\xff"  # what arrived before the connection dropped
        raise OSError("connection reset")

    monkeypatch.setattr(streaming, "_streamed_get", broken)
    requests = slow_ranges(store.fs, delay=0)
    _, got = store.read(1)
    assert all(torch.equal(got[k], t) for k, t in state.items()) and len(requests.calls) > 3


def test_a_zonal_bucket_is_read_through_the_client(gcs_server, monkeypatch, slow_ranges):
    """gcsfs reads a zonal bucket's objects over gRPC: its ranges are never streamed."""
    monkeypatch.setattr(streaming, "range_size", lambda fs: 256 << 10)
    store, state = _gcs_store(gcs_server)

    async def zonal(bucket):
        return True

    monkeypatch.setattr(store.fs, "_is_zonal_bucket", zonal, raising=False)
    requests = slow_ranges(store.fs, delay=0)
    _, got = store.read(1)
    assert all(torch.equal(got[k], t) for k, t in state.items()) and len(requests.calls) > 3


def test_ranges_are_the_clients_block_size_and_at_least_min_range():
    """s3fs reads 50 MiB blocks (fewer requests); gcsfs's 5 MiB is raised to 16 MiB; a client
    without a block size of its own gets MIN_RANGE. Uploads go in pieces of at least 64 MiB."""
    s3fs = pytest.importorskip("s3fs")
    gcsfs = pytest.importorskip("gcsfs")
    assert range_size(s3fs.S3FileSystem(anon=True, skip_instance_cache=True)) == 50 << 20
    assert range_size(gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)) == 16 << 20
    assert range_size(fsspec.filesystem("memory")) == streaming.MIN_RANGE == 16 << 20
    assert upload_size(s3fs.S3FileSystem(anon=True, skip_instance_cache=True)) == 64 << 20
    assert upload_size(gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)) == 64 << 20


def test_no_more_than_ranges_in_flight_are_requested_at_once(tmp_path, monkeypatch,
                                                            slow_ranges):
    """Memory in flight is bounded: RANGES_IN_FLIGHT requests of range_size bytes."""
    monkeypatch.setattr(streaming, "MIN_RANGE", 100)
    (tmp_path / "f").write_bytes(os.urandom(2_000))
    fs = fsspec.filesystem("file")
    requests = slow_ranges(fs)
    with RangedReader(fs, str(tmp_path / "f"), 2_000) as src:
        assert src.readinto(bytearray(2_000)) == 2_000
    assert requests.most == streaming.RANGES_IN_FLIGHT


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.w": torch.randn(300, 7, generator=g),
            "model.b": torch.randn(5, generator=g).to(torch.bfloat16),
            "optim.step": torch.tensor(3, dtype=torch.int64), "model.empty": torch.zeros(0, 4)}


def test_files_we_write_load_with_safetensors_and_theirs_with_us(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    info = store.write_part(1, "model", state())
    store.commit(1, {"model": info}, {})
    ours = tmp_path / "ckpt" / "step_00000001" / "model.safetensors"
    for k, t in safetensors.torch.load_file(ours).items():
        assert torch.equal(t, state()[k]), k
    theirs = tmp_path / "theirs.safetensors"  # their layout: their own order and padding
    safetensors.torch.save_file(state(), theirs)
    data = theirs.read_bytes()
    ours.write_bytes(data)
    manifest = ours.parent / "manifest.json"
    m = json.loads(manifest.read_text())
    m["files"]["model.safetensors"] = {"size": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}
    manifest.write_text(json.dumps(m))
    _, tensors = store.read(1)
    assert tensors.keys() == state().keys()
    assert all(torch.equal(tensors[k], t) for k, t in state().items())


def test_a_header_whose_offsets_do_not_tile_the_data_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.commit(1, {"model": store.write_part(1, "model", state())}, {})
    part = tmp_path / "ckpt" / "step_00000001" / "model.safetensors"
    data = part.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["model.w"]["data_offsets"][1] -= 4  # a gap before the next tensor
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    forged = data[:8] + raw + data[8 + n:]
    part.write_bytes(forged)
    manifest = part.parent / "manifest.json"
    m = json.loads(manifest.read_text())
    entry = m["files"]["model.safetensors"]  # vouch for the forged bytes
    size = entry["block_size"]
    entry["blocks"] = [xxhash.xxh3_128(forged[i:i + size]).hexdigest()
                       for i in range(0, len(forged), size)]
    entry["xxh3_128"] = block_root(entry["blocks"], "xxh3_128")
    manifest.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="not a valid safetensors file.*model.w"):
        store.read(1)


@pytest.mark.parametrize("block", [7, 64, 1000])
def test_blocks_hashed_in_parallel_give_the_sequential_digests(block, monkeypatch):
    """Stable buffers are cut into blocks hashed on several threads; the digests are the ones
    one thread computes, whatever the buffers' sizes."""
    monkeypatch.setattr("relaytrain.checkpoint.streaming.HASH_THREADS", 3)
    rng = random.Random(block)
    data = bytes(rng.getrandbits(8) for _ in range(3000))
    cuts = sorted(rng.sample(range(1, len(data)), 40))
    bufs = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    one, many = BackgroundHash(block_size=block), BackgroundHash(block_size=block, stable=True)
    for buf in bufs:
        one.update(buf)
        many.update(buf)
    blocks = [xxhash.xxh3_128(data[i:i + block]).hexdigest()
              for i in range(0, len(data), block)]
    assert many.hexdigest() == one.hexdigest() == block_root(blocks, "xxh3_128")
    assert many.blocks == one.blocks == blocks


class _Recorded:
    """libc as the streaming module calls it, recording sync_file_range's ranges."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self._libc = streaming._libc

    def sync_file_range(self, fd, offset, nbytes, flags):
        self.ranges.append((offset.value, nbytes.value))
        return self._libc.sync_file_range(fd, offset, nbytes, flags)

    def __getattr__(self, name):
        return getattr(self._libc, name)


@pytest.mark.skipif(streaming._libc is None, reason="sync_file_range is Linux's")
def test_a_local_part_goes_to_disk_while_it_is_written(tmp_path, monkeypatch):
    """Writeback is started for every WRITEBACK bytes as they are written, in order, so the
    final fsync waits only for the tail; the file is the same."""
    libc = _Recorded()
    monkeypatch.setattr(streaming, "_libc", libc)
    monkeypatch.setattr(streaming, "WRITEBACK", 1 << 20)
    tensors = {f"w{i}": torch.randn(300_000) for i in range(4)}  # 4.8 MB
    record = CheckpointStore(str(tmp_path)).write_part(1, "model", tensors)
    starts = [0, *[a + n for a, n in libc.ranges]]
    assert [a for a, _ in libc.ranges] == starts[:-1]  # contiguous from the first byte
    assert all(n >= 1 << 20 for _, n in libc.ranges)
    assert 0 <= record["size"] - starts[-1] < 1 << 20  # all but the tail, before the fsync
    loaded = safetensors.torch.load_file(tmp_path / "step_00000001" / "model.safetensors")
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())


def _resident_pages(address: int, nbytes: int) -> int:
    """Pages of [address, address + nbytes) in memory now (mincore)."""
    import ctypes
    import mmap

    pages = nbytes // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert streaming._libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0
    return sum(v & 1 for v in vec)


def _populate_supported() -> bool:
    import ctypes
    import mmap

    if streaming._libc is None:
        return False
    m = mmap.mmap(-1, mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(m))
    ok = streaming._libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(mmap.PAGESIZE),
                                 streaming._MADV_POPULATE_WRITE) == 0
    del address
    m.close()
    return ok


@pytest.mark.skipif(not _populate_supported(), reason="MADV_POPULATE_WRITE: Linux 5.14+")
def test_prefault_brings_fresh_memory_in_without_the_reader_touching_it():
    """The pages of every span become resident on Prefault's thread, the reader untouched;
    leaving the context stops and joins it."""
    import ctypes
    import mmap
    import time

    size = 3 * streaming.CHUNK + 5 * mmap.PAGESIZE  # several madvise calls and a tail
    maps = [mmap.mmap(-1, size), mmap.mmap(-1, 2 * mmap.PAGESIZE)]
    spans = [(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m)) for m in maps]
    assert all(_resident_pages(*s) == 0 for s in spans)  # fresh: nothing faulted in yet
    with streaming.Prefault(spans) as p:
        deadline = time.monotonic() + 30
        while (any(_resident_pages(a, n) < n // mmap.PAGESIZE for a, n in spans)
               and time.monotonic() < deadline):
            time.sleep(0.01)
    assert [_resident_pages(*s) for s in spans] == [n // mmap.PAGESIZE for _, n in spans]
    assert not p._thread.is_alive()
    assert all(not any(m[:]) for m in maps)  # faulted in as zeroes, not written


def test_a_restore_prefaults_only_the_memory_it_allocates(tmp_path, monkeypatch):
    """Tensors read in place (`into`) are the caller's and already in memory; only those the
    restore allocates are handed to Prefault, in file order, and the bytes read are the same."""
    import relaytrain.checkpoint.reading as reading_module

    spans_seen = []

    class Recorded(streaming.Prefault):
        def __init__(self, spans):
            spans_seen.append(list(spans))
            super().__init__(spans)

    monkeypatch.setattr(reading_module, "Prefault", Recorded)
    state = {"a": torch.randn(1000), "b": torch.randn(50, 40), "c": torch.randn(3)}
    store = CheckpointStore(str(tmp_path))
    store.commit(1, {"model": store.write_part(1, "model", state)}, {})
    live = {"b": torch.zeros(50, 40)}
    _, restored = store.read(1, into=live)
    assert restored["b"] is live["b"]
    assert all(torch.equal(restored[k], t) for k, t in state.items())
    assert spans_seen == [[(restored[k].data_ptr(), restored[k].nbytes) for k in ("a", "c")]]
    spans_seen.clear()  # rows: the same for the pieces a sharded restore reads
    mine = torch.zeros(4, 40)
    _, rows = store.read(1, rows={"b": (2, 6)}, into={"b": mine})
    assert rows["b"] is mine and torch.equal(mine, state["b"][2:6])
    assert spans_seen == [[(rows[k].data_ptr(), rows[k].nbytes) for k in ("a", "c")]]
