"""Read a prepared data directory (docs/CONTRACTS.md "Prepared data directory").

Token streams are memory-mapped, so opening a data set and reading an instance cost the same
whatever the corpus size. Every way the directory can be unusable is a `DataError` that names
the directory and says what a prepared one looks like.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from relaytrain.data.token_arrays import KIND as MIX_KIND
from relaytrain.data.token_arrays import ArraySplit, open_splits
from relaytrain.errors import DataError

FORMAT_VERSION = 1
INDEX = "index.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SPLITS = ("train", "heldout")


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _plain_name(value: Any, what: str, where: Path) -> str:
    """A file name from the index, refused if it could point outside the directory."""
    if not isinstance(value, str) or not value or "/" in value or "\\" in value \
            or value in (".", ".."):
        raise DataError(f"{where}: index.json names an invalid {what} file {value!r}")
    return value


class TokenSplit:
    """One split's token stream; instance i is tokens[i*seq_len : i*seq_len + seq_len + 1]."""

    def __init__(self, root: Path, name: str, meta: dict[str, Any], dtype: str) -> None:
        self.name = name
        self.root = root
        self.dtype = np.dtype(DTYPES[dtype])
        try:
            self.num_tokens = int(meta["tokens"])
            self.num_documents = int(meta["documents"])
            self.file = root / _plain_name(meta["file"], f"{name} token", root)
            self._spans_file = root / _plain_name(meta["doc_offsets"], f"{name} offsets", root)
            self._hashes_file = root / _plain_name(meta["doc_hashes"], f"{name} hashes", root)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{root}: index.json split '{name}' is malformed ({e!r}); "
                            "re-run relaytrain data prepare") from None
        self._tokens: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Picklable (e.g. sent to a worker): the memory map is reopened on first use.
        return {**self.__dict__, "_tokens": None}

    @property
    def tokens(self) -> np.ndarray:
        """The whole stream, memory-mapped read-only."""
        if self._tokens is None:
            if self.num_tokens == 0:
                self._tokens = np.zeros(0, dtype=self.dtype)
            else:
                self._tokens = np.memmap(self.file, dtype=self.dtype, mode="r",
                                         shape=(self.num_tokens,))
        return self._tokens

    def num_instances(self, seq_len: int) -> int:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        return max(0, (self.num_tokens - 1) // seq_len)

    def require_instances(self, seq_len: int) -> int:
        """num_instances(seq_len), or a DataError that says which seq_len would fit."""
        n = self.num_instances(seq_len)
        if n == 0:
            fit = (f"a seq_len <= {self.num_tokens - 1} would fit" if self.num_tokens >= 2
                   else "no seq_len fits")
            hint = " or prepare with a larger --heldout-frac" if self.name == "heldout" else ""
            raise DataError(f"{self.root}: the {self.name} split has {self.num_tokens} tokens, "
                            f"no instance of seq_len {seq_len} (needs {seq_len + 1} tokens); "
                            f"{fit}{hint}")
        return n

    def instances(self, ids: Sequence[int] | np.ndarray, seq_len: int) -> np.ndarray:
        """int64 [len(ids), seq_len + 1]: inputs are [:, :-1], labels [:, 1:]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = self.num_instances(seq_len)
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise IndexError(f"instance ids must be in [0, {n}) for seq_len {seq_len} in the "
                             f"{self.name} split")
        out = np.empty((ids.size, seq_len + 1), dtype=np.int64)
        tokens = self.tokens
        for row, i in enumerate(ids.tolist()):  # one contiguous slice per sequence
            out[row] = tokens[i * seq_len: i * seq_len + seq_len + 1]
        return out

    def doc_spans(self) -> np.ndarray:
        """int64 [documents, 2]: (first token, token count including the EOS) per document."""
        spans = self._load_npy(self._spans_file)
        if spans.ndim != 2 or spans.shape != (self.num_documents, 2):
            raise DataError(f"{self._spans_file}: expected {self.num_documents} (offset, length) "
                            f"rows, got shape {spans.shape}; re-run relaytrain data prepare")
        return spans.astype(np.int64, copy=False)

    def doc_digests(self) -> np.ndarray:
        """uint8 [documents, 32]: the sha256 of each document's UTF-8 text."""
        digests = self._load_npy(self._hashes_file)
        if digests.shape != (self.num_documents, 32) or digests.dtype != np.uint8:
            raise DataError(f"{self._hashes_file}: expected {self.num_documents} sha256 digests, "
                            f"got {digests.dtype} {digests.shape}; re-run relaytrain data prepare")
        return digests

    def doc_hashes(self) -> set[str]:
        return {bytes(d).hex() for d in self.doc_digests()}

    def _load_npy(self, path: Path) -> np.ndarray:
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read ({e}); re-run relaytrain data prepare") from None


class TokenDataset:
    """A prepared data directory: its index, tokenizer and splits."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path = path
        self.index = index
        tok = index["tokenizer"]
        self.vocab_size = int(tok["vocab_size"])
        self.eos_id = int(tok["eos_id"])
        self.pad_id = tok.get("pad_id")
        self.fingerprint = str(index["fingerprint"])
        self.dtype = str(index["dtype"])
        # "prepared" (by `data prepare`), or "olmo-core" (a mix indexed in place by `data index`)
        self.kind = str(index.get("kind", "prepared"))
        self._splits: dict[str, TokenSplit | ArraySplit]
        if self.kind == MIX_KIND:
            self._splits = dict(open_splits(path, index))
            return
        self.tokenizer_sha256 = str(tok["sha256"])
        self.tokenizer_path = path / _plain_name(tok["file"], "tokenizer", path)
        self._splits = {name: TokenSplit(path, name, meta, self.dtype)
                        for name, meta in index["splits"].items()}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenDataset:
        if "://" in str(path) and not str(path).startswith("file://"):
            from relaytrain.data.remote import fetch_prepared

            path = fetch_prepared(str(path))  # a verified local copy, cached
        root = Path(str(path).removeprefix("file://"))
        what = "a directory written by `relaytrain data prepare` or `relaytrain data index`"
        if not root.is_dir():
            raise DataError(f"data dir {root} does not exist or is not a directory; "
                            f"expected {what}")
        index_file = root / INDEX
        if not index_file.is_file():
            raise DataError(f"data dir {root} has no {INDEX} (an interrupted prepare?); "
                            f"expected {what}")
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{index_file}: corrupt ({e}); re-run relaytrain data "
                            "prepare") from None
        if not isinstance(index, dict):
            raise DataError(f"{index_file}: expected a JSON object; re-run relaytrain data prepare")
        version = index.get("format_version")
        if version != FORMAT_VERSION:
            raise DataError(f"{index_file}: format_version {version!r} is not supported (this "
                            f"relaytrain reads version {FORMAT_VERSION}); re-run relaytrain data "
                            "prepare")
        try:
            if index["dtype"] not in DTYPES:
                raise ValueError(f"dtype {index['dtype']!r}")
            ds = cls(root, index)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{index_file}: malformed ({e!r}); re-run relaytrain data prepare") \
                from None
        for name in SPLITS:
            if name not in ds._splits:
                raise DataError(f"{index_file}: no '{name}' split; re-run relaytrain data prepare")
        for split in ds._splits.values():
            if not isinstance(split, TokenSplit):
                continue  # read in place: the sizes were checked by `data index`
            expected = split.num_tokens * split.dtype.itemsize
            try:
                size = split.file.stat().st_size
            except OSError:
                raise DataError(f"{split.file}: missing; the data dir is incomplete, re-run "
                                "relaytrain data prepare") from None
            if size != expected:
                raise DataError(f"{split.file}: {size} bytes, but the index says "
                                f"{split.num_tokens} {ds.dtype} tokens ({expected} bytes); the "
                                "data dir is corrupt or was modified, re-run relaytrain data "
                                "prepare")
        return ds

    def split(self, name: str) -> TokenSplit | ArraySplit:
        try:
            return self._splits[name]
        except KeyError:
            raise DataError(f"{self.path}: no split '{name}' (have: "
                            f"{', '.join(self._splits)})") from None

    def doc_hashes(self, name: str) -> set[str]:
        """sha256 hex digests of the split's documents (for contamination checks)."""
        return self.split(name).doc_hashes()
