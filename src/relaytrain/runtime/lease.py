"""One controller per run: `relaytrain train` holds a lease on where the run's state lives (the
run directory, and the checkpoint URL when that is elsewhere, object stores included), renewed
while it runs.

Why: a job scheduler that requeues a job whose first copy is still alive starts a second
controller on the same run; both resumed from the same checkpoint and wrote the same ledger and
checkpoints (the audit then found every step recorded twice). A second controller now refuses
in one line naming the holder (exit 2, nothing written). A lease whose holder is gone is taken
over with a warning, so a crashed run resumes without manual cleanup: gone means its process no
longer runs (decided at once on the holder's own host: same boot id, PID and start time) or,
from another host, no renewal for STALE_S seconds (renewed every RENEW_S). Readers (`eval`,
`data audit`, `convert`) never take it.

The lease is one small JSON file, `lease.json`, in each place. Taking it is race-safe:
- local: written whole aside, then hard-linked into place, which like O_EXCL fails if the lease
  exists (two creators: one wins, the other sees the winner's whole lease); a stale one is
  first renamed aside (one renamer wins) and checked to be the stale lease judged
  (else a fresh lease renamed by mistake is linked back, never overwriting), then created
  again; renewals replace it atomically (a rename). Without hard links (FUSE mounts of object
  stores), O_EXCL itself.
- object stores: a conditional create (`If-None-Match: *` on S3, `ifGenerationMatch=0` on GCS:
  fsspec's `pipe_file(mode="create")`); a backend without it gets write-then-verify (written
  if absent, read back after a pause: the last writer wins, the other sees it and refuses). A
  stale lease is deleted before the create; two controllers taking over the same stale lease at
  the same instant can both pass the create on a store without conditional deletes, and the one
  overwritten finds the other's lease at its next renewal and stops at once (`on_lost`).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from relaytrain import storage
from relaytrain.errors import UserError, warn
from relaytrain.runtime.liveness import ProcessIdentity, process_identity, running

LEASE = "lease.json"
RENEW_S = 10.0
STALE_S = 60.0
CONDITIONAL_CREATE = ("s3", "s3a", "gs", "gcs")
_VERIFY_PAUSE_S = 0.5  # write-then-verify: how long a concurrent writer has to show itself


class LeaseHeld(UserError):
    """Another controller holds the run."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start: int  # the process's start time (liveness.ProcessIdentity)
    boot: str | None
    since: float  # unix time the lease was taken
    renewed: float
    token: str  # names this holding: a renewal checks it is still its own

    def gone(self, now: float) -> str | None:
        """Why the holder is gone (None: it may still run)."""
        if self.boot is not None and self.boot == process_identity().boot:
            ident = ProcessIdentity(self.pid, self.start, self.boot)
            return None if running(ident) else f"its process {self.pid} no longer runs"
        if now - self.renewed > STALE_S:
            return f"not renewed for {now - self.renewed:.0f}s (> {STALE_S:g}s)"
        return None

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        return f"host {self.host}, PID {self.pid}, since {since} UTC"


