"""Documents from text, JSONL and Parquet sources: local paths, globs, directories, fsspec URLs.

A source is read lazily, one file at a time, so memory does not grow with the corpus. Bad input
is a `DataError` that names the file (and line) and says what would be accepted.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.utils import infer_compression

from relaytrain.errors import DataError
from relaytrain.storage import filesystem

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")
ACCEPTED = "UTF-8 text files (one document each), JSONL (.jsonl) or Parquet (.parquet)"


@dataclass(frozen=True)
class SourceFile:
    """One resolved input file: the filesystem that reads it and the path within it."""

    fs: Any
    path: str
    name: str  # for messages: the URL or local path

    @property
    def kind(self) -> str:
        name = self.path.lower()
        for suffix in COMPRESSION_SUFFIXES:
            name = name.removesuffix(suffix)
        if name.endswith(JSONL_SUFFIXES):
            return "jsonl"
        if name.endswith(PARQUET_SUFFIXES):
            return "parquet"
        return "text"


@dataclass
class SourceStats:
    """What reading skipped, for the prepare summary."""

    empty: int = 0  # documents with no text
    undecodable: list[str] = field(default_factory=list)  # skipped files (demo only)


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def resolve(specs: Sequence[str]) -> list[SourceFile]:
    """Expand paths, globs, directories (all files below, sorted) and URLs, in the given order."""
    files: list[SourceFile] = []
    for spec in specs:
        try:
            fs, path = filesystem(spec)
            if _has_magic(path):
                paths = sorted(p for p, info in fs.glob(path, detail=True).items()
                               if info["type"] == "file")
                if not paths:
                    raise DataError(f"source {spec}: no files match; expected {ACCEPTED}")
            elif fs.isdir(path):
                paths = sorted(p for p in fs.find(path)
                               if not any(part.startswith(".")
                                          for part in p[len(path):].split("/")))
                if not paths:
                    raise DataError(f"source {spec}: the directory has no files; expected "
                                    f"{ACCEPTED}")
            elif fs.isfile(path):
                paths = [path]
            else:
                raise DataError(f"source {spec}: no such file or directory; expected {ACCEPTED}")
        except DataError:
            raise
        except (ImportError, ValueError, OSError) as e:
            raise DataError(f"source {spec}: cannot be read ({type(e).__name__}: {e})") from None
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        local = protocol in ("file", "local")
        files.extend(SourceFile(fs, p, p if local else fs.unstrip_protocol(p)) for p in paths)
    return files


def demo_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def demo_files() -> list[SourceFile]:
    """The running Python's standard-library source, sorted (site-packages excluded)."""
    stdlib = demo_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        paths.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    if not paths:
        raise DataError(f"--demo: no Python source files under {stdlib}")
    fs = fsspec.filesystem("file")
    return [SourceFile(fs, p, p) for p in sorted(paths)]


def _decode(data: bytes, name: str) -> str:
    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"source file {name} is binary (NUL byte at offset {nul}); expected "
                        f"{ACCEPTED}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"source file {name} is not UTF-8 text (invalid byte at offset "
                        f"{e.start}); expected {ACCEPTED}") from None


def _open(src: SourceFile, compressed: bool = True) -> Any:
    compression = infer_compression(src.path) if compressed else None
    return src.fs.open(src.path, "rb", compression=compression)


def _text_documents(src: SourceFile) -> Iterator[tuple[str, str]]:
    with _open(src) as f:
        yield src.name, _decode(f.read(), src.name)


def _jsonl_documents(src: SourceFile, text_field: str) -> Iterator[tuple[str, str]]:
    with _open(src) as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{src.name}:{lineno}"
            line = _decode(raw, where).strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); expected one JSON object "
                                "per line") from None
            if not isinstance(record, dict) or text_field not in record:
                have = ", ".join(map(str, record)) if isinstance(record, dict) else "none"
                raise DataError(f"{where}: no field '{text_field}' (fields: {have}); choose the "
                                "text field with --text-field")
            text = record[text_field]
            if text is not None and not isinstance(text, str):
                raise DataError(f"{where}: field '{text_field}' is {type(text).__name__}, "
                                "expected a string")
            if text and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise DataError(f"{where}: field '{text_field}' is not valid Unicode "
                                    f"({e.reason} at character {e.start})") from None
            yield where, text or ""


def _parquet_documents(src: SourceFile, text_field: str) -> Iterator[tuple[str, str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open(src, compressed=False) as f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"source file {src.name}: not a readable Parquet file ({e})") from None
        names = pf.schema_arrow.names
        if text_field not in names:
            raise DataError(f"{src.name}: no column '{text_field}' (columns: {', '.join(names)}); "
                            "choose the text column with --text-field")
        typ = pf.schema_arrow.field(text_field).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise DataError(f"{src.name}: column '{text_field}' has type {typ}, expected string")
        row = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                yield f"{src.name}:row {row}", text or ""
                row += 1


def iter_documents(files: Sequence[SourceFile], text_field: str = "text", *,
                   skip_undecodable: bool = False,
                   stats: SourceStats | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) of every non-empty document, in order.

    A text file that is binary or not UTF-8 is an error naming it, unless `skip_undecodable`
    (the demo corpus: the standard library deliberately contains mis-encoded test files).
    """
    stats = stats if stats is not None else SourceStats()
    for src in files:
        try:
            if src.kind == "jsonl":
                docs = _jsonl_documents(src, text_field)
            elif src.kind == "parquet":
                docs = _parquet_documents(src, text_field)
            else:
                docs = _text_documents(src)
            for name, text in docs:
                if text.strip():
                    yield name, text
                else:
                    stats.empty += 1
        except DataError:
            if not skip_undecodable:
                raise
            stats.undecodable.append(src.name)
        except OSError as e:
            raise DataError(f"source file {src.name}: cannot be read ({e})") from None
