"""`relaytrain data prepare`: text -> deduplicated, train/held-out split token files + index.

Documents are split by a hash of their text, so the split is stable (the same document lands on
the same side whatever else is in the corpus) and an exact duplicate, having the same hash, can
never be on both sides; duplicates are kept once. Everything is written into a temporary
directory next to --out and renamed into place after `index.json`, so an interrupted or failed
prepare never leaves a directory that looks complete. Memory does not grow with the corpus
except for the set of document hashes and the per-document offsets.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from relaytrain import __version__
from relaytrain.data.dataset import FORMAT_VERSION, INDEX, sha256_file
from relaytrain.data.sources import (
    SourceFile,
    SourceStats,
    demo_files,
    demo_root,
    iter_documents,
    resolve,
)
from relaytrain.errors import DataError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
MIN_BPE_VOCAB = 256 + 2  # the byte alphabet plus EOS and PAD
TOKENIZER_FILE = "tokenizer.json"
CHUNK_DOCS = 64  # documents per encode_batch call (Rust threads parallelise within a call)
CHUNK_CHARS = 2 << 20
SPLIT_RULE = "heldout iff int.from_bytes(sha256(utf8 text)[:8], 'big') < heldout_frac * 2**64"


def is_heldout(digest: bytes, heldout_frac: float) -> bool:
    """The split of a document, from the sha256 of its text (see SPLIT_RULE)."""
    return int.from_bytes(digest[:8], "big") < heldout_frac * 2**64


@dataclass
class PrepareResult:
    out: str
    documents: dict[str, int]
    tokens: dict[str, int]
    duplicates: int
    skipped_empty: int
    skipped_files: list[str]
    seconds: float
    tokenizer_seconds: float  # BPE training (0 for a given tokenizer)
    dtype: str
    vocab_size: int
    fingerprint: str
    tokens_per_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens_per_s = sum(self.tokens.values()) / max(self.seconds, 1e-9)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["skipped_files"] = len(self.skipped_files)
        return d


# ---- tokenizer -------------------------------------------------------------------------------

def _tokenizer_source(spec: str) -> int | Path:
    """bpe:VOCAB -> the vocabulary size to train; otherwise the tokenizer.json path."""
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            vocab = -1
        if not MIN_BPE_VOCAB <= vocab <= 2**32:
            raise DataError(f"--tokenizer {spec}: expected bpe:VOCAB with VOCAB an integer >= "
                            f"{MIN_BPE_VOCAB} (256 bytes + EOS + PAD)")
        return vocab
    path = Path(spec)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"--tokenizer {spec}: no such file; expected a HF tokenizer.json, a "
                        "directory containing one, or bpe:VOCAB")
    return path


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for every parse error
        raise DataError(f"--tokenizer {path}: not a loadable HF tokenizer.json ({e})") from None
    # Text that happens to contain "<|endoftext|>" is text: only prepare inserts EOS.
    tok.encode_special_tokens = True
    return tok


def _eos_id(tok: Any, path: Path, eos_token: str | None) -> tuple[str, int]:
    for name in (eos_token,) if eos_token else EOS_CANDIDATES:
        tid = tok.token_to_id(name)
        if tid is not None:
            return name, int(tid)
    tried = eos_token or ", ".join(EOS_CANDIDATES)
    raise DataError(f"--tokenizer {path}: no end-of-text token (tried {tried}); name the "
                    "tokenizer's EOS token with --eos-token")


def _train_bpe(vocab: int, texts: Iterator[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out))


# ---- corpus passes ---------------------------------------------------------------------------

@dataclass
class _Corpus:
    """One pass over the sources: unique documents with their digest and split."""

    files: list[SourceFile]
    text_field: str
    heldout_frac: float
    max_docs: int | None
    demo: bool
    stats: SourceStats = field(default_factory=SourceStats)
    duplicates: int = 0

    def __iter__(self) -> Iterator[tuple[bool, bytes, str]]:
        self.stats, self.duplicates, seen = SourceStats(), 0, set()
        docs = iter_documents(self.files, self.text_field, skip_undecodable=self.demo,
                              stats=self.stats)
        for count, (_, text) in enumerate(docs):
            if self.max_docs is not None and count >= self.max_docs:
                break
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            if digest in seen:
                self.duplicates += 1
                continue
            seen.add(digest)
            yield is_heldout(digest, self.heldout_frac), digest, text


class _SplitWriter:
    """Appends one split's documents (tokens + EOS) and collects their offsets and digests."""

    def __init__(self, root: Path, name: str, dtype: type[np.unsignedinteger]) -> None:
        self.name, self.root, self.dtype = name, root, dtype
        self.file = open(root / f"{name}.bin", "wb")  # closed in finish()
        self.lengths: list[int] = []
        self.digests: list[bytes] = []

    def add(self, docs: list[np.ndarray], digests: list[bytes]) -> None:
        if docs:
            self.file.write(np.concatenate(docs).tobytes())
            self.lengths.extend(len(d) for d in docs)
            self.digests.extend(digests)

    def finish(self) -> dict[str, Any]:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        lengths = np.asarray(self.lengths, dtype=np.int64)
        offsets = np.cumsum(lengths) - lengths
        np.save(self.root / f"{self.name}.docs.npy", np.stack([offsets, lengths], axis=1))
        digests = np.frombuffer(b"".join(self.digests), dtype=np.uint8).reshape(-1, 32)
        np.save(self.root / f"{self.name}.sha256.npy", digests)
        return {"file": f"{self.name}.bin", "tokens": int(lengths.sum()),
                "documents": len(self.lengths), "doc_offsets": f"{self.name}.docs.npy",
                "doc_hashes": f"{self.name}.sha256.npy"}


