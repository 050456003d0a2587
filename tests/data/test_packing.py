"""Packed instances against ai2-olmo-core's NumpyPackedFSLDataset and its data loader, run in
this process on the same files: instance ids, tokens and document lengths, step by step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relaytrain.data import packing
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.loader import Loader
from relaytrain.data.mix_index import index_mix
from relaytrain.data.packing import PackedSplit, best_fit_decreasing, model_inputs
from relaytrain.data.token_arrays import MixFile
from relaytrain.errors import DataError
from tests.data.conftest import EOS, olmo_core_batches

olmo_data = pytest.importorskip("olmo_core.data")

VOCAB, PAD = 100_278, 100_277
SEQ_LEN = 64
BATCH = 4
SEED = 34521
GROUP, PERMUTATION = 3, 123


def write_documents(path: Path, seed: int) -> None:
    """A token file of documents from 1 token to 2.5 x SEQ_LEN (the long ones truncated when
    packed), each ending in EOS (`data index` refuses a file that does not)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, EOS, size=int(rng.choice([rng.integers(1, 20),
                                                       rng.integers(20, SEQ_LEN + 1),
                                                       rng.integers(SEQ_LEN, 160)])))
            for _ in range(int(rng.integers(8, 30)))]
    toks = np.concatenate([np.append(d, EOS) for d in docs])
    path.parent.mkdir(parents=True, exist_ok=True)
    toks.astype("<u4").tofile(path)


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("packed-mix")
    paths = [root / f"{'web' if i % 2 else 'code'}-{i}.npy" for i in range(8)]
    for i, path in enumerate(paths):
        write_documents(path, seed=i)
    return [str(p) for p in paths]


@pytest.fixture(scope="module")
def indexed(mix: list[str], tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    out = tmp_path_factory.mktemp("index") / "mix"
    index_mix({"train": [MixFile(Path(p).stem.split("-")[0], p) for p in mix]}, out,
              vocab_size=VOCAB, eos_id=EOS, pad_id=PAD)
    return TokenDataset.open(out)


def packed(ds: TokenDataset) -> PackedSplit:
    return PackedSplit(ds.split("train"), SEQ_LEN, ds.pad_id, GROUP, PERMUTATION)


def olmo_batches(paths: list[str], work_dir: Path, dp: int, rank: int, epochs: int) -> list:
    """(ids, input_ids, doc_lens, label_mask) of every batch rank `rank` of `dp` gets from
    OLMo-core's packed dataset (built from its config: the source permutation is there)."""
    dataset = olmo_data.NumpyPackedFSLDatasetConfig(
        paths=paths, sequence_length=SEQ_LEN, generate_doc_lengths=True,
        source_group_size=GROUP, source_permutation_seed=PERMUTATION, work_dir=str(work_dir),
        tokenizer=olmo_data.TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS,
                                            pad_token_id=PAD)).build()
    dataset.prepare()
    return olmo_core_batches(dataset, work_dir, global_tokens=BATCH * SEQ_LEN, seed=SEED,
                             pad=PAD, dp=dp, rank=rank, epochs=epochs,
                             fields=("input_ids", "doc_lens", "label_mask"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp", [1, 2])
def test_every_step_of_two_epochs_is_olmo_cores_packed_instance(mix, indexed, tmp_path, dp):
    split = packed(indexed)
    batches_per_epoch = split.num_instances(SEQ_LEN) // BATCH
    assert batches_per_epoch >= 4
    for rank in range(dp):
        theirs = olmo_batches(mix, tmp_path, dp, rank, epochs=2)
        assert len(theirs) == 2 * batches_per_epoch
        with Loader(split, SEQ_LEN, SEED, BATCH, 1, rank, dp, prefetch=0,
                    order="olmo-core") as loader:
            for k, (ids, tokens, doc_lens, label_mask) in enumerate(theirs):
                batch = loader.get(k)
                assert batch.ids.tolist() == ids, f"dp {dp} rank {rank} batch {k}"
                rows = torch.cat([mb for _, mb in batch.micro_batches]).numpy()
                np.testing.assert_array_equal(rows, tokens)
                for i, (j, _) in enumerate(batch.micro_batches):
                    lens, real = batch.documents[j]
                    mine = lens[0][lens[0] > 0].tolist()
                    assert mine == doc_lens[i][doc_lens[i] > 0].tolist()
                    assert int(real[0]) == int(label_mask[i].sum())


def test_long_documents_are_truncated_and_padding_is_ignored_by_the_loss(indexed):
    split = packed(indexed)
    rows = split.instances(np.arange(split.num_instances(SEQ_LEN)), SEQ_LEN)
    assert (rows == PAD).any() and (rows[:, -1] != EOS).any()  # padded, and truncated rows
    ids = np.arange(3)
    docs = packing.micro_batch_documents(split, ids, rows[:3])
    inputs, labels, lens = model_inputs(torch.from_numpy(rows[:3]), docs)
    assert inputs.shape == (3, SEQ_LEN - 1) and (lens.sum(1) == SEQ_LEN - 1).all()
    real = docs[1]
    for r in range(3):
        assert (labels[r, : real[r] - 1] != -100).all() and (labels[r, real[r] - 1:] == -100).all()
    # whole (what a cp split takes): every token an input, the same labels scored, and one more
    # ignored at the end, as OLMo-core's get_labels
    inputs_w, labels_w, lens_w = model_inputs(torch.from_numpy(rows[:3]), docs, whole=True)
    assert torch.equal(inputs_w, torch.from_numpy(rows[:3])) and torch.equal(lens_w, docs[0])
    assert torch.equal(labels_w[:, :-1], labels) and (labels_w[:, -1] == -100).all()


def test_best_fit_takes_the_fullest_instance_that_still_holds_a_document():
    bins, order = best_fit_decreasing(np.array([5, 9, 3, 7, 2, 8, 4], np.uint64), 16)
    lengths = [9, 8, 7, 5, 4, 3, 2]
    assert [[lengths[d] for d in b] for b in bins] == [[9, 7], [8, 5, 3], [4, 2]]
    assert np.array_equal(np.array([5, 9, 3, 7, 2, 8, 4])[order], lengths)


def test_a_broken_packing_order_is_caught(mix, indexed, tmp_path, monkeypatch):
    """First fit instead of best fit: the same documents, other instances."""
    def first_fit(lengths, capacity):
        order = np.argsort(-1 * lengths.astype(np.int64))
        bins, room = [], []
        for doc, n in enumerate(lengths[order].tolist()):
            b = next((i for i, r in enumerate(room) if r >= n), None)
            if b is None:
                bins.append([])
                room.append(capacity)
                b = len(bins) - 1
            bins[b].append(doc)
            room[b] -= n
        return bins, order

    monkeypatch.setattr(packing, "best_fit_decreasing", first_fit)
    split = packed(indexed)
    theirs = olmo_batches(mix, tmp_path, 1, 0, epochs=1)
    assert any(not np.array_equal(split.instances(ids, SEQ_LEN), tokens)
               for ids, tokens, _, _ in theirs)


def test_data_without_document_boundaries_cannot_be_packed(prepared, indexed):
    """A `data prepare` directory keeps no OLMo-core documents to pack; OLMo-core's packer
    needs a power-of-two length."""
    with pytest.raises(DataError, match="packs OLMo-core token arrays") as e:
        PackedSplit(TokenDataset.open(prepared).split("train"), SEQ_LEN, 0)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="power-of-two data.seq_len"):
        PackedSplit(indexed.split("train"), 48, PAD)
    with pytest.raises(DataError, match="no PAD id"):
        PackedSplit(indexed.split("train"), SEQ_LEN, None)
