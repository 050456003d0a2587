"""The checkpoint catalogue: which checkpoints exist, which are being written, and when one may
be committed.

Workers write their parts in the background and report them (`WriteReport`); a checkpoint is
committed (its manifest written, docs/CONTRACTS.md "Checkpoints") only once every expected part
arrived. Storage that is unavailable (a transient error) never stops training: a commit that
meets it stays pending and is retried after the next step; only the end of a run and a restore
wait for storage, up to STORAGE_WAIT_S.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from relaytrain import storage
from relaytrain.checkpoint.store import CheckpointStore, CheckpointWarning
from relaytrain.errors import CheckpointError, warn
from relaytrain.runtime.wire import WriteReport

# How long the end of a run (deferred commits) and a restore from checkpoints wait for storage
# that is unavailable.
STORAGE_WAIT_S = 30.0

T = TypeVar("T")


@dataclass
class PendingCheckpoint:
    step: int
    parts: dict[str, dict] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)
    failed: bool = False
    deferred: bool = False  # its commit met unavailable storage and is retried
    attempt: str = ""  # names this save of the step (its part records carry it)
    reported: set[str] = field(default_factory=set)  # parts whose writes returned


@dataclass(frozen=True)
class FailedSave:
    """A save that will not be committed: its step and why."""

    step: int
    error: str


class StorageUnavailable(Exception):
    """Some commit is still deferred by unavailable storage."""


class WorkNotSaved(Exception):
    """The run stopped, or ended, with trained steps that no committed checkpoint holds: the
    final checkpoint failed, or checkpoint.max_unsaved_steps was exceeded (exit EXIT_CODE)."""

    EXIT_CODE = 3


def wait_for_storage(attempt: Callable[[], T], url: str, what: str,
                     seconds: float = STORAGE_WAIT_S, poll: float = 0.5) -> T:
    """`attempt()`, tried again while it fails with a transient storage error, for up to
    `seconds`; the last error is raised after that. `what` ends the one warning."""
    deadline = time.monotonic() + seconds
    warned = False
    while True:
        try:
            return attempt()
        except Exception as e:
            if not (storage.is_transient(e) or isinstance(e, StorageUnavailable)) \
                    or time.monotonic() > deadline:
                raise
            if not warned:
                warn(f"checkpoint storage {storage.redact(url)} is unavailable "
                     f"({type(e).__name__}); waiting up to {seconds:g}s {what}")
                warned = True
            time.sleep(poll)


def prove_writable(url: str, key: str) -> None:
    """`storage.probe_writable(url)`, waiting out unavailable storage as a restore does; a
    `StorageError` naming config key `key` and the error if the location refuses it."""
    try:
        wait_for_storage(lambda: storage.probe_writable(url), url, "to prove it writable")
    except Exception as e:
        raise storage.StorageError(
            f"config key {key!r}: {storage.redact(url)} is not writable ({type(e).__name__}: "
            f"{storage.one_line(e)}); nothing was trained: give a location this process can "
            "write, read and delete in") from None


class CheckpointCatalogue:
    def __init__(self, store: CheckpointStore, manifest_meta: Callable[[int], dict[str, Any]],
                 on_failed_write: Callable[[int], None] = lambda step: None):
        self.store = store
        self.manifest_meta = manifest_meta  # step -> what the manifest records beside files
        self.on_failed_write = on_failed_write
        self.pending: list[PendingCheckpoint] = []
        self.last_committed = 0
        self.failures: list[FailedSave] = []  # failed saves not yet taken (take_failures)
        self.base = 0  # the step the run started at (0, or a continued run's source's)

    def newest_good_manifest(self, start_over: bool = False) -> dict[str, Any] | None:
        """The newest committed checkpoint whose files all verify; broken ones are skipped
        with a warning naming the file. If there are checkpoints and none verifies, that is an
        error unless `start_over` (training again from step 0 costs the run its compute)."""
        broken = []
        for step in reversed(self.store.committed_steps()):
            try:
                manifest = self.store.verify(step)
            except CheckpointError as e:
                broken.append(f"step {step}: {e}")
                continue
            for message in broken:
                warnings.warn(f"skipping checkpoint {message}", CheckpointWarning, stacklevel=2)
            return manifest
        if broken and not start_over:
            raise CheckpointError(
                f"every checkpoint in {storage.redact(self.store.url)} fails verification "
                f"({'; '.join(broken)}); restore them, or set checkpoint.start_over=true to "
                "train again from step 0")
        return None

    def expect(self, step: int, parts: set[str], attempt: str = "") -> None:
        """A checkpoint of `step` is being written as these parts, by the save `attempt`."""
        self.pending.append(PendingCheckpoint(step, expected=set(parts), attempt=attempt))

    def record(self, reports: list[WriteReport]) -> None:
        """Take the workers' write reports, then commit whatever became complete."""
        for w in reports:
            for p in self.pending:
                if p.step != w.step:
                    continue
                p.reported.add(w.part)
                if w.error is not None:
                    self.on_failed_write(p.step)
                    self._fail(p, f"writing part {w.part} failed ({w.error}); it will not be "
                               "committed")
                else:
                    p.parts[w.part] = w.info
        self.commit_ready()

    def commit_ready(self) -> None:
        """Commit every checkpoint whose parts are all written. A commit that meets
        unavailable storage (a transient error: nothing was committed) stays pending and is
        tried again later, so training does not wait for storage; one that meets a full disk
        releases what retention allows and is tried once more. A failed save's leftovers are
        deleted once all its writes returned."""
        keep = []
        for p in self.pending:
            if p.failed:
                if p.reported >= p.expected:
                    self.store.discard(p.step)
                else:
                    keep.append(p)
                continue
            if set(p.parts) != p.expected:
                keep.append(p)
                continue
            try:
                self._commit(p)
            except Exception as e:
                if not storage.is_transient(e):
                    self._fail(p, f"its commit failed ({type(e).__name__}: "
                               f"{storage.one_line(e)})")
                    self.store.discard(p.step)
                    continue
                if not p.deferred:
                    warn(f"checkpoint step {p.step}: storage unavailable "
                         f"({type(e).__name__}: {storage.redact(str(e))}); the commit is "
                         "retried after the next step")
                p.deferred = True
                keep.append(p)
                continue
            self.last_committed = p.step
        self.pending = keep

    def _commit(self, p: PendingCheckpoint) -> None:
        try:
            self.store.commit(p.step, p.parts, self.manifest_meta(p.step))
        except OSError as e:
            if not (storage.is_space_error(e) and self.store.release_for_space()):
                raise
            self.store.commit(p.step, p.parts, self.manifest_meta(p.step))

    def _fail(self, p: PendingCheckpoint, error: str) -> None:
        """`p` will not be committed: said at once, and kept for `take_failures`."""
        warn(f"checkpoint step {p.step}: {error}")
        if not p.failed:
            p.failed = True
            self.failures.append(FailedSave(p.step, error))

    def take_failures(self) -> list[FailedSave]:
        """The saves that failed since the last call."""
        failed, self.failures = self.failures, []
        return failed

    def finish(self, reports: list[WriteReport], wait: float) -> None:
        """At the end of a run, with every write returned: commit what is complete, waiting up
        to `wait` seconds for storage; every checkpoint left uncommitted is a failed save
        (`take_failures`), its leftovers deleted."""
        self.record(reports)

        def all_committed() -> None:
            self.commit_ready()
            if any(p.deferred for p in self.pending):
                raise StorageUnavailable(f"{storage.redact(self.store.url)} refuses commits")

        try:
            wait_for_storage(all_committed, self.store.url, "to commit the last checkpoints",
                             wait)
        except StorageUnavailable:
            pass
        for p in self.pending:
            if p.deferred:
                self._fail(p, f"storage still unavailable after {wait:g}s; it was not "
                           "committed")
            else:  # every write has returned: the missing parts went with a failed worker
                self._fail(p, f"parts {sorted(p.expected - set(p.parts))} were lost with a "
                           "failed worker; it was not committed")
            with contextlib.suppress(Exception):  # best effort: the next start sweeps it
                self.store.discard(p.step)
        self.pending = []

    def latest_readable_step(self) -> int:
        """The newest committed step (`base` if none), after committing what is complete (parts
        whose report was lost with a failed worker count when their record is in storage:
        the part was finished); storage that is unavailable is waited for, since restoring
        needs it and a deferred commit may hold the newest state."""

        def latest() -> int:
            self._adopt_unreported()
            self.commit_ready()
            return self.store.latest_step() or self.base

        return wait_for_storage(latest, self.store.url, "to restore")

    def _adopt_unreported(self) -> None:
        """Take from storage the records of pending parts nobody reported (a finished part's
        record is written beside it, `CheckpointStore.write_part`), if they are of the same
        save: a record left by an earlier save of the step (before a restore rolled it back)
        describes another state."""
        for p in self.pending:
            for part in sorted(p.expected - set(p.parts)):
                record = None if p.failed else self.store.part_record(p.step, part)
                if record is not None and p.attempt and record.get("attempt") == p.attempt:
                    p.parts[part] = record

    def forget_after(self, step: int) -> None:
        """A restore to `step` abandons the checkpoints of later steps still being written."""
        self.pending = [p for p in self.pending if p.step <= step]