def _chunks(corpus: _Corpus) -> Iterator[list[tuple[bool, bytes, str]]]:
    chunk: list[tuple[bool, bytes, str]] = []
    chars = 0
    for doc in corpus:
        chunk.append(doc)
        chars += len(doc[2])
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


class _Encoder:
    """Tokens + EOS of each document of a chunk: the work a worker process does, with one
    Rust thread (TOKENIZERS_PARALLELISM=false): the parallelism is the worker processes. It is
    built from the tokenizer's JSON, not a path, so it runs on any node of a cluster."""

    def __init__(self, tok_json: str, eos_id: int, dtype: type[np.unsignedinteger]) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tok_json)
        tok.encode_special_tokens = True  # as _load_tokenizer
        self.encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        self.eos_id, self.dtype = eos_id, dtype

    def __call__(self, chunk: list[tuple[bool, bytes, str]]) -> list[tuple[bool, bytes,
                                                                          np.ndarray]]:
        out = []
        for (heldout, digest, _), enc in zip(chunk, self.encode(
                [text for _, _, text in chunk], add_special_tokens=False), strict=True):
            arr = np.empty(len(enc.ids) + 1, dtype=self.dtype)
            arr[:-1] = enc.ids
            arr[-1] = self.eos_id
            out.append((heldout, digest, arr))
        return out


# (factory of the per-worker function, items, workers (0: all the pool has), environment of
# the workers) -> the function's results in the items' order. `process_map` runs on this
# machine's cores; the CLI hands `prepare` a Ray cluster's (runtime/engines/ray_pool.py).
ChunkMap = Callable[[Callable[[], Callable[[Any], Any]], Iterable[Any], int, dict[str, str]],
                    Iterator[Any]]
IN_FLIGHT_PER_WORKER = 2  # items queued per worker: memory stays flat in corpus size
ENCODER_ENV = {"TOKENIZERS_PARALLELISM": "false"}
_WORKER_FN: Callable[[Any], Any] | None = None


def _start_worker(factory: Callable[[], Callable[[Any], Any]], env: dict[str, str]) -> None:
    global _WORKER_FN
    os.environ.update(env)
    _WORKER_FN = factory()


def _call_in_worker(item: Any) -> Any:
    assert _WORKER_FN is not None
    return _WORKER_FN(item)


