"""`relaytrain data prepare`: the directory contract, the hash split, dedup, sources, and that
bad input is one clear error that leaves nothing behind."""

from __future__ import annotations

import gzip
import hashlib
import json
import socket
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models

from relaytrain.cli import main
from relaytrain.data import prepare as prep
from relaytrain.data.dataset import TokenDataset, sha256_file
from relaytrain.data.prepare import is_heldout, prepare
from relaytrain.errors import DataError

from .conftest import N_DOCS, make_doc, write_corpus


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def source_texts(corpus: Path) -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.glob("*.txt"))]
    return [t for t in texts if t.strip()]


def test_prepared_directory_follows_the_contract(prepared: Path):
    index = json.loads((prepared / "index.json").read_text())
    assert index["format_version"] == 1 and index["dtype"] == "uint16"
    assert index["tokenizer"]["vocab_size"] == 300 and index["tokenizer"]["eos_id"] == 0
    assert index["tokenizer"]["pad_id"] == 1
    for name in ("train", "heldout"):
        split = index["splits"][name]
        assert (prepared / split["file"]).stat().st_size == 2 * split["tokens"]
        assert (prepared / split["doc_offsets"]).is_file()
        assert (prepared / split["doc_hashes"]).is_file()
    assert set(index["files"]) == {p.name for p in prepared.iterdir()} - {"index.json"}
    for name, meta in index["files"].items():
        assert sha256_file(prepared / name) == meta["sha256"]
    ds = TokenDataset.open(prepared)
    assert ds.fingerprint == index["fingerprint"] and ds.vocab_size == 300


def test_documents_are_their_tokens_then_eos_and_decode_back(prepared: Path, corpus: Path):
    ds = TokenDataset.open(prepared)
    tok = Tokenizer.from_file(str(ds.tokenizer_path))
    by_hash = {sha(t): t for t in source_texts(corpus)}
    for name in ("train", "heldout"):
        split = ds.split(name)
        spans, digests = split.doc_spans(), split.doc_digests()
        assert spans[:, 1].sum() == split.num_tokens  # the documents tile the stream
        assert np.array_equal(spans[1:, 0], np.cumsum(spans[:, 1])[:-1])
        for (off, length), digest in zip(spans, digests, strict=True):
            doc = split.tokens[off:off + length]
            assert doc[-1] == ds.eos_id and ds.eos_id not in doc[:-1]
            assert tok.decode(doc[:-1].tolist()) == by_hash[bytes(digest).hex()]


def test_the_split_is_by_document_hash_so_it_is_stable(prepared: Path, corpus: Path, tmp_path):
    """Each document's side depends on its text alone, not on what else is in the corpus."""
    ds = TokenDataset.open(prepared)
    train, heldout = ds.doc_hashes("train"), ds.doc_hashes("heldout")
    texts = source_texts(corpus)
    assert len(train) + len(heldout) == len(set(texts)) == N_DOCS
    for t in texts:
        assert sha(t) in (heldout if is_heldout(hashlib.sha256(t.encode()).digest(), 0.2)
                          else train)
    subset = sorted(corpus.glob("doc_*.txt"))[::-2]  # half of the files, in reverse order
    prepare([str(p) for p in subset], tmp_path / "subset", str(ds.tokenizer_path),
            heldout_frac=0.2)
    sub = TokenDataset.open(tmp_path / "subset")
    assert sub.doc_hashes("train") <= train and sub.doc_hashes("heldout") <= heldout


def test_duplicates_are_kept_once_and_preparing_again_gives_the_same_bytes(
        corpus: Path, prepared: Path, tmp_path):
    result = prepare([str(corpus)], tmp_path / "d", "bpe:300", heldout_frac=0.2)
    assert result.duplicates == 1 and result.skipped_empty == 1
    assert sum(result.documents.values()) == N_DOCS
    assert result.fingerprint == TokenDataset.open(prepared).fingerprint  # BPE training too


