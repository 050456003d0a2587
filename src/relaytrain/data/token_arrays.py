"""OLMo-core's token arrays, read in place (docs/CONTRACTS.md "OLMo-core token arrays").

A file is raw little-endian token ids (uint16 for vocabularies up to 65,536, uint32 above), no
header, documents separated by EOS. As in olmo_core's NumpyFSLDataset, instance i of a file is
its tokens [i*L, (i+1)*L), the tail shorter than L is dropped, and the files' instances are
numbered one after another in the order the files are listed. Files stay where they are (a local
path or any fsspec URL): local ones are memory-mapped, remote ones read by byte range.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relaytrain.errors import DataError
from relaytrain.storage import filesystem, redact, scheme

KIND = "olmo-core"  # index.json "kind" of a mix indexed in place
TOKENIZER_PLACEHOLDER = "{TOKENIZER}"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
MANIFEST_FORM = "'label,relative/path/{TOKENIZER}/file.npy'"


@dataclass(frozen=True)
class MixFile:
    """One file of a mix: its source label, where it is, and (in a weighted mixture) how many
    of its first tokens the mixture takes (None: all)."""

    label: str
    path: str
    take: int | None = None


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest dtype OLMo-core stores ids of a `vocab_size` vocabulary in."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def join(base: str, path: str) -> str:
    """`path` under the base directory or URL `base` (OLMo-core's DataMix.build)."""
    return path if not base else f"{base.rstrip('/')}/{path}"


def parse_manifest(text: str, where: str, base: str, tokenizer_id: str) -> list[MixFile]:
    """The files of a mix manifest in OLMo-core's form: one `label,path` line per file, the path
    relative to `base` with `{TOKENIZER}` standing for `tokenizer_id`; '#' comments and blank
    lines are skipped."""
    files = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        problem = ("is not two comma-separated fields" if len(fields) != 2
                   else "names no file" if not fields[1] or fields[1].endswith("/")
                   else "has an empty label" if not fields[0]
                   else f"has no {TOKENIZER_PLACEHOLDER} in its path"
                   if TOKENIZER_PLACEHOLDER not in fields[1] else "")
        if problem:
            raise DataError(f"{where} line {lineno}: {line!r} {problem}; expected "
                            f"{MANIFEST_FORM}")
        label, path = fields
        files.append(MixFile(label, join(base, path.replace(TOKENIZER_PLACEHOLDER,
                                                            tokenizer_id))))
    if not files:
        raise DataError(f"{where}: lists no files; expected lines of {MANIFEST_FORM}")
    return files


def read_manifest(manifest: str, base: str, tokenizer_id: str) -> list[MixFile]:
    """parse_manifest of a local or fsspec-URL manifest file."""
    fs, path = filesystem(manifest)
    try:
        text = fs.cat_file(path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"mix manifest {redact(manifest)}: cannot read ({e})") from None
    return parse_manifest(text, f"mix manifest {redact(manifest)}", base, tokenizer_id)


def file_tokens(path: str, dtype: str) -> int:
    """The number of tokens in `path`, refusing a size that is not a whole number of ids."""
    fs, inner = filesystem(path)
    try:
        size = int(fs.size(inner))
    except (OSError, TypeError, ValueError) as e:
        raise DataError(f"token file {redact(path)}: cannot read ({e})") from None
    itemsize = DTYPES[dtype].itemsize
    if size % itemsize:
        raise DataError(f"token file {redact(path)}: {size} bytes is not a multiple of "
                        f"{itemsize} ({dtype} token ids); the file is truncated or not "
                        f"{dtype}")
    return size // itemsize


class TokenArrays:
    """A list of OLMo-core token files as fixed-length instances.

    `lengths[i]` is file i's token count (from its size, or given by an index); `vocab_size`,
    when given, is checked on every instance read, so an id out of range fails naming its file.
    """

    def __init__(self, paths: Sequence[str], dtype: str, tokens: Sequence[int] | None = None,
                 vocab_size: int | None = None) -> None:
        if dtype not in DTYPES:
            raise DataError(f"token dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.paths = [str(p) for p in paths]
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.lengths = np.asarray(tokens if tokens is not None
                                  else [file_tokens(p, dtype) for p in self.paths], dtype=np.int64)
        self._maps: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # memory maps reopen on first use

    def offsets(self, seq_len: int) -> np.ndarray:
        """int64 [files + 1]: file i's instances are ids offsets[i] .. offsets[i+1] - 1."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        return np.concatenate([[0], np.cumsum(self.lengths // seq_len)])

    def num_instances(self, seq_len: int) -> int:
        return int(self.offsets(seq_len)[-1])

    def instances(self, ids: Sequence[int] | np.ndarray, seq_len: int) -> np.ndarray:
        """int64 [len(ids), seq_len]: the tokens of each instance."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        offsets = self.offsets(seq_len)
        if ids.size and (ids.min() < 0 or ids.max() >= offsets[-1]):
            raise IndexError(f"instance ids must be in [0, {offsets[-1]}) for seq_len {seq_len}")
        files = np.searchsorted(offsets, ids, side="right") - 1
        out = np.empty((ids.size, seq_len), dtype=np.int64)
        for row, (f, i) in enumerate(zip(files.tolist(), ids.tolist(), strict=True)):
            start = (i - int(offsets[f])) * seq_len
            out[row] = self.read(f, start, seq_len)
            if self.vocab_size is not None and out[row].max(initial=0) >= self.vocab_size:
                pos = start + int(np.argmax(out[row] >= self.vocab_size))
                raise DataError(f"token file {redact(self.paths[f])}: token id "
                                f"{int(out[row].max())} at token {pos} is >= the vocabulary "
                                f"size {self.vocab_size}; the data was tokenized with another "
                                "tokenizer")
        return out

    def read(self, file: int, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of file `file`."""
        dt = DTYPES[self.dtype]
        path = self.paths[file]
        if scheme(path) == "file":
            mm = self._maps.get(file)
            if mm is None:
                local = path.removeprefix("file://")
                mm = self._maps[file] = np.memmap(local, dtype=dt, mode="r") \
                    if os.path.getsize(local) else np.zeros(0, dt)
            got = np.asarray(mm[start:start + count])
        else:
            fs, inner = filesystem(path)
            raw = fs.cat_file(inner, start=start * dt.itemsize, end=(start + count) * dt.itemsize)
            got = np.frombuffer(raw, dtype=dt)
        if got.size != count:
            raise DataError(f"token file {redact(path)}: {got.size} tokens at token {start}, "
                            f"expected {count}; the file is shorter than when it was indexed")
        return got


class ArraySplit(TokenArrays):
    """One split of an indexed mix, read in place, with the TokenSplit interface the loader,
    the evaluation and the controller use."""

    def __init__(self, root: Path, name: str, meta: dict[str, Any], dtype: str,
                 vocab_size: int, eos_id: int) -> None:
        files = meta["files"]
        super().__init__([f["path"] for f in files], dtype,
                         tokens=[int(f["tokens"]) for f in files], vocab_size=vocab_size)
        self.root = root
        self.name = name
        self.eos_id = eos_id
        self.labels = [str(f["label"]) for f in files]
        self.num_tokens = int(meta["tokens"])
        self.num_documents = int(meta["documents"])

    def require_instances(self, seq_len: int) -> int:
        n = self.num_instances(seq_len)
        if n == 0:
            hint = " or index with --heldout FILE..." if self.name == "heldout" else ""
            raise DataError(f"{self.root}: the {self.name} split has no file of {seq_len} "
                            f"tokens or more (no instance of seq_len {seq_len}); use a shorter "
                            f"data.seq_len{hint}")
        return n

    @property
    def tokens(self) -> TokenStream:
        """The files one after another, sliceable like TokenSplit.tokens (the audit's n-gram
        scan reads it in chunks)."""
        return TokenStream(self)

    def doc_spans(self) -> np.ndarray:
        """int64 [documents, 2]: (first token, length including the EOS); reads the split."""
        ends = np.flatnonzero(np.asarray(self.tokens) == self.eos_id)
        starts = np.concatenate([[0], ends[:-1] + 1])[:ends.size]
        return np.stack([starts, ends - starts + 1], axis=1).astype(np.int64)


class TokenStream:
    """A split's files as one read-only token sequence; slices read only what they cover."""

    def __init__(self, arrays: TokenArrays) -> None:
        self.arrays = arrays
        self.starts = np.concatenate([[0], np.cumsum(arrays.lengths)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("a token stream is sliced with step 1")
        parts = []
        for f in range(len(self.arrays.paths)):
            lo, hi = max(start, self.starts[f]), min(stop, self.starts[f + 1])
            if lo < hi:
                parts.append(self.arrays.read(f, int(lo - self.starts[f]), int(hi - lo)))
        return np.concatenate(parts) if parts else np.zeros(0, DTYPES[self.arrays.dtype])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def open_splits(root: Path, index: dict[str, Any]) -> dict[str, ArraySplit]:
    """The splits of a mix index (a missing held-out split is an empty one)."""
    tok = index["tokenizer"]
    splits = dict(index["splits"])
    splits.setdefault("heldout", {"files": [], "tokens": 0, "documents": 0})
    return {name: ArraySplit(root, name, meta, index["dtype"], int(tok["vocab_size"]),
                             int(tok["eos_id"]))
            for name, meta in splits.items()}
