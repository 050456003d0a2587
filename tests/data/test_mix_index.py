"""`relaytrain data index`: an OLMo-core mix indexed in place, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relaytrain.cli import main
from relaytrain.data import mix_index
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.mix_index import index_mix
from relaytrain.data.token_arrays import MixFile, TokenArrays
from tests.data.conftest import EOS, write_tokens

VOCAB = 100_278
SIZES = {"web": [700, 333], "code": [517]}


@pytest.fixture()
def mix(tmp_path: Path) -> tuple[Path, Path]:
    """(base dir, manifest) of a three-file mix in OLMo-core's layout."""
    base = tmp_path / "store"
    lines = ["# a synthetic mix"]
    for s, (label, sizes) in enumerate(SIZES.items()):
        for i, n in enumerate(sizes):
            rel = f"preprocessed/{label}/{{TOKENIZER}}/part-{i}.npy"
            write_tokens(base / rel.replace("{TOKENIZER}", "dolma2-tokenizer"), n, seed=10 * s + i)
            lines.append(f"{label},{rel}")
    write_tokens(base / "eval" / "val.npy", 200, seed=99)
    manifest = tmp_path / "mix.txt"
    manifest.write_text("\n".join(lines) + "\n")
    return base, manifest


def index_args(base: Path, manifest: Path, out: Path, *extra: str) -> list[str]:
    return ["data", "index", "--mix", str(manifest), "--base", str(base), "--tokenizer-id",
            "dolma2-tokenizer", "--vocab-size", str(VOCAB), "--eos-id", str(EOS), "--heldout",
            str(base / "eval" / "val.npy"), "--out", str(out), *extra]


