"""Reading a committed step directory: the tensors of its part files, or only some rows of them,
each file (or block) verified against the manifest before anything is returned.

Loading is safe: headers and manifests are JSON (validated as the safetensors format
requires), tensors are returned only after the file's size and digest match the manifest, and
nothing from storage is ever unpickled. Reading is one pass straight into the tensors, hashed
on a second thread as it goes; object stores are read as parallel ranged requests
(`checkpoint.streaming`); a read of some rows of a file hashed in blocks reads and checks only
the blocks holding them.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from relaytrain.checkpoint.manifest import read_manifest
from relaytrain.checkpoint.pieces import Piece, Rows, assemble, cut, rows_to_take
from relaytrain.checkpoint.safetensors_format import MAX_HEADER, parse_header, raw_bytes
from relaytrain.checkpoint.streaming import (
    CHUNK,
    HASH_THREADS,
    BackgroundHash,
    FileReader,
    Prefault,
    RangedReader,
    copy_bytes,
    digest_hex,
    digest_of,
    hash_stream,
    range_size,
)
from relaytrain.errors import CheckpointError

KeyFilter = Callable[[str], bool]
Into = Mapping[str, torch.Tensor]  # tensors a read fills in place (`CheckpointStore.read`)


def load_dir(fs: fsspec.AbstractFileSystem, d: str, keys: KeyFilter | None,
             step: int | None = None, rows: Rows | None = None, into: Into | None = None
             ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, tensors) of the step directory `d`, verifying what is read: each file read
    whole against its digest, or (`rows`, a file hashed in blocks) only the blocks holding the
    rows wanted, each against its own. Sharded tensors come back whole, or as the `rows` asked
    of them, assembled from every file holding a piece. A tensor that comes whole from one
    file, or whose rows asked one piece holds exactly, is read `into` the caller's tensor where
    it fits (`CheckpointStore.read`); rows from several pieces are copied into it once every
    file is verified."""
    manifest = read_manifest(fs, d, step)
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
    if n > min(MAX_HEADER, info["size"] - 8):
        raise CheckpointError(f"{shown}: not a valid safetensors file (header length {n} "
                              "exceeds the file)")
    offset, wanted = 8 + n, []  # (key, dtype, shape, first row, bytes a, bytes b)
    for key, dtype, shape in parse_header(blocks.get(8, 8 + n), info["size"] - 8 - n, shown):
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


def stored_keys(fs: fsspec.AbstractFileSystem, d: str, manifest: dict) -> set[str]:
    """The tensor names step directory `d` holds, from its files' headers (nothing else read)."""
    return {k for name, info in manifest["files"].items()
            for k in _header_keys(fs, f"{d}/{name}", info)}


def _header_keys(fs: fsspec.AbstractFileSystem, path: str, info: dict) -> list[str]:
    """Tensor names in a safetensors file, from two small ranged reads of its JSON header."""
    try:
        (n,) = struct.unpack("<Q", fs.cat_file(path, start=0, end=8))
        if n > min(MAX_HEADER, info["size"] - 8):
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


def verify_file(fs: fsspec.AbstractFileSystem, path: str, info: dict) -> None:
    """Hash the whole file at `path`; `CheckpointError` unless it matches `info`."""
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
            if n > min(MAX_HEADER, info["size"] - 8):
                raise CheckpointError(f"{shown}: not a valid safetensors file (header length "
                                      f"{n} exceeds the file)")
            raw = src.read(n)
            h.update(raw)
            entries = parse_header(raw, info["size"] - 8 - n, shown)
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
        data = raw_bytes(torch.empty(shape, dtype=dtype) if t is None else t)
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
