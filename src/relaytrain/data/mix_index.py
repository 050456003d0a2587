"""`relaytrain data index`: index an OLMo-core mix in place (docs/CONTRACTS.md "Mix index").

Every file is streamed once, never copied: its size must be whole token ids, every id must be
below the vocabulary, and it must end with the EOS (a file ending otherwise was tokenized with
another EOS, or is truncated). What `train` and `data audit` need (paths, token and document
counts, a sha256 per file, the fingerprint) goes into OUT/index.json, written last and renamed
into place. Files are scanned in parallel; each one done is appended to OUT/index.journal, so
an interrupted index resumes where it stopped. Bad input writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from relaytrain.data.mixture import Source, allocate, check_sources
from relaytrain.data.prepare import PAD_TOKEN, _eos_id, _load_tokenizer, _tokenizer_source
from relaytrain.data.token_arrays import (
    DTYPES,
    KIND,
    MixFile,
    dtype_for_vocab,
    file_tokens,
    join,
    read_manifest,
)
from relaytrain.errors import DataError, UserError
from relaytrain.storage import filesystem, redact

INDEX = "index.json"
JOURNAL = "index.journal"
CHUNK = 16 << 20  # bytes per read
# A file of uint32 ids below 65,536 read as uint16 (the width guessed from the vocabulary, as
# OLMo-core guesses it) has every other uint16, the ids' high halves, 0: with EOS 0 each token
# ends a "document". Genuine uint16 text has a zero at every one of WIDTH_PAIRS odd positions
# only if nearly all its tokens are 0: with id 0 at a rate p, p ** 64 (1e-128 for EOS 0 and
# 100-token documents; 5e-20 even at p = 1/2). A shorter file cannot tell. Only a guessed width
# is checked, and refused rather than warned of: `--dtype uint16` still indexes such a file.
WIDTH_PAIRS = 64


def scan_file(path: str, dtype: str, vocab_size: int, eos_id: int,
              guessed: bool = False) -> dict[str, Any]:
    """Stream `path` once: its token and document (EOS) counts and sha256, or a DataError naming
    the file and its first bad token (or, when `dtype` was `guessed`, the wrong width)."""
    tokens = file_tokens(path, dtype)
    dt = DTYPES[dtype]
    digest = hashlib.sha256()
    documents = seen = 0
    last = None
    high_zero = guessed and dt.itemsize == 2  # every odd uint16 so far is 0
    fs, inner = filesystem(path)
    with fs.open(inner, "rb", block_size=CHUNK) as f:
        while block := f.read(CHUNK - CHUNK % dt.itemsize):
            digest.update(block)
            ids = np.frombuffer(block, dtype=dt)
            over = np.flatnonzero(ids >= vocab_size)
            if over.size:
                raise DataError(f"token file {redact(path)}: token id {int(ids[over[0]])} at "
                                f"token {seen + int(over[0])} is >= the vocabulary size "
                                f"{vocab_size}; the data was tokenized with another tokenizer")
            documents += int(np.count_nonzero(ids == eos_id))
            high_zero = high_zero and not ids[1 - seen % 2::2].any()
            seen += ids.size
            last = int(ids[-1])
    if seen != tokens:
        raise DataError(f"token file {redact(path)}: read {seen} tokens, its size says {tokens}; "
                        "the file changed while it was indexed")
    if high_zero and tokens >= 2 * WIDTH_PAIRS:
        raise DataError(f"token file {redact(path)}: every other uint16 is 0 (read so, its "
                        f"{tokens:,} tokens hold {documents:,} documents), the pattern of uint32 "
                        f"ids read as uint16; the width was guessed from the vocabulary of "
                        f"{vocab_size:,} ids: pass --dtype uint32 (or --dtype uint16 if the file "
                        "really is uint16)")
    if last is not None and last != eos_id:
        raise DataError(f"token file {redact(path)}: ends with token {last}, not the EOS id "
                        f"{eos_id}; the data's EOS differs from the tokenizer's (or the file is "
                        "truncated)")
    return {"tokens": tokens, "documents": documents, "sha256": digest.hexdigest()}


def _journal_key(path: str, dtype: str, vocab_size: int, eos_id: int) -> str:
    return json.dumps([path, dtype, vocab_size, eos_id])


def _read_journal(out: Path) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    try:
        lines = (out / JOURNAL).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return done
    for line in lines:
        try:
            rec = json.loads(line)
            done[rec["key"]] = rec["scan"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line: that file is scanned again
    return done


@dataclass(frozen=True)
class MixturePlan:
    """A weighted training mixture (mixture.py) and what its allocation is computed for."""

    sources: tuple[Source, ...]
    requested_tokens: int
    global_batch: int  # instances
    seq_len: int

    def to_json(self) -> dict[str, Any]:
        return {"sources": [asdict(s) for s in self.sources], **{
            k: getattr(self, k) for k in ("requested_tokens", "global_batch", "seq_len")}}


def index_mix(splits: dict[str, Sequence[MixFile]], out: str | os.PathLike[str], *,
              vocab_size: int, eos_id: int, pad_id: int | None = None, dtype: str | None = None,
              tokenizer_id: str = "", workers: int = 0,
              mixture: MixturePlan | None = None) -> dict[str, Any]:
    """Scan every file of `splits` ("train", and optionally "heldout") and write OUT/index.json;
    returns the index. With `mixture`, the training split is the mixture's sources, each file
    taking what OLMo-core's source mixture allocates it (repeated sources repeat files)."""
    if mixture is not None:
        check_sources(mixture.sources, "--sources")
        splits = {**splits, "train": [MixFile(s.name, p) for s in mixture.sources
                                      for p in s.paths]}
    out = Path(out)
    guessed = dtype is None
    dtype = dtype or dtype_for_vocab(vocab_size)
    if dtype not in DTYPES:
        raise DataError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if vocab_size < 1 or not 0 <= eos_id < vocab_size:
        raise DataError(f"EOS id {eos_id} is not in a vocabulary of {vocab_size} ids")
    if not any(splits.values()):
        raise DataError("no files given; expected --mix MANIFEST, --files FILE... or --sources "
                        "MIX.yaml for training, or --heldout FILE... / --heldout-mix MANIFEST "
                        "for an evaluation set")
    if (out / INDEX).exists():
        raise DataError(f"--out {out}: already holds an {INDEX}; indexing never overwrites, "
                        "choose a new directory")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        done = _read_journal(out)
        files = [f for name in ("train", "heldout") for f in splits.get(name, ())]
        todo = list(dict.fromkeys(f.path for f in files if _journal_key(
            f.path, dtype, vocab_size, eos_id) not in done))
        with open(out / JOURNAL, "a", encoding="utf-8") as journal, \
                ThreadPoolExecutor(max(1, workers or os.cpu_count() or 1)) as pool:
            for path, scan in zip(todo, pool.map(
                    lambda p: scan_file(p, dtype, vocab_size, eos_id, guessed), todo),
                    strict=True):
                key = _journal_key(path, dtype, vocab_size, eos_id)
                done[key] = scan
                journal.write(json.dumps({"key": key, "scan": scan}) + "\n")
                journal.flush()
        if mixture is not None:
            splits = {**splits, "train": _allocated(mixture, {
                p: done[_journal_key(p, dtype, vocab_size, eos_id)]["tokens"]
                for s in mixture.sources for p in s.paths})}
        index = _index(splits, done, dtype=dtype, vocab_size=vocab_size, eos_id=eos_id,
                       pad_id=pad_id, tokenizer_id=tokenizer_id)
        if mixture is not None:
            index["mixture"] = mixture.to_json()
        tmp = out / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=1), encoding="utf-8")
        os.replace(tmp, out / INDEX)
        (out / JOURNAL).unlink()
    except UserError:  # bad input: leave nothing behind (an interruption keeps the journal)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            (out / JOURNAL).unlink(missing_ok=True)
        raise
    return index


