"""Weighted mixtures: the tokens each file contributes, held against OLMo-core's own
SourceMixtureDatasetConfig.build, and the mixtures it refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relaytrain.data.mixture import Source, allocate, check_sources
from relaytrain.errors import DataError

sm = pytest.importorskip("olmo_core.data.source_mixture")

SEQ_LEN = 16
GLOBAL_BATCH_TOKENS = 4 * SEQ_LEN


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Token files of uneven sizes (contents do not matter: only sizes are used)."""
    root = tmp_path_factory.mktemp("sources")
    sizes = {"web-0": 4000, "web-1": 2511, "code-0": 900, "code-1": 333, "math-0": 517}
    out = {}
    for name, n in sizes.items():
        path = root / f"{name}.npy"
        np.zeros(n, dtype="<u4").tofile(path)
        out[str(path)] = n
    return out


def sources(files: dict[str, int], ratios: dict[str, float],
            repetition: dict[str, float]) -> list[Source]:
    return [Source(name, ratios[name], tuple(p for p in files if Path(p).name.startswith(name)),
                   max_repetition_ratio=repetition.get(name, 1.0)) for name in ratios]


@pytest.mark.parametrize("ratios, repetition, requested", [
    ({"web": 0.6, "code": 0.3, "math": 0.1}, {}, 3000),
    ({"web": 0.5, "code": 0.3, "math": 0.2}, {"math": 3.0, "code": 2.0}, 4100),  # repeated
    ({"web": 0.7, "code": 0.2, "math": 0.1}, {}, 777),
])
def test_the_tokens_per_file_equal_olmo_cores(files: dict[str, int], ratios: dict[str, float],
                                              repetition: dict[str, float],
                                              requested: int) -> None:
    ours = allocate(sources(files, ratios, repetition), files, requested_tokens=requested,
                    global_batch_tokens=GLOBAL_BATCH_TOKENS, seq_len=SEQ_LEN)
    config = sm.SourceMixtureDatasetConfig(
        source_list=sm.SourceMixtureList(sources=[
            sm.SourceMixtureConfig(source_name=s.name, target_ratio=s.target_ratio,
                                   paths=list(s.paths),
                                   max_repetition_ratio=s.max_repetition_ratio)
            for s in sources(files, ratios, repetition)]),
        requested_tokens=requested, global_batch_size=GLOBAL_BATCH_TOKENS, render_tables=False,
        quiet=True)
    theirs = config.build(npdtype=np.uint32, sequence_length=SEQ_LEN).to_index()
    assert [(p, t) for (p, _), t in theirs.items()] == ours
    assert sum(t for _, t in ours) % GLOBAL_BATCH_TOKENS == 0
    assert len(ours) > len(files) if repetition else len(ours) == len(files)  # passes repeat


@pytest.mark.parametrize("ratios, message", [
    ({"web": 0.6, "code": 0.3}, r"the target ratios sum to 0.9, not 1 \(web 0.6, code 0.3\)"),
    ({"web": 0.0, "code": 1.0}, r"source 'web' target_ratio 0.0 is not in \(0, 1\]"),
])
def test_ratios_that_do_not_make_a_whole_are_one_error(files: dict[str, int],
                                                       ratios: dict[str, float],
                                                       message: str) -> None:
    with pytest.raises(DataError, match=rf"^mix.yaml: {message}"):
        check_sources(sources(files, ratios, {}), "mix.yaml")


def test_a_source_too_small_for_its_ratio_is_refused(files: dict[str, int]) -> None:
    with pytest.raises(DataError, match=r"source 'math' needs 3000 tokens at ratio 0.5 but has "
                                        r"at most 517"):
        allocate(sources(files, {"web": 0.5, "math": 0.5}, {}), files, requested_tokens=6000,
                 global_batch_tokens=GLOBAL_BATCH_TOKENS, seq_len=SEQ_LEN)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [1, 2])
def test_training_on_an_indexed_mixture_matches_olmo_cores_mixture_dataset(
        tmp_path: Path, dp: int) -> None:
    """OLMo-core's NumpyFSLDatasetMixture and its loader against ours on the indexed mixture:
    every batch's ids and tokens, two epochs, a repeated source."""
    from relaytrain.data.dataset import TokenDataset
    from relaytrain.data.loader import Loader
    from relaytrain.data.mix_index import MixturePlan, index_mix
    from tests.data.conftest import EOS, write_tokens

    olmo = pytest.importorskip("olmo_core.data")
    from olmo_core.data.numpy_dataset import NumpyFSLDatasetMixture
    files = {}
    for i, (name, n) in enumerate({"web-0": 3000, "web-1": 2100, "code-0": 700,
                                   "math-0": 400}.items()):
        write_tokens(tmp_path / f"{name}.npy", n, seed=i)
        files[str(tmp_path / f"{name}.npy")] = n
    plan = MixturePlan(tuple(sources(files, {"web": 0.6, "code": 0.25, "math": 0.15},
                                     {"math": 2.0, "code": 1.5})), requested_tokens=4000,
                       global_batch=4,
                       seq_len=SEQ_LEN)
    index = index_mix({}, tmp_path / "index", vocab_size=100_278, eos_id=EOS, mixture=plan)
    alloc = allocate(plan.sources, files, requested_tokens=4000,
                     global_batch_tokens=GLOBAL_BATCH_TOKENS, seq_len=SEQ_LEN)
    assert [(r["path"], r["tokens"]) for r in index["splits"]["train"]["files"]] == alloc
    split = TokenDataset.open(tmp_path / "index").split("train")

    for rank in range(dp):
        dataset = NumpyFSLDatasetMixture(
            *[p for p, _ in alloc], path_offset_index=dict(
                ((p, i), t) for i, (p, t) in enumerate(alloc)), seed=7,
            sequence_length=SEQ_LEN, pad_token_id=0, eos_token_id=EOS, vocab_size=100_278,
            dtype=np.uint32)
        dataset.work_dir = tmp_path / "olmo"
        dataset.prepare()
        loader = olmo.NumpyDataLoaderBase.wrap_numpy_dataset(
            dataset, global_batch_size=GLOBAL_BATCH_TOKENS, collator=olmo.DataCollator(
                pad_token_id=0), work_dir=tmp_path / "olmo", seed=3, dp_world_size=dp,
            dp_rank=rank, fs_local_rank=0, num_threads=0)
        theirs = []
        for epoch in (1, 2):
            loader.reshuffle(epoch=epoch, in_memory=True)
            theirs += [(b["index"].tolist(), b["input_ids"].numpy()) for b in loader]
            loader.reset()
        assert len(theirs) == 2 * (split.num_instances(SEQ_LEN) // 4)
        with Loader(split, SEQ_LEN, 3, 4, 1, rank, dp, prefetch=0, order="olmo-core") as ours:
            for k, (ids, tokens) in enumerate(theirs):
                batch = ours.get(k)
                assert batch.ids.tolist() == ids, (rank, k)
                rows = np.concatenate([mb.numpy() for _, mb in batch.micro_batches])
                np.testing.assert_array_equal(rows, tokens)
