"""Background checkpoint writes, so the step loop only pays for a host copy.

At a step boundary the caller takes `snapshot_to_host(state)` (training may then mutate the
originals) and hands it to `AsyncCheckpointWriter.submit`; one background thread writes it
while training continues. Hashing and file I/O release the GIL, so the overlap is real. A
worker keeps its parts in flight in `PartWrites`, which reports each once done (`WriteReport`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.storage import is_space_error, is_transient, redact

log = logging.getLogger(__name__)
T = TypeVar("T")


def snapshot_to_host(tensors: dict[str, torch.Tensor],
                     out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies of `tensors`, independent of the originals.

    CUDA tensors are copied into pinned memory without blocking, then each device is
    synchronised once, so the copies overlap each other and the caller sees finished tensors.
    `out` (a previous snapshot whose write has finished) is reused where shapes and dtypes
    match: allocating and first touching host memory, pinned above all, costs more than the
    copy itself.
    """
    snap: dict[str, torch.Tensor] = {}
    cuda_devices = set()
    for k, t in tensors.items():
        t = t.detach()
        buf = (out or {}).get(k)
        if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                or (t.is_cuda and not buf.is_pinned())):
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        snap[k] = buf.copy_(t, non_blocking=t.is_cuda)
        if t.is_cuda:
            cuda_devices.add(t.device)
    for device in cuda_devices:
        torch.cuda.synchronize(device)
    return snap


class AsyncCheckpointWriter:
    """Writes checkpoint parts and commits on one background thread, in submission order.

    `submit` blocks while `max_pending` part writes are unfinished: each pending write holds a
    host snapshot, so this bounds memory, and a step loop that outpaces storage slows down
    instead of piling up snapshots. Transient errors (`storage.is_transient`: connection
    failures, timeouts, throttling) are retried `attempts` times with exponential backoff from
    `backoff_s`; a write that meets a full disk releases what retention allows and is tried
    once more; a part that still fails fails its Future, `wait()`, and every commit that lists
    it, so a failed write never becomes a committed checkpoint.
    """

    def __init__(self, store: CheckpointStore, max_pending: int = 1, attempts: int = 4,
                 backoff_s: float = 0.5):
        if max_pending < 1 or attempts < 1:
            raise ValueError(f"max_pending and attempts must be >= 1, got {max_pending}, "
                             f"{attempts}")
        self.store = store
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.retry_delays: list[float] = []  # every backoff taken, in order: retries are visible
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._slots = threading.BoundedSemaphore(max_pending)
        self._futures: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, step: int, part: str, tensors: dict[str, torch.Tensor],
               shards: dict[str, dict[str, list[int]]] | None = None,
               attempt: str | None = None) -> Future[dict]:
        """Queue `store.write_part(step, part, tensors, shards, attempt)`; the Future yields
        its part record.

        `tensors` must not change until the Future is done: pass a `snapshot_to_host` copy.
        """
        self._slots.acquire()
        try:
            # A part write rewrites its whole file, so it may also start over after a
            # FileNotFoundError: the only thing it can miss is an upload session (S3 multipart,
            # GCS resumable) that a restarted server no longer knows.
            fut = self._pool.submit(self._retry, self.store.write_part, step, part, tensors,
                                    shards, attempt, also=(FileNotFoundError,))
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _: self._slots.release())
        return self._track(fut)

    def submit_commit(self, step: int, parts: dict[str, Future[dict] | dict],
                      meta: dict) -> Future[str]:
        """Queue `store.commit` after the parts submitted before it; the Future yields its URL.

        `parts` may hold this writer's Futures (or finished part records); if any of them
        failed, the commit fails with that error and nothing is committed.
        """
        def commit() -> str:
            records = {p: (r.result() if isinstance(r, Future) else r) for p, r in parts.items()}
            return self._retry(self.store.commit, step, records, meta)

        return self._track(self._pool.submit(commit))

    def wait(self) -> None:
        """Block until everything submitted so far is written; re-raise the first error."""
        with self._lock:
            futures, self._futures = self._futures, []
        wait_all(futures)
        for fut in futures:
            if fut.exception() is not None:
                raise fut.exception()

    def close(self) -> None:
        """Finish everything submitted and stop the thread.

        Errors stay on their Futures (and `wait`) rather than being raised here, so `close` is
        safe in cleanup paths that already handled them or are unwinding another error.
        """
        self._pool.shutdown(wait=True)

    def __enter__(self) -> AsyncCheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _track(self, fut: Future) -> Future:
        with self._lock:
            self._futures = [f for f in self._futures if not f.done() or f.exception()]
            self._futures.append(fut)
        return fut

    def _retry(self, fn: Callable[..., T], *args: Any,
               also: tuple[type[Exception], ...] = ()) -> T:
        attempt = 1
        released = False
        while True:
            try:
                return fn(*args)
            except Exception as e:
                if is_space_error(e) and not released:
                    # A full disk: what retention would delete once this save commits goes
                    # first (CheckpointStore.release_for_space), then one more try.
                    released = True
                    steps = self.store.release_for_space()
                    if steps:
                        log.warning("checkpoint %s failed (%s); released checkpoint steps %s "
                                    "to make room, trying again", fn.__name__, e, steps)
                        continue
                # Not only OSError: s3fs lets botocore's connection errors through unchanged.
                if not (is_transient(e) or isinstance(e, also)) or attempt == self.attempts:
                    raise
                delay = self.backoff_s * 2 ** (attempt - 1)
                attempt += 1
                self.retry_delays.append(delay)
                log.warning("checkpoint %s failed (%s: %s); attempt %d/%d in %.2fs",
                            fn.__name__, type(e).__name__, redact(str(e)), attempt,
                            self.attempts, delay)
                time.sleep(delay)


@dataclass(frozen=True)
class WriteReport:
    """A checkpoint part this worker finished writing in the background (or failed to)."""

    step: int
    part: str
    info: dict[str, Any] | None = None  # the part's files, as the manifest records them
    error: str | None = None  # set when the write failed; the step is then not committed


class PartWrites:
    """One worker's checkpoint parts in flight on its `writer`, and the reports of those done:
    the controller commits a step once every part's report says written."""

    def __init__(self, writer: AsyncCheckpointWriter):
        self.writer = writer
        self._pending: list[tuple[int, str, Future[dict]]] = []

    def submit(self, step: int, part: str, tensors: dict[str, torch.Tensor],
               shards: dict[str, dict[str, list[int]]], attempt: str) -> None:
        """Copy `tensors` to host memory now and write them in the background as `part` of
        the save `attempt` of `step` (`shards`: the rows they are of, when sharded)."""
        self._pending.append((step, part, self.writer.submit(
            step, part, snapshot_to_host(tensors), shards=shards or None, attempt=attempt)))

    def collect(self, wait: bool, timeout: float | None = None) -> list[WriteReport]:
        """Reports of the finished writes; with `wait`, of all once finished (within `timeout`
        seconds, if given: the rest stay pending)."""
        if wait and timeout is not None:
            wait_all([fut for *_, fut in self._pending], timeout)
            wait = False
        done, keep = [], []
        for step, part, fut in self._pending:
            if not wait and not fut.done():
                keep.append((step, part, fut))
                continue
            try:
                done.append(WriteReport(step, part, info=fut.result()))
            except Exception as e:  # reported to the controller, which will not commit
                done.append(WriteReport(step, part, error=f"{type(e).__name__}: {e}"))
        self._pending = keep
        return done

    def close(self) -> None:
        """Finish every write (their reports are dropped) and stop the writer's thread."""
        self.collect(wait=True)
        self.writer.close()
