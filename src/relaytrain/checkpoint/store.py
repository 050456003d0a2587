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

Loading is safe: headers and manifests are JSON (validated as the safetensors format
requires), tensors are returned only after the file's size and digest match the manifest, and
nothing from storage is ever unpickled. Reading is one pass straight into the tensors, hashed
on a second thread as it goes; object stores are read as parallel ranged requests; writing
hashes on a second thread too (`checkpoint.streaming`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import posixpath
import re
import struct
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from relaytrain import storage
from relaytrain.checkpoint.pieces import Piece, Rows, assemble, cut, rows_to_take
from relaytrain.checkpoint.streaming import (
    BLOCK,
    CHUNK,
    DIGEST,
    DIGESTS,
    HASH_THREADS,
    BackgroundHash,
    EarlyWriteback,
    FileReader,
    Prefault,
    RangedReader,
    block_root,
    copy_bytes,
    digest_hex,
    digest_of,
    hash_stream,
    range_size,
    upload_size,
)
from relaytrain.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUFFIX = ".safetensors"
RECORD_SUFFIX = ".record.json"  # a part's record, beside it (write_part)
_STEP_DIR = re.compile(r"step_(\d{8,})")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_RESERVED = ("format_version", "step", "files", "committed_at")
# A file's manifest entry: its digest under the algorithm's name (streaming.DIGESTS)
FILE_FIELDS = ("size", *DIGESTS, "block_size", "blocks", "shards")

# torch dtype -> safetensors dtype name (the format's spec; safetensors.torch._TYPES inverted)
_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64",
    torch.uint64: "U64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.float64: "F64", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPE_OF = {name: dtype for dtype, name in _DTYPES.items()}

KeyFilter = Callable[[str], bool]
Into = Mapping[str, torch.Tensor]  # tensors a read fills in place (`CheckpointStore.read`)


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
            size = self._write(f"{d}/{name}", lambda f: _write_safetensors(
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
        clash = sorted(set(meta) & set(_RESERVED))
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
        gap = _untiled(files)
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
            m = _STEP_DIR.fullmatch(rel[0])
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
        return _read_manifest(self.fs, self._step_dir(step), step)

    def read(self, step: int | None = None, keys: KeyFilter | None = None,
             rows: Rows | None = None, into: Into | None = None
             ) -> tuple[dict, dict[str, torch.Tensor]]:
        """(manifest, tensors) of `step`, everything read verified against the manifest.

        `keys` selects tensors by name (a pipeline stage reads only its parameters); files
        holding none of them are not read. `rows` asks only rows [start, stop) of the tensors
        it names (a shard of a sharded run: see `_load_dir`). With `step=None` this is
        `load_latest_good`, so a corrupt newest checkpoint falls back to the previous one; an
        explicit step raises `CheckpointError` naming the bad file instead.

        `into`: tensors the state already lives in (a worker's parameters and optimizer
        state). A stored tensor, or the `rows` asked of one when a single file holds them all,
        of the same name, dtype and shape as one of them (contiguous, on the CPU) is read
        straight into that tensor's memory and returned as it: no fresh memory to fault in
        and no copy afterwards (README "Measured": restore in place); rows assembled from
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
        return _load_dir(self.fs, self._step_dir(step), keys, step, rows, into)

    def load_latest_good(self, keys: KeyFilter | None = None, rows: Rows | None = None,
                         into: Into | None = None
                         ) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The newest checkpoint whose files (those `keys` needs) verify, or None.

        Corrupt or incomplete steps are skipped with a `CheckpointWarning` naming the file.
        With `keys`, only the files read are verified: stages restoring one checkpoint together
        should agree on a step first (`latest_step` or `verify`) and then each `read(step, keys)`.
        `into` as for `read` (a skipped step's bytes are overwritten by the one loaded).
        """
        for step, _ in self._newest_committed():
            try:
                return _load_dir(self.fs, self._step_dir(step), keys, step, rows, into)
            except CheckpointError as e:
                _skip(step, e)
        return None

    def verify(self, step: int) -> dict:
        """Hash every file of `step` against its manifest; returns the manifest or raises."""
        d = self._step_dir(step)
        manifest = _read_manifest(self.fs, d, step)
        for name, info in manifest["files"].items():
            _verify_file(self.fs, f"{d}/{name}", info)
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
        """Create `path` with `fill(file)` so that readers never see a partial file under it."""
        if not self._local:
            # Objects appear at close. A failed upload may leave a partial object, which is
            # harmless: only a manifest makes a file count, and it is written after the check.
            with self.fs.open(path, "wb", block_size=upload_size(self.fs)) as f:
                return fill(f)
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            out = fill(EarlyWriteback(f))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
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

    def _newest_committed(self) -> Iterator[tuple[int, dict[str, int]]]:
        """(step, file name -> size) of each step directory holding a manifest, newest first.

        One listing of the root (on object stores a delimited listing: one request per 1000
        steps however many parts each holds, where `committed_steps` lists every object), then
        one listing per directory visited; directories without a manifest (a save in progress
        or one that failed) are passed over.
        """
        for step in sorted(self._step_dirs(), reverse=True):
            sizes = self._sizes(self._step_dir(step))
            if MANIFEST in sizes:
                yield step, sizes

    def _step_dirs(self) -> dict[int, str]:
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return {}
        dirs = {}
        for path in entries:
            m = _STEP_DIR.fullmatch(posixpath.basename(path.rstrip("/")))
            if m:
                dirs[int(m.group(1))] = path.rstrip("/")
        return dirs

    def _retire(self) -> None:
        """keep_last retention: drop committed steps beyond the newest K, and uncommitted
        leftovers older than the newest commit (a crashed or failed write). Newer uncommitted
        directories may be writes in progress and stay."""
        if self.keep_last is None:
            return
        committed = self.committed_steps()
        if not committed:
            return
        keep = set(committed[-self.keep_last:])
        for step, path in self._step_dirs().items():
            if step in keep or step > committed[-1]:
                continue
            try:
                # marker first: a crash mid-delete leaves an uncommitted leftover, never a
                # manifest pointing at deleted files
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(f"{path}/{MANIFEST}")
                self.fs.rm(path, recursive=True)
            except OSError as e:
                warnings.warn(f"checkpoint retention could not delete {self._show(path)}: {e}",
                              CheckpointWarning, stacklevel=3)

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
    url = path_or_url.rstrip("/")
    if url.endswith("/" + MANIFEST):
        url = url[: -len(MANIFEST) - 1]
    fs, path = storage.filesystem(url)
    path = path.rstrip("/")
    if fs.exists(f"{path}/{MANIFEST}"):
        return _load_dir(fs, path, keys)
    if _STEP_DIR.fullmatch(posixpath.basename(path)) and fs.isdir(path):
        raise CheckpointError(f"{path_or_url} was never committed: it has no {MANIFEST}")
    configured = (_configured_url(fs, f"{path}/config.yaml")
                  if fs.exists(f"{path}/config.yaml") else None)
    if configured or fs.isdir(run_checkpoint_url(path)):
        url = run_checkpoint_url(url, configured)
    store = CheckpointStore(url)
    got = store.load_latest_good(keys)
    if got is None:
        raise CheckpointError(store._nothing_loadable())
    return got


# -- safetensors writing -------------------------------------------------------------------


def _write_safetensors(f: BinaryIO, tensors: dict[str, torch.Tensor], block_size: int,
                       hashing: list[BackgroundHash]) -> int:
    """Stream `tensors` to `f` in the safetensors format; returns the bytes written. The
    hashing of those bytes (streaming.BackgroundHash, appended to `hashing`) may still run: the
    caller reads its digest, or closes it on an error, and keeps the tensors unchanged until
    then.

    Streaming instead of `safetensors.torch.save` avoids holding the whole file in memory next
    to the tensors, and hashes the exact bytes written in the same pass.
    """
    # Widest dtypes first: with the 8-aligned header every tensor starts aligned.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for k in order:
        t = tensors[k]
        if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES or k == "__metadata__":
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"cannot checkpoint {k!r}: {what} (expected a tensor of "
                             f"{sorted(str(d) for d in _DTYPES)})")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    # beside the writes, on other cores; the tensors stay as they are until written
    h = BackgroundHash(head, block_size=block_size, stable=True)
    hashing.append(h)
    f.write(head)
    for k in order:
        data = _raw_bytes(tensors[k])
        for i in range(0, len(data), CHUNK):
            chunk = data[i:i + CHUNK]
            h.update(chunk)
            f.write(chunk)
    return len(head) + offset


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, copying only if it is off-CPU or not contiguous."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _fsync_dir(path: str) -> None:
    """Persist a rename: the directory entry, not just the file, must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading -------------------------------------------------------------------------------


def _skip(step: int, err: CheckpointError) -> None:
    warnings.warn(f"skipping checkpoint step {step}: {err}", CheckpointWarning, stacklevel=3)


def _read_manifest(fs: fsspec.AbstractFileSystem, d: str, step: int | None = None) -> dict:
    path = f"{d}/{MANIFEST}"
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint was never committed)") from None
    try:
        m = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format_version") != FORMAT_VERSION:
        got = m.get("format_version") if isinstance(m, dict) else type(m).__name__
        raise CheckpointError(f"{path}: format_version {got!r}, expected {FORMAT_VERSION}")
    if step is not None and m.get("step") != step:
        raise CheckpointError(f"{path}: records step {m.get('step')!r}, expected {step}")
    files = m.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(n, str) and n == posixpath.basename(n) and n.endswith(SUFFIX)
            and isinstance(i, dict) and isinstance(i.get("size"), int)
            and digest_of(i) is not None for n, i in files.items()):
        raise CheckpointError(f"{path}: 'files' must map plain *{SUFFIX} names to "
                              f"{{size, and a digest: one of {', '.join(DIGESTS)}}}")
    if not all(_valid_blocks(i) for i in files.values()):
        raise CheckpointError(f"{path}: a file's 'blocks' must list the digest of each of its "
                              "'block_size' bytes, and the file's digest be theirs")
    if not all(_valid_shards(i.get("shards", {})) for i in files.values()):
        raise CheckpointError(f"{path}: a file's 'shards' must map tensor names to "
                              "{shape: [int, ...], rows: [start, stop]}")
    gap = _untiled(files)
    if gap:
        raise CheckpointError(f"{path}: {gap}")
    return m


def _valid_blocks(info: dict) -> bool:
    """A file hashed in blocks (its entry names `block_size`) lists one digest per block, and
    its digest is theirs; an older entry (whole-file digest only) is valid as it is. The entry
    has a digest (`_read_manifest` checks that first)."""
    if "block_size" not in info and "blocks" not in info:
        return True
    size, blocks = info.get("block_size"), info.get("blocks")
    algorithm, digest = digest_of(info)
    hex_digits = DIGESTS[algorithm][1]
    return (isinstance(size, int) and size > 0 and isinstance(blocks, list)
            and len(blocks) == -(-info["size"] // size)
            and all(isinstance(b, str) and re.fullmatch(f"[0-9a-f]{{{hex_digits}}}", b)
                    for b in blocks)
            and block_root(blocks, algorithm) == digest)


def _valid_shards(shards: Any) -> bool:
    return isinstance(shards, dict) and all(
        isinstance(w, dict) and isinstance(w.get("shape"), list) and len(w["shape"]) >= 1
        and all(isinstance(n, int) and n >= 0 for n in w["shape"])
        and isinstance(w.get("rows"), list) and len(w["rows"]) == 2
        and all(isinstance(n, int) for n in w["rows"])
        and 0 <= w["rows"][0] <= w["rows"][1] <= w["shape"][0] for w in shards.values())


def _untiled(files: dict[str, dict]) -> str | None:
    """What is wrong with the sharded tensors of a checkpoint's `files`: a tensor whose pieces
    do not cover its rows exactly once, or disagree on its shape; None if nothing is."""
    pieces: dict[str, list[tuple[int, int, list[int]]]] = {}
    for info in files.values():
        for key, w in info.get("shards", {}).items():
            pieces.setdefault(key, []).append((*w["rows"], w["shape"]))
    for key, got in sorted(pieces.items()):
        got.sort()
        shape, end = got[0][2], 0
        for start, stop, other in got:
            if other != shape or start != end:
                return (f"the shards of {key} ({[g[:2] for g in got]} of {shape}) do not "
                        f"tile its rows exactly once")
            end = stop
        if end != shape[0]:
            return f"the shards of {key} cover rows 0:{end} of {shape[0]}"
    return None


def _load_dir(fs: fsspec.AbstractFileSystem, d: str, keys: KeyFilter | None,
              step: int | None = None, rows: Rows | None = None, into: Into | None = None
              ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, tensors) of the step directory `d`, verifying what is read: each file read
    whole against its digest, or (`rows`, a file hashed in blocks) only the blocks holding the
    rows wanted, each against its own. Sharded tensors come back whole, or as the `rows` asked
    of them, assembled from every file holding a piece. A tensor that comes whole from one
    file, or whose rows asked one piece holds exactly, is read `into` the caller's tensor where
    it fits (`CheckpointStore.read`); rows from several pieces are copied into it once every
    file is verified."""
    manifest = _read_manifest(fs, d, step)
    rows = rows or {}
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, info in manifest["files"].items():
        path = f"{d}/{name}"
        try:
            if keys is not None and not any(keys(k) for k in _header_keys(fs, path, info)):
                continue
            if rows and "blocks" in info:
                got = _read_rows(fs, path, info, keys, rows, into)
            else:
                got = _read_verified(fs, path, info, keys, into)
                for key, t in got.items():
                    _span(key, list(t.shape), info, path)  # as the manifest says
                got = cut(got, info.get("shards", {}), rows)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing") from None
        for key, (start, t) in got.items():
            if start is None:
                tensors[key] = t
            else:
                pieces.setdefault(key, []).append((start, t))
    for key, parts in pieces.items():
        try:
            tensors[key] = assemble(key, parts, rows.get(key) or (0, _whole_rows(manifest, key)),
                                    into.get(key) if into is not None else None)
        except ValueError as e:
            raise CheckpointError(f"{d}: {e}") from None
    return manifest, tensors


def _whole_rows(manifest: dict, key: str) -> int:
    return next(i["shards"][key]["shape"][0] for i in manifest["files"].values()
                if key in i.get("shards", {}))


def _span(key: str, shape: list[int], info: dict, path: str) -> tuple[int, int] | None:
    """The rows of the whole tensor `key` that a file's tensor of `shape` holds (None: a tensor
    without rows, read whole)."""
    where = info.get("shards", {}).get(key)
    if where is None:
        return (0, shape[0]) if shape else None
    start, stop = where["rows"]
    if list(shape) != [stop - start, *where["shape"][1:]]:
        raise CheckpointError(f"{path}: {key} has shape {tuple(shape)}, the manifest says rows "
                              f"{start}:{stop} of {where['shape']}")
    return start, stop


class _Blocks:
    """Verified byte ranges of one file hashed in blocks: only the blocks holding the ranges
    asked for are read, as parallel ranged requests (`RANGES_IN_FLIGHT` at once) of contiguous
    blocks, at most `range_size` bytes each, every block checked against its digest on
    HASH_THREADS threads as its response arrives."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, info: dict):
        self.fs, self.path, self.info = fs, path, info
        self.size, self.block = info["size"], info["block_size"]
        self.got: dict[int, memoryview] = {}

    def fetch(self, spans: list[tuple[int, int]]) -> None:
        need = sorted({i for a, b in spans if b > a for i in range(a // self.block,
                                                                    (b - 1) // self.block + 1)}
                      - set(self.got))
        per = max(1, range_size(self.fs) // self.block)  # blocks per ranged request
        requests = []  # (first block, blocks)
        while need:
            run = 1
            while run < min(len(need), per) and need[run] == need[0] + run:
                run += 1
            requests.append((need[0], run))
            need = need[run:]
        checks: list[tuple[int, memoryview, Future]] = []
        algorithm = digest_of(self.info)[0]
        with RangedReader(self.fs, self.path, self.size) as reader, \
                ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="relaytrain-hash") as pool:
            try:
                for _, (data,), first, run in reader.gets(
                        (first * self.block, [memoryview(bytearray(
                            min((first + run) * self.block, self.size) - first * self.block))],
                         first, run) for first, run in requests):
                    for i in range(first, first + run):
                        block = data[(i - first) * self.block:(i - first + 1) * self.block]
                        checks.append((i, block, pool.submit(digest_hex, algorithm, block)))
            except EOFError:
                raise CheckpointError(f"{_shown(self.fs, self.path)}: ended early "
                                      "(truncated)") from None
        for i, block, digest in checks:
            if digest.result() != self.info["blocks"][i]:
                raise CheckpointError(
                    f"{_shown(self.fs, self.path)}: block {i} (bytes {i * self.block}-"
                    f"{i * self.block + len(block)}) does not match the manifest's {algorithm} "
                    "(corrupt)")
        self.got.update((i, block) for i, block, _ in checks)

    def get(self, a: int, b: int) -> bytes:
        self.fetch([(a, b)])
        return b"".join(self._slices(a, b))

    def copy_to(self, out: memoryview, a: int) -> None:
        """Bytes [a, a + len(out)) of the file (fetched already) into `out`, block by block."""
        at = 0
        for piece in self._slices(a, a + len(out)):
            copy_bytes(out[at:at + len(piece)], piece)
            at += len(piece)

    def _slices(self, a: int, b: int) -> Iterator[memoryview]:
        for i in range(a // self.block, (b - 1) // self.block + 1) if b > a else ():
            yield self.got[i][max(a - i * self.block, 0):b - i * self.block]


def _read_rows(fs: fsspec.AbstractFileSystem, path: str, info: dict, keys: KeyFilter | None,
               rows: Rows, into: Into | None = None) -> dict[str, Piece]:
    """`pieces.cut` of the file, reading only the blocks that hold its header and the rows
    wanted. A whole tensor, or the rows asked of one when this file's piece holds all of them
    (no other piece then holds any: pieces tile a tensor's rows), goes `into` the caller's
    tensor where it fits."""
    shown = _shown(fs, path)
    blocks = _Blocks(fs, path, info)
    (n,) = struct.unpack("<Q", blocks.get(0, 8))
    if n > min(_MAX_HEADER, info["size"] - 8):
        raise CheckpointError(f"{shown}: not a valid safetensors file (header length {n} "
                              "exceeds the file)")
    offset, wanted = 8 + n, []  # (key, dtype, shape, first row, bytes a, bytes b)
    for key, dtype, shape in _parse_header(blocks.get(8, 8 + n), info["size"] - 8 - n, shown):
        nbytes = dtype.itemsize * math.prod(shape)
        take = None if keys is not None and not keys(key) else \
            rows_to_take(key, _span(key, shape, info, path), key in info.get("shards", {}), rows)
        if take is not None:
            first, i, j = take
            if first is None:
                wanted.append((key, dtype, shape, None, offset, offset + nbytes))
            else:
                row = nbytes // shape[0] if shape[0] else 0
                wanted.append((key, dtype, [j - i, *shape[1:]], first, offset + i * row,
                               offset + j * row))
        offset += nbytes
    dest: dict[str, torch.Tensor] = {}
    for key, dtype, shape, first, *_ in wanted:
        asked = rows.get(key)
        exact = first is None or (asked is not None and first == asked[0]
                                  and shape[0] == asked[1] - asked[0])
        dest[key] = _destination(dtype, shape,
                                 into.get(key) if into is not None and exact else None)
    with Prefault(_fresh(dest, into)):
        blocks.fetch([(a, b) for *_, a, b in wanted])
        for key, *_, a, _ in wanted:
            blocks.copy_to(memoryview(dest[key].detach().reshape(-1).view(torch.uint8).numpy()),
                           a)
    return {key: (first, dest[key]) for key, _, _, first, *_ in wanted}


def _header_keys(fs: fsspec.AbstractFileSystem, path: str, info: dict) -> list[str]:
    """Tensor names in a safetensors file, from two small ranged reads of its JSON header."""
    try:
        (n,) = struct.unpack("<Q", fs.cat_file(path, start=0, end=8))
        if n > min(_MAX_HEADER, info["size"] - 8):
            raise ValueError(f"header length {n} exceeds the file")
        header = json.loads(fs.cat_file(path, start=8, end=8 + n))
        return [k for k in header if k != "__metadata__"]
    except (struct.error, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None


@contextlib.contextmanager
def _source(fs: fsspec.AbstractFileSystem, path: str, info: dict
            ) -> Iterator[FileReader | RangedReader]:
    """A reader of the file at `path` after its size matched `info`: the file itself when
    local, parallel ranged requests otherwise."""
    size = fs.size(path)
    if size != info["size"]:
        raise CheckpointError(f"{_shown(fs, path)}: {size} bytes, the manifest says "
                              f"{info['size']} (truncated or incomplete)")
    with FileReader(path) if isinstance(fs, LocalFileSystem) else \
            RangedReader(fs, path, size) as src:
        yield src


def _verify_file(fs: fsspec.AbstractFileSystem, path: str, info: dict) -> None:
    with _source(fs, path, info) as src:
        try:
            got = hash_stream(src, info.get("block_size"), digest_of(info)[0])
        except EOFError:
            raise CheckpointError(f"{_shown(fs, path)}: ended early (truncated)") from None
    _check_digest(_shown(fs, path), *got, info)


def _read_verified(fs: fsspec.AbstractFileSystem, path: str, info: dict,
                   keys: KeyFilter | None, into: Into | None = None
                   ) -> dict[str, torch.Tensor]:
    """The tensors (those `keys` selects) of the safetensors file at `path`, read in one pass
    straight into their own memory (or `into` the caller's: `_destination`) while other
    threads hash what arrived; returned only once the size and digest match `info`."""
    shown = _shown(fs, path)
    tensors: dict[str, torch.Tensor] = {}
    with _source(fs, path, info) as src:
        # read into buffers kept until the digest (the header's, the tensors' own memory)
        h = BackgroundHash(block_size=info.get("block_size"), stable=True,
                           algorithm=digest_of(info)[0])
        try:
            prefix = src.read(8)
            h.update(prefix)
            (n,) = struct.unpack("<Q", prefix)
            if n > min(_MAX_HEADER, info["size"] - 8):
                raise CheckpointError(f"{shown}: not a valid safetensors file (header length "
                                      f"{n} exceeds the file)")
            raw = src.read(n)
            h.update(raw)
            entries = _parse_header(raw, info["size"] - 8 - n, shown)
            for key, dtype, shape in entries:  # a piece of a tensor is never read over it
                if keys is None or keys(key):
                    whole = into is not None and key not in info.get("shards", {})
                    tensors[key] = _destination(dtype, shape, into.get(key) if whole else None)
            with Prefault(_fresh(tensors, into)):
                for view in src.fill(_chunks(entries, tensors, h)):
                    h.update(view)
            digest = h.hexdigest()
        except EOFError:
            h.close()
            raise CheckpointError(f"{shown}: ended early (truncated)") from None
        except BaseException:
            h.close()
            raise
    _check_digest(shown, info["size"], digest, info)
    return tensors


def _chunks(entries: list[tuple[str, torch.dtype, list]], tensors: dict[str, torch.Tensor],
            h: BackgroundHash) -> Iterator[memoryview]:
    """The memory a file's tensors are read into, in file order, in CHUNK pieces: each one's
    destination, or for one not wanted a buffer dropped once hashed (the next waits for it)."""
    for key, dtype, shape in entries:
        t = tensors.get(key)
        data = _raw_bytes(torch.empty(shape, dtype=dtype) if t is None else t)
        for i in range(0, len(data), CHUNK):
            yield data[i:i + CHUNK]
        if t is None:
            h.wait()


def _destination(dtype: torch.dtype, shape: list[int], live: torch.Tensor | None
                 ) -> torch.Tensor:
    """Where a tensor read is put: `live` (the caller's tensor it restores, when the bytes read
    are all of it: a piece assembled with others is never read over live state) if it has the
    dtype and shape, contiguous on the CPU; fresh memory otherwise."""
    if (live is not None and live.dtype == dtype and list(live.shape) == shape
            and live.device.type == "cpu" and live.is_contiguous()):
        return live
    return torch.empty(shape, dtype=dtype)


def _fresh(tensors: Mapping[str, torch.Tensor], into: Into | None) -> list[tuple[int, int]]:
    """(address, bytes) of the tensors not the caller's own (`into`): the memory a read
    faults in (`Prefault`), in order."""
    return [(t.data_ptr(), t.nbytes) for key, t in tensors.items()
            if into is None or t is not into.get(key)]


def _parse_header(raw: bytes, data_len: int, shown: str) -> list[tuple[str, torch.dtype, list]]:
    """(name, dtype, shape) of each tensor in file order, after checking the header as the
    safetensors format requires: known dtypes, offsets that match the shapes and tile the data
    region exactly."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{shown}: not a valid safetensors file ({why})")

    try:
        header = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    entries = []
    for key, e in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(e, dict) and e.get("dtype") in _DTYPE_OF
                and isinstance(e.get("shape"), list)
                and all(isinstance(d, int) and d >= 0 for d in e["shape"])
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and all(isinstance(o, int) for o in e["data_offsets"])):
            raise bad(f"entry {key!r} is not {{dtype, shape, data_offsets}}")
        entries.append((e["data_offsets"], key, _DTYPE_OF[e["dtype"]], e["shape"]))
    entries.sort(key=lambda x: x[0])
    end = 0
    for (start, stop), key, dtype, shape in entries:
        size = dtype.itemsize
        for d in shape:
            size *= d
        if start != end or stop - start != size:
            raise bad(f"entry {key!r}: data_offsets {[start, stop]} do not follow the "
                      f"previous tensor or do not fit its shape")
        end = stop
    if end != data_len:
        raise bad(f"the tensors cover {end} of {data_len} data bytes")
    return [(key, dtype, shape) for _, key, dtype, shape in entries]


def _shown(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _check_digest(path: str, size: int, digest: str, info: dict) -> None:
    if size != info["size"]:
        raise CheckpointError(f"{path}: {size} bytes, the manifest says {info['size']} "
                              "(truncated or incomplete)")
    algorithm, recorded = digest_of(info)
    if digest != recorded:
        raise CheckpointError(f"{path}: {algorithm} {digest[:16]}… does not match the "
                              f"manifest's {recorded[:16]}… (corrupt)")


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
