"""A step directory's names and its manifest.json, the commit marker: what a manifest must hold
before a reader trusts the files it lists (docs/CONTRACTS.md "Checkpoints").

A manifest maps each part file to its size and digest (whole-file, and one per verified block
in files hashed in blocks) and, for a part holding shards, the rows of each whole tensor it
holds; the shards of every tensor must tile its rows exactly once.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any

import fsspec

from relaytrain.checkpoint.streaming import DIGESTS, block_root, digest_of
from relaytrain.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUFFIX = ".safetensors"
RECORD_SUFFIX = ".record.json"  # a part's record, beside it (write_part)
STEP_DIR = re.compile(r"step_(\d{8,})")
RESERVED = ("format_version", "step", "files", "committed_at")
# A file's manifest entry: its digest under the algorithm's name (streaming.DIGESTS)
FILE_FIELDS = ("size", *DIGESTS, "block_size", "blocks", "shards")


def read_manifest(fs: fsspec.AbstractFileSystem, d: str, step: int | None = None) -> dict:
    """The parsed manifest of step directory `d` (recording `step`, if given), once it is
    valid; `CheckpointError` naming the file if it is absent or malformed."""
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
    gap = untiled(files)
    if gap:
        raise CheckpointError(f"{path}: {gap}")
    return m


def _valid_blocks(info: dict) -> bool:
    """A file hashed in blocks (its entry names `block_size`) lists one digest per block, and
    its digest is theirs; an older entry (whole-file digest only) is valid as it is. The entry
    has a digest (`read_manifest` checks that first)."""
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


def untiled(files: dict[str, dict]) -> str | None:
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
