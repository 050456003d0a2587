"""Checkpoint bytes moved at the speed of the disk or network: digests on threads of their own
beside the reads and writes, and object-store reads as parallel ranged requests.

Why: a file's digest is a sequential computation, and computing it between reads or writes
made the transfer wait for it: a local restore ran at 0.46x the raw disk read. hashlib and
xxhash release the GIL, so hashing threads run on other cores while the I/O thread waits on the
kernel or the network; a file hashed in blocks (16 MiB, each verifiable alone) is hashed on
several cores at once. A single streaming GET from an object store is one TCP connection's
bandwidth; several ranged GETs in flight fill the link, each response copied into the memory
its bytes belong in as it arrives (`fetch_into`). A local file's pages go to the disk as
it is written (`EarlyWriteback`), not all at the final fsync, which otherwise waited for the
whole file after it had been copied to the page cache.

The digest detects corruption (a flipped bit, a truncated or swapped file); it is no defence
against someone who can write the checkpoint, who could rewrite its manifest too. So new files
record XXH3-128 (`DIGEST`), which hashes at memory speed where sha256 runs at about a GB/s a
core even with SHA-NI: on a 2-core host, sha256 alone cost a restore from GCS more CPU time
than the transfer (docs/MEASURED.md). Files recorded with sha256 (checkpoints written before)
verify as they were.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec.asyn
import numpy as np
import xxhash

CHUNK = 16 << 20  # bytes per read/write/hash call: large enough to release the GIL usefully
MIN_RANGE = 16 << 20  # bytes per ranged GET at least (see range_size)
MIN_UPLOAD = 64 << 20  # bytes per upload request at least (see upload_size)
RANGES_IN_FLIGHT = min(8, max(2, os.cpu_count() or 2))  # ranged GETs outstanding: one per core
HASH_BACKLOG = 4  # chunks queued for hashing before the I/O thread waits for it
HASH_THREADS = min(4, os.cpu_count() or 1)  # blocks hashed at once (stable buffers)
WRITEBACK = 32 << 20  # bytes written before the kernel is asked to start putting them on disk

_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait for it
_MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14+): fault a range in, writable, now
log = logging.getLogger(__name__)
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


BLOCK = 16 << 20  # bytes per verified block of a part file (a ranged restore's granularity)

# A manifest entry's digest is under the name of its algorithm; hex digits per digest.
DIGESTS: dict[str, tuple[Callable[[], Any], int]] = {
    "xxh3_128": (xxhash.xxh3_128, 32), "sha256": (hashlib.sha256, 64)}
DIGEST = "xxh3_128"  # what new files record


def digest_of(info: dict) -> tuple[str, str] | None:
    """(algorithm, hex digest) recorded in a manifest's file entry, None if it has none."""
    for name in DIGESTS:
        if isinstance(info.get(name), str):
            return name, info[name]
    return None


def digest_hex(algorithm: str, *parts: Any) -> str:
    """The digest of `parts` in order (buffers), as hex; releases the GIL while hashing."""
    h = DIGESTS[algorithm][0]()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def block_root(blocks: list[str], algorithm: str) -> str:
    """The digest of a file hashed in blocks, from its blocks' digests."""
    return digest_hex(algorithm, b"".join(bytes.fromhex(b) for b in blocks))