def _allocated(mixture: MixturePlan, file_tokens: dict[str, int]) -> list[MixFile]:
    source_of = {p: s.name for s in mixture.sources for p in s.paths}
    rows = allocate(mixture.sources, file_tokens, requested_tokens=mixture.requested_tokens,
                    global_batch_tokens=mixture.global_batch * mixture.seq_len,
                    seq_len=mixture.seq_len, where="--sources")
    return [MixFile(source_of[path], path, take=tokens) for path, tokens in rows]


def _index(splits: dict[str, Sequence[MixFile]], done: dict[str, dict[str, Any]], *,
           dtype: str, vocab_size: int, eos_id: int, pad_id: int | None,
           tokenizer_id: str) -> dict[str, Any]:
    meta = {}
    for name, files in splits.items():
        rows = [{"label": f.label, "path": f.path,
                 **done[_journal_key(f.path, dtype, vocab_size, eos_id)]} for f in files]
        for row, f in zip(rows, files, strict=True):
            if f.take is not None:  # a mixture takes the file's first `take` tokens
                row.update(file_tokens=row["tokens"], tokens=f.take)
        meta[name] = {"files": rows, "tokens": sum(r["tokens"] for r in rows),
                      "documents": sum(r["documents"] for r in rows)}
    content = {name: [(r["label"], os.path.basename(r["path"]), r["tokens"], r["sha256"])
                      for r in s["files"]] for name, s in meta.items()}
    fingerprint = hashlib.sha256(json.dumps(
        {"kind": KIND, "dtype": dtype, "vocab_size": vocab_size, "eos_id": eos_id,
         "splits": content}, sort_keys=True).encode()).hexdigest()
    return {"format_version": 1, "kind": KIND, "dtype": dtype, "fingerprint": fingerprint,
            "tokenizer": {"vocab_size": vocab_size, "eos_id": eos_id, "pad_id": pad_id,
                          "id": tokenizer_id},
            "splits": meta}


