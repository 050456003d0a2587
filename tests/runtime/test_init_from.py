"""`init.from` end to end: a new run on other data starts from an fsdp 4 checkpoint (on two Ray
workers, and again in a recovery before its first checkpoint) or from an HF export, records
where it started in its config.yaml, manifest and ledger, passes the audit, which names the
origin, and resumes its own checkpoints (init.from ignored, one warning). A bad source stops
`relaytrain train` with one line and exit 2, writing nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from relaytrain.checkpoint.keys import model_tensors
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.cli import main
from relaytrain.data.audit import audit
from relaytrain.model.hf import convert, read_hf
from tests.runtime.conftest import (
    DP,
    final_state,
    make_corpus,
    records,
    run_layout,
    same_tensors,
)

pytestmark = pytest.mark.timeout(240)
# lr 0: the run's one step moves nothing (AdamW's update and decay both scale with it), so its
# checkpoint holds the state step 0 started from
AT_STEP_0 = ("optim.lr=0", "eval.every=0")


@pytest.fixture(scope="module")
def other_data(tmp_path_factory) -> str:
    """Another corpus (other text, the same tokenizer size): a new run's own data."""
    return make_corpus(tmp_path_factory.mktemp("other"), seed=1)


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, corpus_data) -> Path:
    """A two-step run on one worker: the checkpoint the HF export and bad inputs start from."""
    run = tmp_path_factory.mktemp("source") / "run"
    run_layout(run, corpus_data, 1, *DP, "train.max_steps=2", "eval.every=0")
    return run


def assert_origin_recorded(run: Path, kind: str, step: int | None) -> dict:
    """config.yaml, the newest manifest and every ledger header record the same origin; the
    audit passes and names it."""
    origin = yaml.safe_load((run / "config.yaml").read_text())["init"]["origin"]
    assert (origin["kind"], origin["step"], origin["took"]) == (kind, step, ["weights"])
    store = CheckpointStore(str(run / "checkpoints"))
    assert store.read_manifest(store.latest_step())["init"] == origin
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert [h["init"] for h in ledger if h["kind"] == "header"] == [origin] * len(
        [h for h in ledger if h["kind"] == "header"])
    report = audit(run)
    assert report.ok and report.origin == origin, report.to_json()
    detail = next(c.detail for c in report.checks if c.name == "config")
    assert f"step 0 from init.from {kind} {origin['from']}" in detail, detail
    return origin


def resume_resumes_itself(run: Path, data: str, capsys, *args: str) -> None:
    capsys.readouterr()
    formed = [r["step"] for r in records(run, "generation")]
    run_layout(run, data, *args, "train.max_steps=2")
    assert capsys.readouterr().err.count("config key 'init.from' is ignored") == 1
    assert [r["step"] for r in records(run, "restart")] == [1]
    assert [r["step"] for r in records(run, "generation")] == [*formed, 1]


def test_a_dp2_run_on_other_data_starts_from_an_fsdp4_checkpoint_and_resumes_itself(
        tmp_path, corpus_data, other_data, ray_cluster, capsys):
    src = tmp_path / "fsdp4"
    run_layout(src, corpus_data, 1, *DP, "train.max_steps=2", "eval.every=0", fsdp=4)
    files = CheckpointStore(str(src / "checkpoints")).read_manifest(2)["files"]
    assert sorted(files) == [f"stage0-shard{k}.safetensors" for k in range(4)]
    run = tmp_path / "dp2"
    start = (2, *DP, f"init.from={src}", *AT_STEP_0)
    # A worker killed in step 1, with no snapshot in memory: the recovery restores step 0 from
    # the source again (the seed's weights would not be the source's below).
    run_layout(run, other_data, *start, "train.max_steps=1", "faults.kill_at=[1]",
               "elastic.snapshot_every=0")
    [rec] = records(run, "recovery")
    assert (rec["source"], rec["restored_step"]) == ("checkpoint", 0), rec
    assert same_tensors(model_tensors(final_state(run)), model_tensors(final_state(src)))
    origin = assert_origin_recorded(run, "relaytrain", 2)
    assert origin["location"] == str(src / "checkpoints" / "step_00000002")
    resume_resumes_itself(run, other_data, capsys, *start)
    assert assert_origin_recorded(run, "relaytrain", 2) == origin


def test_a_run_starts_from_an_hf_export_and_resumes_itself(tmp_path, source_run, other_data,
                                                          capsys):
    hf = tmp_path / "hf"
    convert("relay-to-hf", str(source_run), hf)
    run = tmp_path / "from-hf"
    start = (1, *DP, f"init.from={hf}", *AT_STEP_0)
    run_layout(run, other_data, *start, "train.max_steps=1")
    assert same_tensors(model_tensors(final_state(run)), read_hf(hf)[1])
    origin = assert_origin_recorded(run, "hf", None)
    resume_resumes_itself(run, other_data, capsys, *start)
    assert assert_origin_recorded(run, "hf", None) == origin


def test_each_bad_source_exits_2_with_one_line_and_writes_nothing(tmp_path, source_run,
                                                                   other_data, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(source_run / "checkpoints", broken)
    part = next((broken / "step_00000002").glob("*.safetensors"))
    part.write_bytes(part.read_bytes()[:-1] + bytes([part.read_bytes()[-1] ^ 1]))
    (tmp_path / "empty").mkdir()
    (tmp_path / "dcp" / "model_and_optim").mkdir(parents=True)
    (tmp_path / "dcp" / "model_and_optim" / ".metadata").write_bytes(b"\x80\x04")
    cases = {"missing": ((), "does not exist"),
             "empty": ((), "no committed checkpoint"),
             "broken": ((), "does not match the manifest"),
             str(source_run): (("model.n_layers=3",), "holds another model (n_layers=2"),
             "dcp": ((), "OLMo-core checkpoints: not yet")}
    for i, (source, (extra, said)) in enumerate(cases.items()):
        run = tmp_path / f"run{i}"
        capsys.readouterr()
        assert main(["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={other_data}",
                     "log.progress=false", f"init.from={tmp_path / source}", *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "relaytrain: error: config key 'init.from': ") and said in lines[0], lines
        assert not run.exists()
