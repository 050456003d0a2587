"""OLMo-core's token arrays and order, held against ai2-olmo-core itself.

The reference is olmo_core's own NumpyFSLDataset and NumpyFSLDataLoader run in this process on
the same files; nothing is re-implemented in the test.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from relaytrain.data.dataset import TokenDataset
from relaytrain.data.loader import Loader
from relaytrain.data.mix_index import index_mix
from relaytrain.data.olmo_order import (
    OlmoOrder,
    micro_positions,
    rank_micro_batches,
    rank_positions,
)
from relaytrain.data.token_arrays import MixFile, TokenArrays, parse_manifest, read_manifest
from relaytrain.errors import DataError
from tests.data.conftest import EOS, olmo_core_batches, write_tokens

olmo_data = pytest.importorskip("olmo_core.data")

VOCAB, PAD = 100_278, 100_277
SEQ_LEN = 16
BATCH = 8  # instances per global batch
SEED = 1234


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Five files of uneven length, several with a tail shorter than SEQ_LEN, one too short to
    hold an instance."""
    root = tmp_path_factory.mktemp("mix")
    sizes = [1000, 517, 15, 2049, 333]
    paths = [root / f"part-{i}.npy" for i in range(len(sizes))]
    for i, (path, n) in enumerate(zip(paths, sizes, strict=True)):
        write_tokens(path, n, seed=i)
    return [str(p) for p in paths]


def olmo_batches(paths: list[str], work_dir: Path, dp: int, rank: int,
                 epochs: int) -> list[tuple[list[int], np.ndarray]]:
    """(instance ids, input_ids) of every batch rank `rank` of `dp` gets from OLMo-core."""
    dataset = olmo_data.NumpyFSLDataset(*paths, sequence_length=SEQ_LEN, pad_token_id=PAD,
                                        eos_token_id=EOS, vocab_size=VOCAB, dtype=np.uint32)
    dataset.work_dir = work_dir
    dataset.prepare()
    return olmo_core_batches(dataset, work_dir, global_tokens=BATCH * SEQ_LEN, seed=SEED,
                             pad=PAD, dp=dp, rank=rank, epochs=epochs)