def copy_bytes(dst: Any, src: Any) -> None:
    """`dst[:] = src` (equal-length byte buffers) with the GIL released, as numpy's copy does.

    Why: a slice assignment between memoryviews holds the GIL for the whole copy, and a copy
    into new tensors also page-faults them in; meanwhile the object-store client's event loop,
    receiving the next responses, waits for the GIL (docs/MEASURED.md: checkpoint save /
    restore on the local S3 and GCS emulators)."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class BackgroundHash:
    """The digest of the buffers given to `update`, in order, computed on threads of its own.

    `algorithm`: one of DIGESTS. With `block_size`, the digest is that of the digests of each
    `block_size` bytes (the last block may be shorter) and `blocks` lists those: a reader can
    verify any block alone, so a restore that needs only some rows of a file reads and checks
    only the blocks holding them, for the same single pass of hashing (docs/CONTRACTS.md
    "Checkpoints"); and blocks are independent, so with `stable` buffers they are hashed on
    HASH_THREADS threads at once. Without, it is the digest of the bytes, on one thread.

    `stable`: the caller keeps every buffer unchanged until `hexdigest` (the tensors it writes
    or reads into). Otherwise `update` returns once at most `backlog` chunks are waiting, so a
    caller that reuses buffers keeps more than `backlog` of them (or calls `wait`), and one
    that hashes temporary copies holds at most `backlog` alive."""

    def __init__(self, data: bytes = b"", backlog: int = HASH_BACKLOG,
                 block_size: int | None = None, stable: bool = False,
                 algorithm: str = DIGEST):
        self.algorithm, self._new = algorithm, DIGESTS[algorithm][0]
        self._h = self._new()
        self._block_size = block_size
        self._parallel = block_size is not None and stable and HASH_THREADS > 1
        self._filled = 0  # bytes in the current block
        self._block = self._new()  # the current block's (sequential)
        self._parts: list[Any] = []  # the current block's buffers (parallel)
        self._futures: list[Future] = []  # each block's digest, in order (parallel)
        self.blocks: list[str] = []
        self._pool = ThreadPoolExecutor(HASH_THREADS if self._parallel else 1,
                                        thread_name_prefix="relaytrain-hash")
        self._pending: collections.deque[Future] = collections.deque()
        self._backlog = backlog
        self._digest: str | None = None
        if self._parallel:
            self.update(data)
        else:
            self._hash(data)

    def _hash(self, buf: Any) -> None:
        if self._block_size is None:
            self._h.update(buf)
        else:
            self._split(buf, lambda piece: self._block.update(piece), self._end_block)

    def _split(self, buf: Any, add: Callable[[Any], None], end: Callable[[], None]) -> None:
        """Give `buf` to the current block (`add`), ending each block that fills (`end`)."""
        view = memoryview(buf).cast("B")
        while len(view):
            take = min(len(view), self._block_size - self._filled)
            add(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self._block_size:
                end()

    def _end_block(self) -> None:
        self.blocks.append(self._block.hexdigest())
        self._h.update(bytes.fromhex(self.blocks[-1]))
        self._block, self._filled = self._new(), 0

    def _submit_block(self) -> None:
        self._futures.append(self._pool.submit(digest_hex, self.algorithm, *self._parts))
        self._parts, self._filled = [], 0

    def update(self, buf: Any) -> None:
        if self._parallel:  # collect `buf` into blocks; hash each full one on the pool
            self._split(buf, lambda piece: self._parts.append(piece), self._submit_block)
            return
        self._pending.append(self._pool.submit(self._hash, buf))
        while len(self._pending) > self._backlog:
            self._pending.popleft().result()

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()
        for f in self._futures:
            f.result()

    def hexdigest(self) -> str:
        if self._digest is None:
            if self._parallel and self._filled:
                self._submit_block()
            self.wait()
            self._pool.shutdown()
            if self._parallel:
                self.blocks = [f.result() for f in self._futures]
                self._digest = block_root(self.blocks, self.algorithm)
                return self._digest
            if self._filled:
                self._end_block()
            self._digest = self._h.hexdigest()
        return self._digest

    def close(self) -> None:
        """Stop without a digest (an error path): drop what is queued."""
        for f in [*self._pending, *self._futures]:
            f.cancel()
        self._pool.shutdown(wait=True)


def hash_stream(src: Any, block_size: int | None = None, algorithm: str = DIGEST,
                ) -> tuple[int, str]:
    """(size, digest) of a readable binary file (see `BackgroundHash`), reading one buffer
    while hashing the other."""
    bufs = [memoryview(bytearray(CHUNK)) for _ in range(2)]
    # one chunk being hashed while the other is read into
    h = BackgroundHash(backlog=1, block_size=block_size, algorithm=algorithm)
    size, i = 0, 0
    try:
        while n := src.readinto(bufs[i]):
            h.update(bufs[i][:n])  # waits for the previous chunk: the other buffer is free
            size += n
            i ^= 1
        return size, h.hexdigest()
    except BaseException:
        h.close()
        raise


class Prefault:
    """The pages of fresh memory (`spans`: address, bytes) faulted in on a thread of its own, in
    order, while the reads that fill it run on another; a context manager that stops the thread
    and waits for it on exit.

    Why: a restore into new tensors pays one page fault per 4 KiB of them (the kernel zeroes
    the page; in a virtual machine the host may fault too). On the reading thread the faults
    add to the transfer: 0.26 s against 0.16 s for 350 MB read from disk into new against
    reused memory on a 2-core AMD EPYC VM, 0.19 s with this thread beside the read (README
    "Measured": checkpoint save / restore). A page the reader reaches first it faults itself,
    and the thread's request for it finds it present: the bytes never depend on who won.
    Without MADV_POPULATE_WRITE (not Linux, or a kernel before 5.14) it does nothing."""

    def __init__(self, spans: Sequence[tuple[int, int]]):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if _libc is not None and spans:
            self._thread = threading.Thread(target=self._fault, args=(list(spans),),
                                            name="relaytrain-prefault", daemon=True)
            self._thread.start()

    def _fault(self, spans: list[tuple[int, int]]) -> None:
        page = mmap.PAGESIZE
        for address, nbytes in spans:
            lo, hi = -(-address // page) * page, (address + nbytes) // page * page
            for a in range(lo, hi, CHUNK):
                if self._stop.is_set() or _libc.madvise(
                        ctypes.c_void_p(a), ctypes.c_size_t(min(CHUNK, hi - a)),
                        _MADV_POPULATE_WRITE):
                    return  # stopped, or the kernel has no such advice: the reader faults

    def __enter__(self) -> Prefault:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class EarlyWriteback:
    """A binary file whose written bytes the kernel starts writing to disk every `WRITEBACK`
    bytes (sync_file_range), so the disk works while the writer copies the next bytes into the
    page cache and the final fsync waits only for the tail. Elsewhere than Linux, the file
    itself."""

    def __init__(self, f: Any):
        self._f, self._fd = f, f.fileno()
        self._written = self._started = 0
        self._start = getattr(_libc, "sync_file_range", None)

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self._written += n
        if self._start is not None and self._written - self._started >= WRITEBACK:
            self._f.flush()
            self._start(self._fd, ctypes.c_longlong(self._started),
                        ctypes.c_longlong(self._written - self._started),
                        ctypes.c_uint(_SYNC_FILE_RANGE_WRITE))  # a failure: the fsync does it
            self._started = self._written
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def range_size(fs: Any) -> int:
    """Bytes per ranged GET from `fs`: the client's own read block size, at least `MIN_RANGE`.

    Why: a request costs the server something whatever its size (moto's S3 emulator copies the
    whole object for each, so small ranges are slow there), while each response arrives as one
    new buffer on the client's event-loop thread, and glibc maps a buffer larger than its
    largest dynamic threshold (32 MiB) afresh each time and unmaps it when freed: 32 MiB ranges
    page-faulted every 4 KiB of a restore in (docs/MEASURED.md: checkpoint save / restore on
    the local S3 and GCS emulators). So the range is what the client's authors chose for their
    service (s3fs 50 MiB; gcsfs 5 MiB, raised to 16 MiB for fewer requests)."""
    return max(MIN_RANGE, _block_size(fs))


def upload_size(fs: Any) -> int:
    """Bytes per request of an upload to `fs` (the block size a file is opened for writing
    with): the client's own block size, at least `MIN_UPLOAD`.

    Why: each request of an upload costs a round trip and the server's work to append it;
    with gcsfs's 5 MiB block every 16 MiB write (`CHUNK`) went as a request of its own, and a
    350 MB save to the GCS emulator took 5.9-10.7 s where 64 MiB pieces took 3.2-5.0 s (README
    "Measured": checkpoint save / restore on the local S3 and GCS emulators). The client holds
    one block in memory per file being written."""
    return max(MIN_UPLOAD, _block_size(fs))


def _block_size(fs: Any) -> int:
    return int(getattr(fs, "default_block_size", 0) or 0)


def fetch_into(fs: Any, path: str, start: int, views: Sequence[memoryview]) -> None:
    """Bytes [start, start + the views' total length) of `path` into `views`, in order, by one
    ranged GET; EOFError if the file holds fewer.

    Why: a client's `cat_file` assembles each response into a new bytes object (aiohttp joins
    the body's pieces), which the reader then copies to where the bytes belong: every byte
    copied twice, on a host whose cores the transfer already keeps busy. A GCS response is
    copied into `views` piece by piece as it arrives, over gcsfs's own session, credentials and
    URL (`_streamed_get`): the client's CPU for a restore from the GCS emulator went from 0.38
    to 0.26 s, and the restore into new tensors from 0.69-0.86x to 0.80-1.20x the raw GET
    (docs/MEASURED.md: checkpoint save / restore on the local S3 and GCS emulators). Any
    failure there (a transient error, a gcsfs that has changed) and every other client take
    `cat_file`, with the client's own retries and errors; the bytes are verified against the
    manifest either way."""
    total = sum(len(v) for v in views)
    if not total:
        return
    if _streams(fs):
        try:
            fsspec.asyn.sync(fs.loop, _streamed_get, fs, path, start, views)
            return
        except Exception as e:  # the client's own path below retries, and says what failed
            log.debug("streamed GET of %s at %d failed (%r): fetching it through cat_file",
                      path, start, e)
    data = memoryview(fs.cat_file(path, start=start, end=start + total))
    if len(data) != total:
        raise EOFError(f"{path}: {len(data)} bytes at {start}, expected {total}")
    for view in views:
        copy_bytes(view, data[:len(view)])
        data = data[len(view):]


def _streams(fs: Any) -> bool:
    core = sys.modules.get("gcsfs.core")  # loaded whenever `fs` is a GCS filesystem
    return core is not None and isinstance(fs, core.GCSFileSystem)


async def _streamed_get(fs: Any, path: str, start: int, views: Sequence[memoryview]) -> None:
    total = sum(len(v) for v in views)
    zonal = getattr(fs, "_is_zonal_bucket", None)  # gcsfs reads those over gRPC instead
    if zonal is not None and await zonal(fs.split_path(path)[0]):
        raise OSError("a zonal bucket")
    await fs._set_session()
    headers = fs._get_headers({"Range": f"bytes={start}-{start + total - 1}"})
    async with fs.session.get(fs.url(path), params=fs._get_params({}), headers=headers,
                              timeout=fs.requests_timeout) as r:
        if r.status != 206:
            raise OSError(f"HTTP {r.status} to a ranged GET")
        parts, view, at, got = iter(views), memoryview(b""), 0, 0
        async for piece in r.content.iter_any():
            data = memoryview(piece)
            got += len(data)
            while len(data):
                while at == len(view):
                    view, at = next(parts, None), 0
                    if view is None:
                        raise OSError(f"a response longer than the {total} bytes asked for")
                n = min(len(data), len(view) - at)
                view[at:at + n] = data[:n]
                at, data = at + n, data[n:]
        if got != total:
            raise OSError(f"a response of {got} bytes, {total} asked for")


class RangedReader:
    """A read-only binary stream over an fsspec file of `size` bytes, fetched as parallel
    ranged requests (`RANGES_IN_FLIGHT` at once, `fetch_into`) of at most `range_size(fs)`
    bytes, delivered in order; a context manager that cancels what is still queued on exit.

    `read` (a header's few bytes), then `fill` (the bytes that follow, straight into the memory
    they belong in) or `readinto` (a stream: the reader's own buffers, copied out). Every
    request in flight costs the client a buffer and CPU to receive it (one event loop receives
    them all); one request per core (2 to 8) was the fastest measured against both local
    emulators (docs/MEASURED.md: checkpoint save / restore on the local S3 and GCS emulators)."""

    def __init__(self, fs: Any, path: str, size: int):
        self._fs, self._path, self._size = fs, path, size
        self._range = range_size(fs)
        self._pool = ThreadPoolExecutor(RANGES_IN_FLIGHT, thread_name_prefix="relaytrain-get")
        self._queue: collections.deque[tuple[Any, Future]] = collections.deque()
        self._pos = 0  # of the next byte asked for
        self._stream: Iterator[memoryview] | None = None  # readinto's
        self._current, self._at = memoryview(b""), 0

    def read(self, n: int) -> bytes:
        """The next `n` bytes; EOFError past the end. The first read fetches a whole range, so
        a header and the bytes after it come in one request (moto copies the whole object for
        each request it serves) and `fill` starts with what is left of it."""
        have = len(self._current) - self._at
        if have < n:
            more = memoryview(bytearray(min(self._size - self._pos, max(n - have, self._range))))
            fetch_into(self._fs, self._path, self._pos, [more])
            self._pos += len(more)
            self._current = more if not have else \
                memoryview(bytes(self._current[self._at:]) + bytes(more))
            self._at = 0
        if len(self._current) - self._at < n:
            raise EOFError(f"{self._path}: shorter than expected")
        self._at += n
        return bytes(self._current[self._at - n:self._at])

    def gets(self, requests: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
        """Each request (file offset, the views it fills, anything else the caller attaches)
        fetched, `RANGES_IN_FLIGHT` at once, and given back in order once filled. Requests are
        taken from `requests` only as others finish, so the memory a caller hands out ahead
        stays bounded."""
        requests = iter(requests)

        def submit() -> bool:
            request = next(requests, None)
            if request is not None:
                self._queue.append((request, self._pool.submit(
                    fetch_into, self._fs, self._path, request[0], request[1])))
            return request is not None

        while len(self._queue) < RANGES_IN_FLIGHT and submit():
            pass
        while self._queue:
            request, response = self._queue[0]
            response.result()
            self._queue.popleft()
            submit()
            yield request

    def fill(self, views: Iterable[memoryview]) -> Iterator[memoryview]:
        """The bytes from the position on, into `views` in order, each view given back once
        filled. Consecutive views share a request up to the range size; a view that crosses a
        range's end is split between two."""
        ahead, self._current, self._at = self._current[self._at:], memoryview(b""), 0
        return (view for *_, ended in self.gets(self._requests(ahead, views))
                for view in ended)

    def _requests(self, ahead: memoryview, views: Iterable[memoryview]
                  ) -> Iterator[tuple[int, list[memoryview], list[memoryview]]]:
        """(offset, the pieces of views it fills, the views whose last bytes it fills), after
        the bytes fetched `ahead` (by `read`) are copied into the first views."""
        start, parts, ended, room = self._pos, [], [], self._range
        for view in views:
            rest = memoryview(view).cast("B")
            if len(ahead):
                n = min(len(rest), len(ahead))
                copy_bytes(rest[:n], ahead[:n])
                rest, ahead = rest[n:], ahead[n:]
            while len(rest):
                take = min(len(rest), room)
                parts.append(rest[:take])
                rest, room, self._pos = rest[take:], room - take, self._pos + take
                if room == 0 and len(rest):
                    yield start, parts, ended
                    start, parts, ended, room = self._pos, [], [], self._range
            ended.append(view)
            if room == 0:
                yield start, parts, ended
                start, parts, ended, room = self._pos, [], [], self._range
        if parts or ended:
            yield start, parts, ended

    def readinto(self, buf: Any) -> int:
        out, filled = memoryview(buf).cast("B"), 0
        while filled < len(out):
            if self._at == len(self._current):
                if self._stream is None:
                    self._stream = self.fill(memoryview(bytearray(min(self._range,
                                                                      self._size - s)))
                                             for s in range(self._pos, self._size, self._range))
                self._current, self._at = next(self._stream, memoryview(b"")), 0
                if not len(self._current):
                    break
            n = min(len(out) - filled, len(self._current) - self._at)
            copy_bytes(out[filled:filled + n], self._current[self._at:self._at + n])
            filled += n
            self._at += n
        return filled

    def close(self) -> None:
        for _, response in self._queue:
            response.cancel()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RangedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileReader:
    """A local file read as `RangedReader` reads an object: `read`, then `fill` (straight into
    the views, one read each) or `readinto`; EOFError where it ends early."""

    def __init__(self, path: str):
        self._f = open(path, "rb", buffering=0)

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        if self._f.readinto(buf) != n:
            raise EOFError(f"{self._f.name}: shorter than expected")
        return bytes(buf)

    def fill(self, views: Iterable[memoryview]) -> Iterator[memoryview]:
        for view in views:
            if self._f.readinto(view) != len(view):
                raise EOFError(f"{self._f.name}: shorter than expected")
            yield view

    def readinto(self, buf: Any) -> int:
        return self._f.readinto(buf)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
