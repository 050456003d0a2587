"""Pipeline-parallel training through the controller on the Ray engine: a 4-stage asynchronous
run (two backward passes per update) logs its pipeline measurements, evaluates through the
pipeline, checkpoints at a span end, and the checkpoint resumes at 2 stages and unpipelined to
the same numbers."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from relaytrain.checkpoint.store import open_checkpoint
from relaytrain.cli import main
from relaytrain.runtime.controller import Controller
from tests.runtime.conftest import step_records, tiny_config

pytestmark = pytest.mark.usefixtures("ray_cluster")  # the session's private Ray cluster


def evals(run) -> dict[int, float]:
    import json

    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "eval":
            out[rec["step"]] = rec["heldout_loss"]
    return out


@pytest.mark.timeout(180)
def test_four_stage_paci_checkpoint_resumes_at_two_stages_and_unpipelined(tmp_path, corpus_data):
    common = ("model.n_layers=4", "eval.every=2", "checkpoint.every=2", "runtime.engine=ray")
    run = tmp_path / "pp4"
    Controller(tiny_config(run, corpus_data, *common, "train.max_steps=2", "parallel.pp=4",
                           "parallel.schedule=paci", "parallel.paci.a=2")).run()
    steps = step_records(run)
    assert sorted(steps) == [1, 2]
    for rec in steps.values():
        stages = rec["pipeline"]
        assert sorted(stages) == ["0", "1", "2", "3"]
        for s, stats in stages.items():
            # PACI's bound, ceil((S - i - 1) / a), from the paper's formula
            bound = math.ceil((4 - int(s) - 1) / 2)
            assert max(stats["staleness"]) <= stats["staleness_bound"] == bound
            assert 0 <= stats["bubble"] < 1 and stats["peak_memory"] > 0
            assert stats["weight_versions"] == 1
    assert max(steps[2]["pipeline"]["0"]["staleness"]) > 0  # asynchronous indeed
    assert 2 in evals(run)

    flat = tmp_path / "pp1"
    shutil.copytree(run, flat)
    Controller(tiny_config(run, corpus_data, *common, "train.max_steps=4", "parallel.pp=2",
                           "parallel.schedule=1f1b")).run()
    Controller(tiny_config(flat, corpus_data, *common, "train.max_steps=4",
                           "runtime.engine=inline")).run()
    two, one = step_records(run), step_records(flat)
    assert sorted(two[4]["pipeline"]) == ["0", "1"] and "pipeline" not in one[4]
    for step in (3, 4):
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-6)
    assert evals(run)[4] == pytest.approx(evals(flat)[4], rel=1e-6)
    _, a = open_checkpoint(str(run / "checkpoints"))
    _, b = open_checkpoint(str(flat / "checkpoints"))
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
    assert main(["data", "audit", str(run)]) == 0


@pytest.mark.timeout(180)
def test_unpipelined_checkpoint_resumes_interleaved_and_back_bit_identically(tmp_path,
                                                                            corpus_data):
    """Checkpoints hold tensors under global names whatever the layout: an unpipelined run's
    resumes on 2 ranks of 2 chunks each (evaluating through the interleaved pipeline), whose
    checkpoint resumes unpipelined, all on the bits of the run that never left pp = 1."""
    common = ("model.n_layers=4", "eval.every=2", "checkpoint.every=2", "determinism=exact")
    interleaved = ("runtime.engine=ray", "parallel.pp=2", "parallel.schedule=interleaved-1f1b",
                   "parallel.virtual_stages=2")
    run, flat = tmp_path / "moved", tmp_path / "flat"
    Controller(tiny_config(run, corpus_data, *common, "train.max_steps=2")).run()
    shutil.copytree(run, flat)
    Controller(tiny_config(run, corpus_data, *common, *interleaved, "train.max_steps=4")).run()
    Controller(tiny_config(run, corpus_data, *common, "train.max_steps=6")).run()
    Controller(tiny_config(flat, corpus_data, *common, "train.max_steps=6")).run()
    moved, one = step_records(run), step_records(flat)
    assert sorted(moved[4]["pipeline"]) == ["0", "1"] and "pipeline" not in moved[6]
    assert [moved[s]["loss"] for s in range(3, 7)] == [one[s]["loss"] for s in range(3, 7)]
    assert evals(run) == evals(flat)
    _, a = open_checkpoint(str(run / "checkpoints"))
    _, b = open_checkpoint(str(flat / "checkpoints"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