def process_map(factory: Callable[[], Callable[[Any], Any]], items: Iterable[Any],
                workers: int, env: dict[str, str]) -> Iterator[Any]:
    """`ChunkMap` on this machine: in this process for one worker, else a pool of processes."""
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield from map(factory(), items)
        finally:
            for k, v in before.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        return
    # spawn: a fork of a process whose tokenizer threads have run can deadlock
    with mp.get_context("spawn").Pool(workers, _start_worker, (factory, env)) as pool:
        yield from in_order(lambda _, item: pool.apply_async(_call_in_worker, (item,)),
                            lambda result: result.get(), items, workers)


def in_order(submit: Callable[[int, Any], Any], get: Callable[[Any], Any], items: Iterable[Any],
             workers: int) -> Iterator[Any]:
    """Results of `submit(i, item)` (a future) read by `get`, in the items' order, with at most
    IN_FLIGHT_PER_WORKER per worker submitted and not yet read."""
    pending: deque[Any] = deque()
    for i, item in enumerate(items):
        pending.append(submit(i, item))
        if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
            yield get(pending.popleft())
    while pending:
        yield get(pending.popleft())


def _encode(corpus: _Corpus, writers: dict[bool, _SplitWriter],
            encoder: Callable[[], _Encoder], workers: int, mapper: ChunkMap,
            progress: bool) -> None:
    """Encode the corpus's chunks with `mapper` (in corpus order whatever the workers, so the
    bytes written do not depend on them) and append them to their splits."""
    bar = tqdm(desc="tokenizing", unit="doc", disable=None if progress else True,
               file=sys.stderr, dynamic_ncols=True)
    total = 0
    with bar:
        for encoded in mapper(encoder, _chunks(corpus), workers, ENCODER_ENV):
            for heldout in (False, True):
                mine = [(digest, arr) for h, digest, arr in encoded if h == heldout]
                writers[heldout].add([a for _, a in mine], [d for d, _ in mine])
            total += sum(arr.size for _, _, arr in encoded)
            bar.update(len(encoded))
            bar.set_postfix_str(f"{total / 1e6:.1f}M tokens", refresh=False)


# ---- the command -----------------------------------------------------------------------------

def _check_out(out: Path) -> None:
    if "://" in str(out):
        raise DataError(f"--out {out}: must be a local directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} already exists and is not empty; prepare never "
                        "overwrites, choose a new directory")


