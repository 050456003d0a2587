"""Checkpoint storage: safetensors parts plus a JSON manifest that is written last.

Layout (docs/CONTRACTS.md "Checkpoints"): `ROOT/step_00000042/{PART}.safetensors`, then
`ROOT/step_00000042/manifest.json`, the commit marker, written only after every part is
confirmed. A step without a manifest, or whose files do not match the sizes and digests the
manifest records, is skipped with a `CheckpointWarning` naming the file, and the previous one
is used.

Everything goes through fsspec so local directories, s3:// and gs:// share one code path. On a
local filesystem a file is written under a temporary name, fsynced and renamed (atomic, durable
across power loss). Elsewhere nothing relies on directories or renames: a part is one streaming
upload and the manifest one PUT, and an object store makes each appear whole or not at all.

A part may hold shards: rows `[start, stop)` of a tensor whose whole shape is larger (a sharded
run's workers each write only their own chunks, all at once). The part's manifest entry records
them (`"shards": {key: {"shape", "rows"}}`), a commit checks that every sharded tensor's pieces
tile its rows exactly, and a reader gets whole tensors, however many parts they were written in.

Beside the store: `checkpoint.manifest` (what a manifest holds and its validation),
`checkpoint.safetensors_format` (the part files' format), `checkpoint.reading` (a step's
tensors, or rows of them, read verified against the manifest) and `checkpoint.streaming`
(hashing on a second thread beside the reads and writes).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import posixpath
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from relaytrain import storage
from relaytrain.checkpoint.manifest import (
    FILE_FIELDS,
    FORMAT_VERSION,
    MANIFEST,
    RECORD_SUFFIX,
    RESERVED,
    STEP_DIR,
    SUFFIX,
    read_manifest,
    untiled,
)
from relaytrain.checkpoint.pieces import Rows
from relaytrain.checkpoint.reading import Into, KeyFilter, load_dir, verify_file
from relaytrain.checkpoint.safetensors_format import write_safetensors
from relaytrain.checkpoint.streaming import (
    BLOCK,
    DIGEST,
    BackgroundHash,
    EarlyWriteback,
    upload_size,
)
from relaytrain.errors import CheckpointError

TMP_SUFFIX = ".tmp"  # a local file being written, renamed into place once whole


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped because it is uncommitted, corrupt or incomplete."""


