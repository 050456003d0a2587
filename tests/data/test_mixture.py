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
