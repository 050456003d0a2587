"""A small synthetic corpus and one data directory prepared from it, shared by the data tests."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from relaytrain.data.prepare import prepare
from tests.runtime.conftest import corpus_data  # noqa: F401  (a shared fixture)

# No word contains "q", so a test can recognise text that only a held-out document has.
WORDS = ("alpha beta gamma delta river stone cloud light paper garden window silver orange market "
         "winter summer forest engine signal thread number letter bridge castle planet rocket "
         "socket button camera pencil def class return import yield lambda").split()
N_DOCS = 40
EOS = 100_257  # the dolma2 tokenizer's, for OLMo-core token files


def make_doc(rng: random.Random, words: int) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(WORDS))
        if len(line) >= rng.randint(4, 12):
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)]).strip() + "\n"


def write_corpus(root: Path, n_docs: int = N_DOCS, seed: int = 0) -> list[Path]:
    """n_docs distinct text documents, plus one exact duplicate and one empty file."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_docs):
        p = root / f"doc_{i:02d}.txt"
        p.write_text(f"document {i}\n" + make_doc(rng, rng.randint(80, 300)), encoding="utf-8")
        paths.append(p)
    (root / "zz_duplicate.txt").write_text(paths[3].read_text(encoding="utf-8"), encoding="utf-8")
    (root / "zz_empty.txt").write_text("", encoding="utf-8")
    return paths


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root)
    return root


@pytest.fixture(scope="session")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus tokenized with a 300-token BPE, 20% held out."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare([str(corpus / "*.txt")], out, "bpe:300", heldout_frac=0.2)
    return out


def write_tokens(path: Path, n_tokens: int, seed: int) -> None:
    """An OLMo-core token file: random ids below EOS, documents of random length, each
    ending in EOS."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, EOS, size=n_tokens, dtype=np.int64)
    ends = np.sort(rng.choice(n_tokens, size=max(1, n_tokens // 40), replace=False))
    toks[ends] = EOS
    toks[-1] = EOS
    path.parent.mkdir(parents=True, exist_ok=True)
    toks.astype("<u4").tofile(path)


def olmo_core_batches(dataset: object, work_dir: Path, *, global_tokens: int, seed: int,
                      pad: int, dp: int, rank: int, epochs: int,
                      fields: tuple[str, ...] = ("input_ids",)) -> list[tuple]:
    """(instance ids, *fields) of every batch rank `rank` of `dp` gets from OLMo-core's own
    data loader over a prepared OLMo-core `dataset`, epoch by epoch."""
    from olmo_core import data as olmo_data

    loader = olmo_data.NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset, global_batch_size=global_tokens, collator=olmo_data.DataCollator(
            pad_token_id=pad), work_dir=work_dir, seed=seed, dp_world_size=dp, dp_rank=rank,
        fs_local_rank=0, num_threads=0)
    out = []
    for epoch in range(1, epochs + 1):
        loader.reshuffle(epoch=epoch, in_memory=True)
        out += [(b["index"].tolist(), *(b[f].numpy() for f in fields)) for b in loader]
        loader.reset()
    return out