def test_an_indexed_mix_is_data_train_reads_in_place(mix: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    base, manifest = mix
    out = tmp_path / "index"
    assert main(index_args(base, manifest, out, "--json")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["train_files"] == 3 and summary["train_tokens"] == 700 + 333 + 517
    assert sorted(p.name for p in out.iterdir()) == ["index.json"]  # nothing copied
    ds = TokenDataset.open(out)
    assert (ds.kind, ds.vocab_size, ds.eos_id, ds.dtype) == ("olmo-core", VOCAB, EOS, "uint32")
    train = ds.split("train")
    assert train.labels == ["web", "web", "code"]
    assert train.num_documents == sum(
        int(np.count_nonzero(np.fromfile(p, "<u4") == EOS)) for p in train.paths)
    direct = TokenArrays(train.paths, "uint32")
    ids = np.arange(direct.num_instances(16))
    np.testing.assert_array_equal(train.instances(ids, 16), direct.instances(ids, 16))
    assert ds.split("heldout").require_instances(16) == 200 // 16


def test_the_fingerprint_follows_content_not_location(mix: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    base, manifest = mix
    files = [MixFile("web", str(p)) for p in sorted(base.rglob("part-*.npy"))]
    a = index_mix({"train": files}, tmp_path / "a", vocab_size=VOCAB, eos_id=EOS)
    copies = []
    for i, f in enumerate(files):
        copy = tmp_path / "moved" / str(i) / Path(f.path).name
        copy.parent.mkdir(parents=True)
        copy.write_bytes(Path(f.path).read_bytes())
        copies.append(MixFile("web", str(copy)))
    b = index_mix({"train": copies}, tmp_path / "b", vocab_size=VOCAB, eos_id=EOS)
    assert a["fingerprint"] == b["fingerprint"]
    Path(copies[0].path).write_bytes(Path(files[1].path).read_bytes())
    c = index_mix({"train": copies}, tmp_path / "c", vocab_size=VOCAB, eos_id=EOS)
    assert c["fingerprint"] != a["fingerprint"]


def test_an_interrupted_index_resumes_without_rescanning(mix: tuple[Path, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    base, manifest = mix
    files = [MixFile("web", str(p)) for p in sorted(base.rglob("part-*.npy"))]
    fresh = index_mix({"train": files}, tmp_path / "fresh", vocab_size=VOCAB, eos_id=EOS)
    scanned: list[str] = []
    real = mix_index.scan_file

    def interrupted(path: str, *args: object) -> dict:
        if len(scanned) == 2:
            raise KeyboardInterrupt
        scanned.append(path)
        return real(path, *args)

    monkeypatch.setattr(mix_index, "scan_file", interrupted)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        index_mix({"train": files}, out, vocab_size=VOCAB, eos_id=EOS, workers=1)
    assert not (out / "index.json").exists() and (out / "index.journal").exists()
    scanned.clear()
    monkeypatch.setattr(mix_index, "scan_file", lambda p, *a: scanned.append(p) or real(p, *a))
    assert index_mix({"train": files}, out, vocab_size=VOCAB, eos_id=EOS, workers=1) == fresh
    assert scanned == [files[2].path]
    assert sorted(p.name for p in out.iterdir()) == ["index.json"]


def corrupt(base: Path, how: str) -> str:
    """Damage the mix's first file (or its manifest) one way; the name the error must give."""
    part = base / "preprocessed/web/dolma2-tokenizer/part-0.npy"
    toks = np.fromfile(part, "<u4")
    if how == "vocab":
        toks[123] = VOCAB + 5
        toks.tofile(part)
        return rf"part-0.npy: token id {VOCAB + 5} at token 123 is >= the vocabulary size {VOCAB}"
    if how == "size":
        part.write_bytes(part.read_bytes()[:-2])
        return r"part-0.npy: 2798 bytes is not a multiple of 4 \(uint32 token ids\)"
    if how == "eos":
        toks[-1] = 7
        toks.tofile(part)
        return rf"part-0.npy: ends with token 7, not the EOS id {EOS}; the data's EOS differs"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["vocab", "size", "eos"])
def test_bad_token_files_are_one_line_naming_the_file_and_write_nothing(
        mix: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        how: str) -> None:
    base, manifest = mix
    message = corrupt(base, how)
    out = tmp_path / "index"
    assert main(index_args(base, manifest, out, "--workers", "2")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("relaytrain: error: token file ")
    assert pytest.importorskip("re").search(message, err), err
    assert not out.exists()


def test_a_manifest_line_naming_nothing_is_refused_before_any_scan(
        mix: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, manifest = mix
    manifest.write_text(manifest.read_text() + "code,\n")
    out = tmp_path / "index"
    assert main(index_args(base, manifest, out)) == 2
    err = capsys.readouterr().err
    assert "mix.txt line 5: 'code,' names no file" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_tokenizer_whose_eos_differs_from_the_given_one_is_refused(
        mix: tuple[Path, Path], tmp_path: Path, prepared: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    base, manifest = mix
    args = ["data", "index", "--files", str(base / "eval" / "val.npy"), "--tokenizer",
            str(prepared / "tokenizer.json"), "--out", str(tmp_path / "index")]
    assert main([*args, "--eos-id", str(EOS)]) == 2
    assert "differs from the EOS id" in capsys.readouterr().err
    assert main(args) == 2  # the tokenizer's own EOS and vocabulary do not fit the data
    assert "is >= the vocabulary size" in capsys.readouterr().err
    assert not (tmp_path / "index").exists()


def test_files_on_an_fsspec_url_are_indexed_and_read_in_place(mix: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    base, _ = mix
    fs = fsspec.filesystem("memory")
    local = sorted(base.rglob("part-*.npy"))
    urls = [f"memory://olmo-index-test/{i}/{p.name}" for i, p in enumerate(local)]
    for path, url in zip(local, urls, strict=True):
        fs.pipe(url, path.read_bytes())
    remote = index_mix({"train": [MixFile("web", u) for u in urls]}, tmp_path / "remote",
                       vocab_size=VOCAB, eos_id=EOS, workers=2)
    here = index_mix({"train": [MixFile("web", str(p)) for p in local]}, tmp_path / "local",
                     vocab_size=VOCAB, eos_id=EOS)
    assert remote["fingerprint"] == here["fingerprint"]
    split = TokenDataset.open(tmp_path / "remote").split("train")
    ids = np.arange(split.num_instances(16))
    np.testing.assert_array_equal(split.instances(ids, 16), TokenArrays(
        [str(p) for p in local], "uint32").instances(ids, 16))


def test_a_weighted_mixture_is_indexed_from_a_sources_file(
        mix: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, _ = mix
    tok = "preprocessed/{}/dolma2-tokenizer/part-{}.npy"
    sources = tmp_path / "mix.yaml"
    sources.write_text(f"""sources:
  - {{source_name: web, target_ratio: 0.7, paths: ["{tok.format('web', 0)}",
                                                  "{tok.format('web', 1)}"]}}
  - {{source_name: code, target_ratio: 0.3, paths: ["{tok.format('code', 0)}"],
     max_repetition_ratio: 2.0}}
""")
    args = ["data", "index", "--sources", str(sources), "--base", str(base), "--vocab-size",
            str(VOCAB), "--eos-id", str(EOS), "--requested-tokens", "1000", "--seq-len", "16",
            "--global-batch", "4", "--out", str(tmp_path / "index")]
    assert main(args) == 0
    index = json.loads((tmp_path / "index" / "index.json").read_text())
    rows = index["splits"]["train"]["files"]
    assert [r["label"] for r in rows] == ["web", "web", "code"]
    assert sum(r["tokens"] for r in rows) % 64 == 0 and index["mixture"]["seq_len"] == 16
    sources.write_text(sources.read_text().replace("0.3", "0.2"))
    assert main([*args[:-1], str(tmp_path / "bad")]) == 2
    assert "the target ratios sum to 0.9, not 1 (web 0.7, code 0.2)" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


SMALL_VOCAB = 50_000  # under 65,536: `data index` guesses uint16


def small_vocab_tokens(eos: int) -> np.ndarray:
    """2,000 ids of a small vocabulary in 50 documents, each ending with `eos`."""
    rng = np.random.default_rng(5)
    toks = rng.integers(1, SMALL_VOCAB - 1, size=2000)
    toks[np.sort(rng.choice(1999, size=49, replace=False))] = eos
    toks[-1] = eos
    return toks


@pytest.mark.parametrize("eos", [0, SMALL_VOCAB - 1])
def test_uint32_ids_of_a_small_vocabulary_read_as_guessed_uint16_are_refused_naming_dtype(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        eos: int) -> None:
    """Read as uint16, every other id is a high half of 0: with EOS 0 each token would end a
    document (1,000 documents where there are 50), with another EOS the file ends with 0.
    An explicit --dtype is taken as given; a genuine uint16 file is indexed as before."""
    monkeypatch.setattr(mix_index, "CHUNK", 6)  # reads of 3 uint16s: reads start at odd ids too
    toks = small_vocab_tokens(eos)
    wide, narrow = tmp_path / "wide.npy", tmp_path / "narrow.npy"
    toks.astype("<u4").tofile(wide)
    toks.astype("<u2").tofile(narrow)

    def index(path: Path, out: str, *extra: str) -> int:
        return main(["data", "index", "--files", str(path), "--vocab-size", str(SMALL_VOCAB),
                     "--eos-id", str(eos), "--out", str(tmp_path / out), "--json", *extra])

    assert index(wide, "guessed") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wide.npy: every other uint16 is 0" in err, err
    assert "pass --dtype uint32" in err and not (tmp_path / "guessed").exists()
    for path, out, extra in ((wide, "wide", ["--dtype", "uint32"]), (narrow, "narrow", [])):
        assert index(path, out, *extra) == 0
        summary = json.loads(capsys.readouterr().out)
        assert (summary["train_tokens"], summary["train_documents"]) == (2000, 50)
        assert summary["dtype"] == ("uint32" if extra else "uint16")
        split = TokenDataset.open(tmp_path / out).split("train")
        np.testing.assert_array_equal(split.instances([0, 1], 16).reshape(-1), toks[:32])