@pytest.fixture(scope="module")
def indexed(mix: list[str], tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    out = tmp_path_factory.mktemp("index") / "mix"
    index_mix({"train": [MixFile("synthetic", p) for p in mix]}, out, vocab_size=VOCAB,
              eos_id=EOS)
    return TokenDataset.open(out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_every_step_of_two_epochs_matches_olmo_core(mix: list[str], indexed: TokenDataset,
                                                    tmp_path: Path, dp: int,
                                                    micro_batch: int) -> None:
    """What each DP rank trains on, step by step, through the loader training uses."""
    split = indexed.split("train")
    batches_per_epoch = split.num_instances(SEQ_LEN) // BATCH
    for rank in range(dp):
        theirs = olmo_batches(mix, tmp_path, dp, rank, epochs=2)
        assert len(theirs) == 2 * batches_per_epoch
        with Loader(split, SEQ_LEN, SEED, BATCH, micro_batch, rank, dp, prefetch=0,
                    order="olmo-core") as loader:
            for k, (their_ids, their_tokens) in enumerate(theirs):
                batch = loader.get(k)
                assert batch.ids.tolist() == their_ids, f"dp {dp} rank {rank} batch {k}"
                assert set(batch.epochs.tolist()) == {k // batches_per_epoch}
                rows = torch.cat([mb for _, mb in batch.micro_batches]).numpy()
                if micro_batch == 1:  # rows in rank order; otherwise grouped by micro-batch
                    np.testing.assert_array_equal(rows, their_tokens)
                np.testing.assert_array_equal(rows[np.lexsort(rows.T)],
                                              their_tokens[np.lexsort(their_tokens.T)])


def test_the_micro_batches_are_the_same_tokens_at_every_world_size(
        indexed: TokenDataset) -> None:
    split = indexed.split("train")
    seen = {}
    for dp in (1, 2, 4):
        got = {}
        for rank in range(dp):
            with Loader(split, SEQ_LEN, SEED, BATCH, 2, rank, dp, prefetch=0,
                        order="olmo-core") as loader:
                got.update((j, mb.numpy()) for j, mb in loader.get(5).micro_batches)
        assert sorted(got) == list(range(BATCH // 2))
        for j, rows in got.items():
            np.testing.assert_array_equal(seen.setdefault(j, rows), rows)


def test_olmo_core_order_needs_an_indexed_mix(prepared: Path) -> None:
    with pytest.raises(DataError, match="index its token files with `relaytrain data index`"):
        Loader(TokenDataset.open(prepared).split("train"), SEQ_LEN, SEED, BATCH, 1, 0, 1,
               order="olmo-core")


def test_the_epochs_differ_and_drop_the_tail(mix: list[str]) -> None:
    arrays = TokenArrays(mix, "uint32")
    n = arrays.num_instances(SEQ_LEN)
    assert n == sum(t // SEQ_LEN for t in (1000, 517, 15, 2049, 333))
    order = OlmoOrder(SEED, n, BATCH)
    first = np.concatenate([order.global_batch(k)[1] for k in range(order.batches_per_epoch)])
    second = order.global_batch(order.batches_per_epoch)[1]
    assert len(set(first.tolist())) == first.size == order.batches_per_epoch * BATCH < n
    assert not np.array_equal(first[:BATCH], second)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_micro_batches_are_the_same_for_every_world_size_and_cover_the_ranks_share(
        dp: int) -> None:
    B, m = 16, 2
    owned = {r: list(rank_micro_batches(B, m, r, dp)) for r in range(dp)}
    assert sorted(j for js in owned.values() for j in js) == list(range(B // m))
    for r, js in owned.items():
        mine = np.concatenate([micro_positions(B, m, j) for j in js])
        assert sorted(mine.tolist()) == rank_positions(B, r, dp).tolist()


# ---- manifests and bad input ------------------------------------------------------------------

def test_a_manifest_in_olmo_cores_form_names_files_under_the_base(tmp_path: Path) -> None:
    text = "# a comment\n\nweb,preprocessed/web/{TOKENIZER}/part-0.npy\n" \
           "code , preprocessed/code/{TOKENIZER}/part-0.npy\n"
    files = parse_manifest(text, "m.txt", "s3://bucket/", "dolma2-tokenizer")
    assert [(f.label, f.path) for f in files] == [
        ("web", "s3://bucket/preprocessed/web/dolma2-tokenizer/part-0.npy"),
        ("code", "s3://bucket/preprocessed/code/dolma2-tokenizer/part-0.npy")]
    manifest = tmp_path / "mix.txt"
    manifest.write_text(text)
    assert read_manifest(str(manifest), "/data", "t")[0].path == \
        "/data/preprocessed/web/t/part-0.npy"


def test_files_on_an_fsspec_url_are_read_in_place_like_local_ones(mix: list[str]) -> None:
    fs = fsspec.filesystem("memory")
    urls = [f"memory://olmo-mix/{Path(p).name}" for p in mix[:2]]
    for path, url in zip(mix, urls, strict=False):
        fs.pipe(url, Path(path).read_bytes())
    local, remote = TokenArrays(mix[:2], "uint32"), TokenArrays(urls, "uint32")
    ids = np.arange(local.num_instances(SEQ_LEN))
    np.testing.assert_array_equal(remote.instances(ids, SEQ_LEN), local.instances(ids, SEQ_LEN))


@pytest.mark.parametrize("line, problem", [
    ("web", "is not two comma-separated fields"),
    ("web,", "names no file"),
    ("web,preprocessed/{TOKENIZER}/", "names no file"),
    (",preprocessed/{TOKENIZER}/a.npy", "has an empty label"),
    ("web,preprocessed/dolma2/a.npy", "has no {TOKENIZER}"),
])
def test_a_manifest_line_naming_nothing_is_one_error_with_its_line(line: str,
                                                                   problem: str) -> None:
    with pytest.raises(DataError, match=rf"mix.txt line 2: .*{problem}") as e:
        parse_manifest(f"ok,a/{{TOKENIZER}}/b.npy\n{line}\n", "mix.txt", "", "t")
    assert "expected 'label,relative/path/{TOKENIZER}/file.npy'" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="lists no files"):
        parse_manifest("# nothing\n", "mix.txt", "", "t")


def test_a_file_that_is_not_whole_token_ids_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "odd.npy"
    bad.write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match=r"odd.npy: 10 bytes is not a multiple of 4 \(uint32"):
        TokenArrays([str(bad)], "uint32")
    with pytest.raises(DataError, match=r"missing.npy: cannot read"):
        TokenArrays([str(tmp_path / "missing.npy")], "uint16")


def test_a_token_id_outside_the_vocabulary_is_refused_naming_its_file(tmp_path: Path) -> None:
    path = tmp_path / "big.npy"
    toks = np.arange(64, dtype="<u4")
    toks[37] = VOCAB
    toks.tofile(path)
    arrays = TokenArrays([str(path)], "uint32", vocab_size=VOCAB)
    np.testing.assert_array_equal(arrays.instances([0], SEQ_LEN)[0], np.arange(SEQ_LEN))
    with pytest.raises(DataError, match=rf"big.npy: token id {VOCAB} at token 37 is >= the "
                                        rf"vocabulary size {VOCAB}"):
        arrays.instances([2], SEQ_LEN)


def test_olmo_core_reads_what_data_prepare_writes(prepared: Path, tmp_path: Path) -> None:
    """data prepare's token files are OLMo-core token arrays: indexed in place, they give the
    instances OLMo-core's dataset gives."""
    ds = TokenDataset.open(prepared)
    train = str(prepared / "train.bin")
    index_mix({"train": [MixFile("train", train)]}, tmp_path / "index",
              vocab_size=ds.vocab_size, eos_id=ds.eos_id, dtype=ds.dtype)
    ours = TokenDataset.open(tmp_path / "index").split("train")
    theirs = olmo_data.NumpyFSLDataset(train, sequence_length=SEQ_LEN, pad_token_id=0,
                                       eos_token_id=ds.eos_id, vocab_size=ds.vocab_size,
                                       dtype=np.uint16)
    assert len(theirs) == ours.num_instances(SEQ_LEN) > 100
    np.testing.assert_array_equal(
        ours.instances(np.arange(len(theirs)), SEQ_LEN),
        np.stack([theirs[i]["input_ids"].numpy() for i in range(len(theirs))]))