def prepare(sources: Sequence[str] | None, out: str | os.PathLike[str], tokenizer: str, *,
            text_field: str = "text", heldout_frac: float = 0.05, max_docs: int | None = None,
            eos_token: str | None = None, workers: int = 1, mapper: ChunkMap = process_map,
            progress: bool = False) -> PrepareResult:
    """Tokenize `sources` (None: the demo corpus) into the data directory `out`, encoding in
    `workers` processes of `mapper` (0: all it has: this machine's cores, the CLI's default,
    or a Ray cluster's CPUs); the bytes written depend on neither."""
    t0 = time.perf_counter()
    out = Path(out)
    if not 0 <= heldout_frac <= 1:
        raise DataError(f"--heldout-frac {heldout_frac}: expected a fraction in [0, 1] (1: an "
                        "evaluation set, every document held out)")
    if max_docs is not None and max_docs < 1:
        raise DataError(f"--max-docs {max_docs}: expected an integer >= 1")
    if workers < 0:
        raise DataError(f"--workers {workers}: expected an integer >= 1, or 0 for every core")
    _check_out(out)
    tok_source = _tokenizer_source(tokenizer)
    if heldout_frac == 1 and isinstance(tok_source, int):
        raise DataError(f"--heldout-frac 1 (an evaluation set) leaves no training text for "
                        f"--tokenizer {tokenizer}; give the training data's --tokenizer FILE")
    if isinstance(tok_source, Path):  # fail on a bad tokenizer before reading any data
        _eos_id(_load_tokenizer(tok_source), tok_source, eos_token)
    demo = sources is None
    files = demo_files() if demo else resolve(sources)
    corpus = _Corpus(files, text_field, heldout_frac, max_docs, demo)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        tok_file = tmp / TOKENIZER_FILE
        tok_seconds = 0.0
        if isinstance(tok_source, int):
            t = time.perf_counter()
            texts = (text for heldout, _, text in tqdm(
                corpus, desc="training BPE", unit="doc", disable=None if progress else True,
                file=sys.stderr, dynamic_ncols=True) if not heldout)
            _train_bpe(tok_source, texts, tok_file)
            tok_seconds = time.perf_counter() - t
        else:
            shutil.copyfile(tok_source, tok_file)
        tok = _load_tokenizer(tok_file)
        eos_name, eos_id = _eos_id(tok, tok_file, eos_token)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        dtype = np.uint16 if vocab <= 2**16 else np.uint32
        writers = {heldout: _SplitWriter(tmp, "heldout" if heldout else "train", dtype)
                   for heldout in (False, True)}
        try:
            encoder = functools.partial(_Encoder, tok_file.read_text(encoding="utf-8"),
                                        eos_id, dtype)
            _encode(corpus, writers, encoder, workers, mapper, progress)
        except BaseException:
            for w in writers.values():
                w.file.close()
            raise
        splits = {w.name: w.finish() for w in writers.values()}
        _check_documents({name: s["documents"] for name, s in splits.items()}, corpus,
                         heldout_frac)
        tok_meta = {"vocab_size": vocab, "eos_id": eos_id, "eos_token": eos_name,
                    "pad_id": tok.token_to_id(PAD_TOKEN), "source": tokenizer}
        index = _write_index(tmp, splits, np.dtype(dtype).name, tok_meta, corpus,
                             {"heldout_frac": heldout_frac, "text_field": text_field,
                              "max_docs": max_docs, "sources": _describe_sources(sources)})
        _check_out(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(
        out=str(out), documents={name: s["documents"] for name, s in splits.items()},
        tokens={name: s["tokens"] for name, s in splits.items()}, duplicates=corpus.duplicates,
        skipped_empty=corpus.stats.empty, skipped_files=corpus.stats.undecodable,
        seconds=time.perf_counter() - t0, tokenizer_seconds=tok_seconds,
        dtype=index["dtype"], vocab_size=vocab, fingerprint=index["fingerprint"])


def _describe_sources(sources: Sequence[str] | None) -> list[str]:
    if sources is None:
        return [f"demo: {demo_root()}/**/*.py (Python {platform.python_version()})"]
    return list(sources)


def _write_index(tmp: Path, splits: dict[str, Any], dtype: str, tok_meta: dict[str, Any],
                 corpus: _Corpus, settings: dict[str, Any]) -> dict[str, Any]:
    """Hash every file written, then write index.json (last, so its presence means done)."""
    files_meta = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                  for p in sorted(tmp.iterdir())}
    fingerprint = hashlib.sha256(json.dumps(
        {"format_version": FORMAT_VERSION, "dtype": dtype, "files": files_meta,
         "splits": splits}, sort_keys=True).encode()).hexdigest()
    index = {
        "format_version": FORMAT_VERSION, "dtype": dtype, "fingerprint": fingerprint,
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": files_meta[TOKENIZER_FILE]["sha256"],
                      **tok_meta},
        "splits": splits, "files": files_meta, "split_rule": SPLIT_RULE, **settings,
        "duplicates": corpus.duplicates, "skipped_empty": corpus.stats.empty,
        "skipped_files": corpus.stats.undecodable, "created_by": f"relaytrain {__version__}",
    }
    with open(tmp / INDEX, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return index


def _check_documents(documents: dict[str, int], corpus: _Corpus, heldout_frac: float) -> None:
    total = documents["train"] + documents["heldout"]
    if total == 0:
        raise DataError(f"the sources have no usable documents ({corpus.stats.empty} empty, "
                        f"{len(corpus.stats.undecodable)} unreadable files skipped); expected "
                        "non-empty UTF-8 text")
    if documents["train"] == 0 and heldout_frac < 1:
        raise DataError(f"all {total} unique documents fell into the held-out split "
                        f"(--heldout-frac {heldout_frac}); add documents or lower --heldout-frac")