# ---- what the command line names ---------------------------------------------------------------

def mix_files(mix: str | None, files: Sequence[str] | None, base: str, tokenizer_id: str,
              label: str) -> list[MixFile]:
    """A split's files: a manifest's lines, else the files given, labelled `label`."""
    if mix:
        return read_manifest(mix, base, tokenizer_id)
    return [MixFile(label, p) for p in files or ()]


def tokenizer_ids(tokenizer: str | None, eos_token: str | None, vocab_size: int | None,
                  eos_id: int | None, pad_id: int | None) -> tuple[int, int, int | None]:
    """(vocab size, EOS id, PAD id) from --tokenizer, or --vocab-size/--eos-id/--pad-id."""
    if tokenizer:
        path = _tokenizer_source(tokenizer)
        if not isinstance(path, Path):
            raise DataError(f"--tokenizer {tokenizer}: expected a tokenizer.json")
        tok = _load_tokenizer(path)
        eos = _eos_id(tok, path, eos_token)[1]
        if eos_id is not None and eos_id != eos:
            raise DataError(f"--eos-id {eos_id} differs from the EOS id {eos} of "
                            f"--tokenizer {path}")
        return tok.get_vocab_size(with_added_tokens=True), eos, tok.token_to_id(PAD_TOKEN)
    if vocab_size is None or eos_id is None:
        raise DataError("give --tokenizer FILE, or both --vocab-size and --eos-id")
    return vocab_size, eos_id, pad_id


def read_plan(path: str, base: str, requested_tokens: int | None, seq_len: int | None,
              global_batch: int | None) -> MixturePlan:
    """--sources MIX.yaml with --requested-tokens, --seq-len and --global-batch."""
    where = f"--sources {path}"
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        sources = tuple(Source(str(s["source_name"]), float(s["target_ratio"]),
                               tuple(join(base, str(p)) for p in s["paths"]),
                               float(s.get("max_repetition_ratio", 1.0)),
                               float(s.get("max_source_fraction", 1.0)))
                        for s in doc["sources"])
    except OSError as e:
        raise DataError(f"{where}: cannot read ({e.strerror})") from None
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{where}: expected 'sources:' entries with source_name, target_ratio "
                        f"and paths ({type(e).__name__}: {e})") from None
    sizes = (requested_tokens, seq_len, global_batch)
    if any(v is None or v < 1 for v in sizes):
        raise DataError(f"{where} needs --requested-tokens, --seq-len and --global-batch >= 1")
    return MixturePlan(sources, requested_tokens=requested_tokens, global_batch=global_batch,
                       seq_len=seq_len)
