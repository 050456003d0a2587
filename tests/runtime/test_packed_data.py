"""Training on packed instances with intra-document masking (data.instances packed): two
workers on real Ray actors, then one (a resize), are bit-identical to one in exact mode, stopped
and resumed too, and `data audit` passes; packed instances on data without OLMo-core's
documents are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.summary import RunSummary
from tests.runtime.conftest import assert_bit_identical, step_records, tiny_config

pytestmark = pytest.mark.timeout(300)

PACKED = ("data.instances=packed", "data.source_group_size=2",
          "data.source_permutation_seed=123", "data.order=olmo-core", "determinism=exact",
          "train.global_batch=8", "train.micro_batch=2", "eval.every=3", "checkpoint.every=2")


def _run(run_dir: Path, data: str, dp: int, *extra: str) -> RunSummary:
    engine = "runtime.engine=inline" if dp == 1 else "runtime.engine=ray"
    return Controller(tiny_config(run_dir, data, *PACKED, engine, f"parallel.dp={dp}",
                                  *extra)).run()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, packed_mix: str) -> Path:
    run = tmp_path_factory.mktemp("packed-reference") / "dp1"
    _run(run, packed_mix, 1, "train.max_steps=6")
    return run


def test_two_workers_then_one_are_bit_identical_to_one_and_pass_the_audit(
        tmp_path: Path, packed_mix: str, reference: Path, ray_cluster: object) -> None:
    run = tmp_path / "dp2"
    _run(run, packed_mix, 2, "train.max_steps=4")
    _run(run, packed_mix, 1, "train.max_steps=6")  # resized 2 -> 1
    assert_bit_identical(run, reference, range(1, 7))


def test_stopped_and_resumed_is_bit_identical(tmp_path: Path, packed_mix: str,
                                              reference: Path) -> None:
    run = tmp_path / "resumed"
    _run(run, packed_mix, 1, "train.max_steps=3")
    _run(run, packed_mix, 1, "train.max_steps=6")
    assert_bit_identical(run, reference, range(1, 7))


def test_the_masking_changes_the_run(tmp_path: Path, packed_mix: str, reference: Path) -> None:
    """Masked and unmasked runs of the same packed instances part at the first step."""
    run = tmp_path / "unmasked"
    _run(run, packed_mix, 1, "train.max_steps=1", "model.document_masking=false")
    assert step_records(run)[1]["loss"] != step_records(reference)[1]["loss"]


def test_packed_instances_on_prepared_data_are_refused_before_anything_is_written(
        tmp_path: Path, corpus_data: str, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}",
                 "data.instances=packed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "packs OLMo-core token arrays" in err
    assert not run.exists()