class CheckpointStore:
    """Committed checkpoints under one fsspec URL, one `step_NNNNNNNN` directory per step.

    Parts are written independently (one per rank or stage, keyed by global parameter names), so
    a checkpoint loads on any world size or pipeline layout; `commit` makes the step visible.
    """

    def __init__(self, url: str, keep_last: int | None = None,
                 storage_options: dict | None = None, block_size: int = BLOCK):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.url = url
        self.keep_last = keep_last
        self.block_size = block_size  # of the verified blocks new parts are hashed in
        # endpoints from the environment, the backend named if missing (relaytrain.storage)
        self.fs, root = storage.filesystem(url, storage_options)
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, keep_last={self.keep_last})"

    # -- writing ---------------------------------------------------------------------------

    def write_part(self, step: int, part: str, tensors: dict[str, torch.Tensor],
                   shards: dict[str, dict[str, list[int]]] | None = None,
                   attempt: str | None = None) -> dict:
        """Write `tensors` as `ROOT/step_NNNNNNNN/{part}.safetensors`; hash while writing.

        Tensors may live on any device and have any layout: those not already contiguous on the
        CPU are copied one at a time as they are written, so at most one such copy exists.
        `shards` names the tensors that are pieces of larger ones: key -> {"shape": the whole
        shape, "rows": [start, stop)} (see the module docstring). Returns the
        `{"file", "size", DIGEST, "block_size", "blocks"[, "shards"][, "attempt"]}` record
        that `commit` expects; `attempt` names this save of the step (a caller tells its
        records from those of an earlier save of the same step by it: `part_record`).
        """
        if not part or "/" in part or part.startswith("."):
            raise ValueError(f"part name {part!r}: expected a plain file stem like 'model'")
        d = self._step_dir(step)
        # Rewriting a committed step: withdraw its marker first, so it never vouches for
        # files that are being replaced.
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{d}/{MANIFEST}")
        name = part + SUFFIX
        for key, where in (shards or {}).items():
            start, stop = where["rows"]
            if tuple(tensors[key].shape) != (stop - start, *where["shape"][1:]):
                raise ValueError(f"part {part!r}: {key} of shape {tuple(tensors[key].shape)} "
                                 f"is not rows {start}:{stop} of {where['shape']}")
        hashing: list[BackgroundHash] = []
        try:
            size = self._write(f"{d}/{name}", lambda f: write_safetensors(
                f, tensors, self.block_size, hashing))
            # The hashing still running overlapped the file's flush and fsync (or upload).
            digest, blocks = hashing[0].hexdigest(), hashing[0].blocks
        except BaseException:
            for h in hashing:
                h.close()
            raise
        record = {"file": name, "size": size, DIGEST: digest, "block_size": self.block_size,
                  "blocks": blocks, **({"shards": shards} if shards else {}),
                  **({"attempt": attempt} if attempt else {})}
        # The record beside the part, written once the part is whole: a checkpoint whose
        # writer died before reporting it can still be committed (`part_record`).
        self._put(f"{d}/{part}{RECORD_SUFFIX}", json.dumps(record).encode())
        return record

    def part_record(self, step: int, part: str) -> dict | None:
        """The record `write_part` returned for `part` of `step`, read from beside the part
        (None if it is not there: the part was not finished)."""
        path = f"{self._step_dir(step)}/{part}{RECORD_SUFFIX}"
        try:
            record = json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            if storage.is_transient(e):
                raise
            return None  # unreadable: as good as absent, the part will not be committed
        return record if isinstance(record, dict) else None

    def commit(self, step: int, parts: dict[str, dict], meta: dict) -> str:
        """Make `step` visible: check every part's size, write the manifest last, retire old steps.

        Returns the step directory's URL. Raises `CheckpointError` (and writes nothing) when a
        part is missing or has the wrong size.
        """
        if not parts:
            raise ValueError(f"commit of step {step} lists no parts")
        clash = sorted(set(meta) & set(RESERVED))
        if clash:
            raise ValueError(f"checkpoint meta may not set {clash}: the store writes them")
        d = self._step_dir(step)
        sizes = self._sizes(d)
        files = {}
        for part, info in parts.items():
            name, size = info["file"], info["size"]
            if sizes.get(name) != size:
                got = "missing" if name not in sizes else f"{sizes[name]} bytes"
                raise CheckpointError(f"cannot commit step {step}: part {part!r} "
                                      f"{self._show(d)}/{name} is {got}, expected {size} bytes")
            files[name] = {k: info[k] for k in FILE_FIELDS if k in info}
        gap = untiled(files)
        if gap:
            raise CheckpointError(f"cannot commit step {step}: {gap}")
        manifest = {"format_version": FORMAT_VERSION, "step": step, "files": files,
                    "committed_at": time.time(), **meta}
        self._put(f"{d}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        self._retire()
        return self._show(d)

    # -- listing ---------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps that have a manifest (not yet verified), ascending.

        One recursive listing (`find` without maxdepth is a single paginated prefix listing on
        object stores; a glob would list each step directory).
        """
        self.fs.invalidate_cache(self.root)  # listings may be cached (s3fs) and go stale
        if self._local and not self._step_dirs():
            # The local `find` walks with os.walk, which treats a root it cannot read as
            # empty; `_step_dirs` raises then (an outage must not look like no checkpoints).
            return []
        steps = []
        for path in self.fs.find(self.root):
            rel = path[len(self.root) + 1:].split("/")
            m = STEP_DIR.fullmatch(rel[0])
            if m and rel[1:] == [MANIFEST]:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed step whose manifest parses and whose files have the right sizes.

        Cheap (no hashing; `read`/`load_latest_good` verify the digests of what they load), and
        its cost does not grow with the number of checkpoints (see `_newest_committed`).
        """
        for step, sizes in self._newest_committed():
            try:
                manifest = self.read_manifest(step)
                d = self._step_dir(step)
                for name, info in manifest["files"].items():
                    if sizes.get(name) != info["size"]:
                        got = "missing" if name not in sizes else f"{sizes[name]} bytes"
                        raise CheckpointError(f"{self._show(d)}/{name} is {got}, "
                                              f"manifest says {info['size']} bytes")
                return step
            except CheckpointError as e:
                _skip(step, e)
        return None

    # -- reading ---------------------------------------------------------------------------

    def read_manifest(self, step: int) -> dict:
        """The parsed, validated manifest of `step`; `CheckpointError` if absent or malformed."""
        return read_manifest(self.fs, self._step_dir(step), step)

    def read(self, step: int | None = None, keys: KeyFilter | None = None,
             rows: Rows | None = None, into: Into | None = None
             ) -> tuple[dict, dict[str, torch.Tensor]]:
        """(manifest, tensors) of `step`, everything read verified against the manifest.

        `keys` selects tensors by name (a pipeline stage reads only its parameters); files
        holding none of them are not read. `rows` asks only rows [start, stop) of the tensors
        it names (a shard of a sharded run: see `reading.load_dir`). With `step=None` this is
        `load_latest_good`, so a corrupt newest checkpoint falls back to the previous one; an
        explicit step raises `CheckpointError` naming the bad file instead.

        `into`: tensors the state already lives in (a worker's parameters and optimizer
        state). A stored tensor, or the `rows` asked of one when a single file holds them all,
        of the same name, dtype and shape as one of them (contiguous, on the CPU) is read
        straight into that tensor's memory and returned as it: no fresh memory to fault in
        and no copy afterwards (docs/MEASURED.md: restore in place); rows assembled from
        several files are copied into it once all are verified. The bytes read in place land
        before their file is verified, so after a `CheckpointError` the tensors the read
        reached hold part of a corrupt file: the caller overwrites them (another checkpoint, a
        snapshot) before using them.
        """
        if step is None:
            got = self.load_latest_good(keys, rows, into)
            if got is None:
                raise CheckpointError(self._nothing_loadable())
            return got
        return load_dir(self.fs, self._step_dir(step), keys, step, rows, into)

    def load_latest_good(self, keys: KeyFilter | None = None, rows: Rows | None = None,
                         into: Into | None = None
                         ) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The newest checkpoint whose files (those `keys` needs) verify, or None.

        Corrupt or incomplete steps are skipped with a `CheckpointWarning` naming the file.
        With `keys`, only the files read are verified: stages restoring one checkpoint together
        should agree on a step first (`latest_step` or `verify`) and then each `read(step, keys)`.
        `into` as for `read` (a skipped step's bytes are overwritten by the one loaded).
        Uncommitted step directories newer than the one loaded are named in a warning too.
        """
        for step, _ in self._newest_committed(say_skipped=True):
            try:
                return load_dir(self.fs, self._step_dir(step), keys, step, rows, into)
            except CheckpointError as e:
                _skip(step, e)
        return None

    def verify(self, step: int) -> dict:
        """Hash every file of `step` against its manifest; returns the manifest or raises."""
        d = self._step_dir(step)
        manifest = read_manifest(self.fs, d, step)
        for name, info in manifest["files"].items():
            verify_file(self.fs, f"{d}/{name}", info)
        return manifest

    # -- internals -------------------------------------------------------------------------

    def _step_dir(self, step: int) -> str:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
        return f"{self.root}/step_{step:08d}"

    def _show(self, path: str) -> str:
        """A path as the user should see it: plain for local files, a URL otherwise."""
        return path if self._local else self.fs.unstrip_protocol(path)

    def _write(self, path: str, fill: Callable[[BinaryIO], Any]) -> Any:
        """Create `path` with `fill(file)` so that readers never see a partial file under it.
        A write that fails leaves nothing: its temporary file is removed (and the step
        directory, if that left it empty), an upload in pieces is aborted."""
        if not self._local:
            # Objects appear at close; a failed upload is discarded, never completed with what
            # had been sent (S3 multipart uploads aborted, GCS resumable uploads cancelled).
            f = self.fs.open(path, "wb", block_size=upload_size(self.fs))
            try:
                out = fill(f)
                f.close()
                return out
            except BaseException:
                if isinstance(f, AbstractBufferedFile):
                    with contextlib.suppress(Exception):
                        f.discard()
                    f.closed = True  # a discarded file must not be completed when collected
                raise
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = path + TMP_SUFFIX
        try:
            with open(tmp, "wb") as f:
                out = fill(EarlyWriteback(f))
                f.flush()
                storage.charge_injected_quota(self.root, tmp)  # faults.disk_full_at
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            with contextlib.suppress(OSError):  # only if empty: another part may be in it
                os.rmdir(parent)
            raise
        _fsync_dir(parent)
        return out

    def _put(self, path: str, data: bytes) -> None:
        """A small file, whole or not at all: renamed into place locally, one PUT (atomic on
        object stores) elsewhere."""
        if self._local:
            self._write(path, lambda f: f.write(data))
        else:
            self.fs.pipe_file(path, data)

    def _sizes(self, d: str) -> dict[str, int]:
        """File name -> size in directory `d`, from one listing."""
        self.fs.invalidate_cache(d)
        try:
            entries = self.fs.ls(d, detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.basename(e["name"].rstrip("/")): e["size"] for e in entries
                if e.get("type") == "file"}

    def _newest_committed(self, say_skipped: bool = False
                          ) -> Iterator[tuple[int, dict[str, int]]]:
        """(step, file name -> size) of each step directory holding a manifest, newest first.

        One listing of the root (on object stores a delimited listing: one request per 1000
        steps however many parts each holds, where `committed_steps` lists every object), then
        one listing per directory visited; directories without a manifest (a save in progress
        or one that failed) are passed over, with a `CheckpointWarning` if `say_skipped` (a
        reader: eval, convert, init.from).
        """
        for step in sorted(self._step_dirs(), reverse=True):
            sizes = self._sizes(self._step_dir(step))
            if MANIFEST in sizes:
                yield step, sizes
            elif say_skipped:
                _skip(step, CheckpointError(f"{self._show(self._step_dir(step))} has no "
                                            f"{MANIFEST}: a save that failed, was interrupted "
                                            "or is in progress"))

    def _step_dirs(self) -> dict[int, str]:
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return {}
        dirs = {}
        for path in entries:
            m = STEP_DIR.fullmatch(posixpath.basename(path.rstrip("/")))
            if m:
                dirs[int(m.group(1))] = path.rstrip("/")
        return dirs

    def _retire(self) -> None:
        """keep_last retention: drop committed steps beyond the newest K, and uncommitted
        leftovers older than the newest commit (a crashed or failed write). Newer uncommitted
        directories may be writes in progress and stay."""
        if self.keep_last is not None:
            self._release(self.keep_last)

    def release_for_space(self) -> list[int]:
        """Room for a save that met a full disk: the committed steps that retention would
        delete once that save commits (all but the newest keep_last - 1, never the newest) and
        uncommitted leftovers older than the newest commit, oldest first; the steps whose
        directories were deleted. Nothing with keep_last None."""
        if self.keep_last is None:
            return []
        return self._release(max(1, self.keep_last - 1))

    def _release(self, keep: int) -> list[int]:
        """Delete every step directory but the newest `keep` committed ones and those newer
        than the newest commit; the steps deleted."""
        committed = self.committed_steps()
        if not committed:
            return []
        kept = set(committed[-keep:])
        gone = []
        for step, path in sorted(self._step_dirs().items()):
            if step in kept or step > committed[-1]:
                continue
            try:
                self._delete(path)
                gone.append(step)
            except OSError as e:
                warnings.warn(f"checkpoint retention could not delete {self._show(path)}: {e}",
                              CheckpointWarning, stacklevel=3)
        return gone

    def _delete(self, path: str) -> None:
        """Delete a step directory; its marker first: a crash mid-delete leaves an uncommitted
        leftover, never a manifest pointing at deleted files."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{path}/{MANIFEST}")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def discard(self, step: int) -> bool:
        """Delete what a failed save of `step` left (parts, records, an empty directory),
        unless `step` is committed: a committed checkpoint is never touched. Whether anything
        was there to delete."""
        d = self._step_dir(step)
        if not self._local:
            self.fs.invalidate_cache(d)
        if self.fs.exists(f"{d}/{MANIFEST}") or not self.fs.exists(d):
            return False
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(d, recursive=True)
        return True

    def sweep(self) -> list[str]:
        """At the start of a run, when no save is in progress: delete the debris of earlier
        failed or interrupted saves (uncommitted step directories, temporary files, left
        probe objects; on S3, multipart uploads never completed). Committed checkpoints are
        not touched. What was deleted, for the user."""
        gone = []
        for step, path in sorted(self._step_dirs().items()):
            if self.discard(step):
                gone.append(f"uncommitted step {step}")
            elif self._local:
                for tmp in glob.glob(os.path.join(glob.escape(path), "*" + TMP_SUFFIX)):
                    os.remove(tmp)
                    gone.append(tmp)
        if self._local and os.path.isdir(self.root):
            for probe in glob.glob(os.path.join(glob.escape(self.root),
                                                storage.PROBE_PREFIX + "*")):
                os.remove(probe)
                gone.append(probe)
        return gone + self._abort_uploads()

    def _abort_uploads(self) -> list[str]:
        """S3 multipart uploads under the root that were never completed (their pieces take
        space, and are billed, until aborted); aborted. Other stores: none."""
        if not hasattr(self.fs, "list_multipart_uploads"):
            return []
        bucket, _, prefix = self.root.partition("/")
        listing = self.fs.call_s3("list_multipart_uploads", Bucket=bucket,
                                  Prefix=prefix + "/" if prefix else "")
        gone = []
        for up in listing.get("Uploads", []):
            self.fs.abort_mpu(bucket, up["Key"], up["UploadId"])
            gone.append(f"upload of {self.fs.unstrip_protocol(bucket + '/' + up['Key'])}")
        return gone

    def _nothing_loadable(self) -> str:
        steps = self.committed_steps()
        if not steps:
            return (f"no committed checkpoint under {self.url}; "
                    "expected step_NNNNNNNN/manifest.json")
        return (f"no checkpoint under {self.url} verifies: committed steps {steps} are all "
                "corrupt or incomplete (see the warnings above)")


def run_checkpoint_url(run_dir: str, url: str | None = None) -> str:
    """A run's checkpoint root: its `checkpoint.url` if set, else RUN_DIR/checkpoints."""
    return url or posixpath.join(run_dir, "checkpoints")


def open_checkpoint(path_or_url: str, keys: KeyFilter | None = None
                    ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Load a checkpoint from a run directory, a checkpoints root or one step directory.

    A run directory means its `checkpoint.url` from `config.yaml` if set, else
    `RUN_DIR/checkpoints`; a root means its newest good step; a step directory (or its
    manifest.json) means exactly that step. Raises `CheckpointError` if nothing loads.
    """
    fs, path, store = _named(path_or_url)
    if store is None:
        return load_dir(fs, path, keys)
    got = store.load_latest_good(keys)
    if got is None:
        raise CheckpointError(store._nothing_loadable())
    return got


def locate_checkpoint(path_or_url: str) -> tuple[fsspec.AbstractFileSystem, str, dict]:
    """(file system, step directory, manifest) of the checkpoint `path_or_url` names, as for
    `open_checkpoint`, its every file verified (a root's or run directory's newest step that
    verifies; broken ones are skipped with a warning) and nothing loaded: `init.from`."""
    fs, path, store = _named(path_or_url)
    if store is None:
        manifest = read_manifest(fs, path)
        for name, info in manifest["files"].items():
            verify_file(fs, f"{path}/{name}", info)
        return fs, path, manifest
    broken = []
    for step, _ in store._newest_committed(say_skipped=True):
        try:
            manifest = store.verify(step)
        except CheckpointError as e:
            broken.append(f"step {step}: {e}")
            continue
        for message in broken:
            warnings.warn(f"skipping checkpoint {message}", CheckpointWarning, stacklevel=2)
        return store.fs, store._step_dir(step), manifest
    if broken:
        raise CheckpointError(f"no checkpoint under {storage.redact(store.url)} verifies "
                              f"({'; '.join(broken)})")
    raise CheckpointError(store._nothing_loadable())


def _named(path_or_url: str) -> tuple[fsspec.AbstractFileSystem, str, CheckpointStore | None]:
    """What a path names: one step directory (file system, its path, None), or the store of a
    run directory or checkpoints root (file system, path, the store)."""
    url = path_or_url.rstrip("/")
    if url.endswith("/" + MANIFEST):
        url = url[: -len(MANIFEST) - 1]
    fs, path = storage.filesystem(url)
    path = path.rstrip("/")
    if fs.exists(f"{path}/{MANIFEST}"):
        return fs, path, None
    if STEP_DIR.fullmatch(posixpath.basename(path)) and fs.isdir(path):
        raise CheckpointError(f"{path_or_url} was never committed: it has no {MANIFEST}")
    configured = (_configured_url(fs, f"{path}/config.yaml")
                  if fs.exists(f"{path}/config.yaml") else None)
    if configured or fs.isdir(run_checkpoint_url(path)):
        url = run_checkpoint_url(url, configured)
    return fs, path, CheckpointStore(url)


def _fsync_dir(path: str) -> None:
    """Persist a rename: the directory entry, not just the file, must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _skip(step: int, err: CheckpointError) -> None:
    warnings.warn(f"skipping checkpoint step {step}: {err}", CheckpointWarning, stacklevel=3)


def _configured_url(fs: fsspec.AbstractFileSystem, config_path: str) -> str | None:
    """`checkpoint.url` from a run directory's config.yaml (safe_load: plain data only)."""
    import yaml

    try:
        cfg = yaml.safe_load(fs.cat_file(config_path))
    except yaml.YAMLError as e:
        reason = " ".join(str(e).split())  # one line for the CLI
        raise CheckpointError(f"{config_path}: not valid YAML ({reason})") from None
    section = cfg.get("checkpoint") if isinstance(cfg, dict) else None
    url = section.get("url") if isinstance(section, dict) else None
    return url if isinstance(url, str) and url else None