class _Place:
    """One lease file: at `url` (a directory: local path or fsspec URL)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.local = storage.scheme(url) == "file"
        self.created: str | None = None  # the directory creating the lease made
        if self.local:
            self.path = os.path.join(url.removeprefix("file://"), LEASE)
        else:
            self.fs, root = storage.filesystem(url)
            self.path = f"{root.rstrip('/')}/{LEASE}"
        # S3's If-None-Match and GCS's ifGenerationMatch=0 (fsspec's `mode="create"`); other
        # fsspec backends only check for the file before writing it
        self.conditional = storage.scheme(url) in CONDITIONAL_CREATE

    def read(self) -> Holder | None:
        try:
            if self.local:
                with open(self.path, "rb") as f:
                    data = f.read()
            else:
                self.fs.invalidate_cache(self.path)
                data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        try:
            return Holder(**json.loads(data))
        except (ValueError, TypeError):  # torn or foreign: nobody can be holding through it
            return Holder("?", 0, 0, None, 0.0, 0.0, "")

    def create(self, holder: Holder) -> bool:
        """Write `holder` if there is no lease; whether it was written (and is ours)."""
        data = json.dumps(asdict(holder)).encode()
        if self.local:
            folder = os.path.dirname(self.path) or "."
            if not os.path.isdir(folder):
                os.makedirs(folder, exist_ok=True)
                self.created = folder
            # whole before it is visible: a reader never judges a half-written lease
            tmp = f"{self.path}.{holder.token}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)  # fails if the lease exists, as O_EXCL would
                return True
            except FileExistsError:
                return False
            except OSError:  # no hard links (FUSE mounts of object stores): O_EXCL itself
                return self._create_exclusive(data)
            finally:
                os.unlink(tmp)
        if self.conditional:
            try:
                self.fs.pipe_file(self.path, data, mode="create")
                return True
            except FileExistsError:
                return False
        # no conditional create in this backend: write if absent, then verify
        if self.read() is not None:
            return False
        self.fs.pipe_file(self.path, data)
        time.sleep(_VERIFY_PAUSE_S)
        got = self.read()
        return got is not None and got.token == holder.token

    def _create_exclusive(self, data: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def remove_stale(self, stale: Holder) -> None:
        """Remove the lease if it still is `stale` (see the module's docstring)."""
        if not self.local:
            got = self.read()
            if got is not None and got.token == stale.token:
                self.fs.rm_file(self.path)
            return
        aside = f"{self.path}.{secrets.token_hex(6)}.stale"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another taker moved it
        moved = self.read_file(aside)
        if moved is not None and moved.token != stale.token:
            try:  # a fresh lease, taken meanwhile: back, unless a newer one is in place
                os.link(aside, self.path)
            except FileExistsError:
                pass
        os.unlink(aside)

    def read_file(self, path: str) -> Holder | None:
        try:
            with open(path, "rb") as f:
                return Holder(**json.loads(f.read()))
        except (OSError, ValueError, TypeError):
            return None

    def replace(self, holder: Holder) -> None:
        data = json.dumps(asdict(holder)).encode()
        if not self.local:
            self.fs.pipe_file(self.path, data)
            return
        tmp = f"{self.path}.{holder.token}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        """The lease file, and the directory its creation made if nothing else is in it (a run
        refused before step 1 leaves nothing behind)."""
        try:
            if self.local:
                os.unlink(self.path)
            else:
                self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass
        if self.created is not None:
            try:
                os.rmdir(self.created)
            except OSError:  # the run wrote there
                pass


class RunLease:
    """The lease on a run: `with RunLease(places, on_lost):` around the controller."""

    def __init__(self, places: list[str], on_lost: Callable[[str], None] = lambda why: None):
        self.places = [_Place(p) for p in places]
        self.on_lost = on_lost
        me = process_identity()
        now = time.time()
        self.holder = Holder(socket.gethostname(), me.pid, me.start, me.boot, now, now,
                             secrets.token_hex(8))
        self._held: list[_Place] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLease:
        try:
            for place in self.places:
                self._take(place)
                self._held.append(place)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._release()

    def _take(self, place: _Place) -> None:
        for _ in range(5):  # each pass: ours, or the holder judged, or a stale one removed
            if place.create(self.holder):
                return
            held = place.read()
            if held is None:
                continue  # released meanwhile
            why = held.gone(time.time())
            if why is None:
                raise LeaseHeld(f"{storage.redact(place.url)} is held by another `relaytrain "
                                f"train` ({held.describe()}): one controller per run; stop "
                                f"it, or wait for it to end (a crashed one's lease is taken "
                                f"over once {STALE_S:g}s pass without renewal)")
            warn(f"taking over the lease on {storage.redact(place.url)} from {held.describe()}"
                 f": {why}")
            place.remove_stale(held)
        raise LeaseHeld(f"{storage.redact(place.url)}: the lease changed hands 5 times while "
                        "being taken; another controller is starting on this run")

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            for place in self._held:
                try:
                    held = place.read()
                    if held is None or held.token != self.holder.token:
                        who = "nobody" if held is None else held.describe()
                        self.on_lost(f"the lease on {storage.redact(place.url)} is now held by "
                                     f"{who}")
                        return
                    self.holder = Holder(**{**asdict(self.holder), "renewed": time.time()})
                    place.replace(self.holder)
                except Exception as e:  # storage unavailable for a while: try again later
                    warn(f"renewing the lease on {storage.redact(place.url)} failed "
                         f"({type(e).__name__}); retrying in {RENEW_S:g}s")

    def _release(self) -> None:
        """Remove the lease files that are still ours."""
        for place in self._held:
            try:
                held = place.read()
                if held is not None and held.token == self.holder.token:
                    place.remove()
            except Exception as e:
                warn(f"could not release the lease on {storage.redact(place.url)} "
                     f"({type(e).__name__}); the next run takes it over")
        self._held = []


def lease_places(run_dir: str, checkpoint_url: str) -> list[str]:
    """Where a run's state lives: the run directory, and the checkpoint URL when it is not in
    it."""
    inside = storage.scheme(checkpoint_url) == "file" and os.path.abspath(
        checkpoint_url.removeprefix("file://")).startswith(os.path.abspath(run_dir) + os.sep)
    return [run_dir] if inside else [checkpoint_url, run_dir]  # refused before run_dir exists

