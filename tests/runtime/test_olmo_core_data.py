"""Training on an OLMo-core mix indexed in place, in OLMo-core's order (data.order olmo-core):
stopped and resumed, and resized 4 -> 2 -> 4 on real Ray actors, it stays bit-identical to one
uninterrupted worker in exact mode, and `data audit` passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.summary import RunSummary
from tests.runtime.conftest import (
    assert_bit_identical,
    index_token_mix,
    tiny_config,
)

pytestmark = pytest.mark.timeout(480)  # three Ray starts at dp 4, 2, 4 on 2 shared cores

VOCAB, EOS = 320, 319
# 8 micro-batches of 1 split over 1, 2 and 4 workers; 2 micro-batches per rank at dp 4.
OLMO = ("data.order=olmo-core", "determinism=exact", "train.global_batch=8",
        "train.micro_batch=1", "eval.every=3", "checkpoint.every=2")


@pytest.fixture(scope="module")
def mix(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Four uint16 token files of uneven length and a held-out file, indexed."""
    return index_token_mix(tmp_path_factory.mktemp("olmo-mix"), [5000, 3001, 4500, 700, 900],
                           50, vocab=VOCAB, eos=EOS)


def _run(run_dir: Path, data: str, dp: int, *extra: str) -> RunSummary:
    engine = "runtime.engine=inline" if dp == 1 else "runtime.engine=ray"
    return Controller(tiny_config(run_dir, data, *OLMO, engine, f"parallel.dp={dp}",
                                  *extra)).run()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, mix: str) -> Path:
    run = tmp_path_factory.mktemp("olmo-reference") / "dp1"
    _run(run, mix, 1, "train.max_steps=6")
    return run


def test_stopped_and_resumed_is_bit_identical_and_passes_the_audit(tmp_path: Path, mix: str,
                                                                   reference: Path) -> None:
    run = tmp_path / "resumed"
    _run(run, mix, 1, "train.max_steps=3")
    _run(run, mix, 1, "train.max_steps=6")
    assert_bit_identical(run, reference, range(1, 7))


@pytest.mark.soak  # about a minute on Ray: run with `pytest -m soak`
def test_resized_4_2_4_is_bit_identical_and_passes_the_audit(tmp_path: Path, mix: str,
                                                             reference: Path,
                                                             ray_cluster: object) -> None:
    run = tmp_path / "resized"
    for dp, steps in ((4, 2), (2, 4), (4, 6)):
        _run(run, mix, dp, f"train.max_steps={steps}")
    assert_bit_identical(run, reference, range(1, 7))


def test_olmo_core_order_on_prepared_data_is_refused_before_anything_is_written(
        tmp_path: Path, corpus_data: str, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}",
                 "data.order=olmo-core"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "index its token files with `relaytrain data index`" in err
    assert not run.exists()