@pytest.mark.timeout(120)
def test_any_number_of_workers_writes_the_same_bytes(corpus: Path, prepared: Path, tmp_path,
                                                     monkeypatch):
    monkeypatch.setattr(prep, "CHUNK_DOCS", 3)  # many chunks in flight at once

    def files(d: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(d.iterdir())}

    tokenizer = str(prepared / "tokenizer.json")
    one = prepare([str(corpus)], tmp_path / "one", tokenizer, heldout_frac=0.2, workers=1)
    two = prepare([str(corpus)], tmp_path / "two", tokenizer, heldout_frac=0.2, workers=2)
    assert one.fingerprint == two.fingerprint == TokenDataset.open(prepared).fingerprint
    assert files(tmp_path / "one") == files(tmp_path / "two")
    assert {k: v for k, v in files(prepared).items() if k != "index.json"} == \
        {k: v for k, v in files(tmp_path / "two").items() if k != "index.json"}


def test_fsspec_urls_are_sources(corpus: Path, tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    for p in sorted(corpus.glob("doc_0*.txt")):
        fs.pipe(f"/relaytrain-test/{p.name}", p.read_bytes())
    try:
        result = prepare(["memory://relaytrain-test/*.txt"], tmp_path / "d", "bpe:300")
    finally:
        fs.rm("/relaytrain-test", recursive=True)
    assert sum(result.documents.values()) == 10


def test_bpe_is_trained_on_the_training_split_only(tmp_path):
    """Text that only a held-out document contains must not shape the vocabulary."""
    src = tmp_path / "src"
    write_corpus(src, n_docs=20)
    i = 0
    while not is_heldout(hashlib.sha256(f"qzxv {i} ".encode() * 200).digest(), 0.2):
        i += 1
    (src / "secret.txt").write_text(f"qzxv {i} " * 200, encoding="utf-8")
    result = prepare([str(src)], tmp_path / "d", "bpe:400", heldout_frac=0.2)
    assert result.documents["heldout"] >= 1
    vocab = Tokenizer.from_file(str(tmp_path / "d" / "tokenizer.json")).get_vocab()
    assert len(vocab) > 300 and not any("q" in token and len(token) > 1 for token in vocab)


def test_jsonl_and_parquet_sources_read_the_text_field(tmp_path):
    import random

    rng = random.Random(1)
    docs = [make_doc(rng, 60) for _ in range(12)]
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as f:
        for d in docs[:4]:
            f.write(json.dumps({"content": d, "id": 1}) + "\n")
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as f:
        for d in docs[4:8]:
            f.write(json.dumps({"content": d}) + "\n\n")
    pq.write_table(pa.table({"content": docs[8:], "n": list(range(4))}),
                   tmp_path / "in" / "c.parquet")
    result = prepare([str(tmp_path / "in" / "*")], tmp_path / "d", "bpe:300",
                     text_field="content", heldout_frac=0.25)
    assert sum(result.documents.values()) == 12
    ds = TokenDataset.open(tmp_path / "d")
    assert ds.doc_hashes("train") | ds.doc_hashes("heldout") == {sha(d) for d in docs}


def test_bad_records_name_the_file_line_and_fields(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "hello"}\n')
    with pytest.raises(DataError, match=r"a\.jsonl:1: no field 'text' \(fields: body\)"):
        prepare([str(tmp_path / "a.jsonl")], tmp_path / "d", "bpe:300")
    (tmp_path / "s.jsonl").write_text('{"text": "bad \\ud800 surrogate"}\n')
    with pytest.raises(DataError, match=r"s\.jsonl:1: field 'text' is not valid Unicode"):
        prepare([str(tmp_path / "s.jsonl")], tmp_path / "d", "bpe:300")
    pq.write_table(pa.table({"body": ["hello"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet: no column 'text' \(columns: body\)"):
        prepare([str(tmp_path / "b.parquet")], tmp_path / "d", "bpe:300")
    assert not (tmp_path / "d").exists()


BAD_INPUTS = {
    "binary": ("good.txt bin.bin", "bpe:300", r"bin\.bin is binary \(NUL byte"),
    "not utf-8": ("good.txt latin.txt", "bpe:300", r"latin\.txt is not UTF-8 text"),
    "no documents": ("empty.txt", "bpe:300", "no usable documents"),
    "missing path": ("nope.txt", "bpe:300", r"nope\.txt: no such file"),
    "no glob match": ("*.nothing", "bpe:300", "no files match"),
    "unknown protocol": ("nosuchproto://x/y.txt", "bpe:300", "cannot be read"),
    "bad tokenizer": ("good.txt", "tokenizer.json", "not a loadable HF tokenizer.json"),
    "missing tokenizer": ("good.txt", "none/", "expected a HF tokenizer.json"),
    "tiny bpe": ("good.txt", "bpe:10", "VOCAB an integer >= 258"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_error_and_leaves_nothing(case, tmp_path):
    sources, tokenizer, message = BAD_INPUTS[case]
    (tmp_path / "good.txt").write_text("fine text\n")
    (tmp_path / "bin.bin").write_bytes(b"\x7fELF\x00\x01")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    before = set(tmp_path.iterdir())
    paths = [s if "://" in s else str(tmp_path / s) for s in sources.split()]
    tok = tokenizer if tokenizer.startswith("bpe:") else str(tmp_path / tokenizer)
    with pytest.raises(DataError, match=message):
        prepare(paths, tmp_path / "out", tok)
    assert set(tmp_path.iterdir()) == before


def test_an_existing_non_empty_out_is_never_overwritten(prepared: Path, corpus: Path):
    before = sorted(p.name for p in prepared.iterdir())
    with pytest.raises(DataError, match="already exists and is not empty"):
        prepare([str(corpus)], prepared, "bpe:300")
    assert sorted(p.name for p in prepared.iterdir()) == before


def test_an_interrupted_prepare_leaves_no_directory(corpus: Path, tmp_path, monkeypatch):
    def interrupt(self, docs, digests):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep._SplitWriter, "add", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(corpus)], tmp_path / "out", "bpe:300")
    assert list(tmp_path.iterdir()) == []


def test_a_given_tokenizer_file_or_directory_is_used_as_is(prepared: Path, corpus: Path,
                                                           tmp_path):
    ds = TokenDataset.open(prepared)
    for i, tok in enumerate((ds.tokenizer_path, prepared)):
        prepare([str(corpus / "*.txt")], tmp_path / f"d{i}", str(tok), heldout_frac=0.2)
        again = TokenDataset.open(tmp_path / f"d{i}")
        assert again.fingerprint == ds.fingerprint  # same tokenizer, same data: same bytes
        assert again.tokenizer_sha256 == ds.tokenizer_sha256


def test_special_token_text_in_a_document_is_not_eos(prepared: Path, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("before <|endoftext|> after\n")
    prepare([str(tmp_path / "src")], tmp_path / "d", str(prepared), heldout_frac=0)
    split = TokenDataset.open(tmp_path / "d").split("train")
    assert np.count_nonzero(split.tokens == 0) == 1 and split.tokens[-1] == 0


def test_a_vocabulary_beyond_uint16_is_stored_as_uint32(tmp_path):
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    from tokenizers import pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w5\n")
    prepare([str(tmp_path / "a.txt")], tmp_path / "d", str(tmp_path / "tokenizer.json"),
            heldout_frac=0)
    ds = TokenDataset.open(tmp_path / "d")
    assert ds.dtype == "uint32" and ds.split("train").tokens.tolist() == [3, 70001, 7, 0]


def test_cli_prints_json_last_and_errors_as_one_line(corpus: Path, tmp_path, capsys):
    assert main(["data", "prepare", "--source", str(corpus), "--tokenizer", "bpe:300",
                 "--out", str(tmp_path / "d"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["duplicates"] == 1 and sum(out["documents"].values()) == N_DOCS
    assert out["tokens_per_s"] > 0 and out["seconds"] > 0
    assert main(["data", "prepare", "--source", str(tmp_path / "missing"), "--tokenizer",
                 "bpe:300", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("relaytrain: error: source ")


def test_an_address_where_no_ray_cluster_answers_is_one_error_before_anything_is_written(
        corpus: Path, tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["data", "prepare", "--source", str(corpus), "--tokenizer", "bpe:300", "--out",
                 str(tmp_path / "d"), "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Ray cluster answers there" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_demo_corpus_with_max_docs(tmp_path, capsys):
    assert main(["data", "prepare", "--demo", "--max-docs", "30", "--tokenizer", "bpe:512",
                 "--out", str(tmp_path / "demo"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 25 <= sum(out["documents"].values()) <= 30 and out["tokens"]["train"] > 10_000
    index = json.loads((tmp_path / "demo" / "index.json").read_text())
    assert index["sources"][0].startswith("demo: ") and index["max_docs"] == 30
