"""The step reporter: a step's record does not depend on how its micro-batches were split over
ranks, the ledger names what each DP rank trained on, and a non-finite step stops the run."""

from __future__ import annotations

import json
import math

import pytest

from relaytrain.parallel.groups import Placement
from relaytrain.runtime.reporter import (
    StepReporter,
    TrainingStopped,
    combine,
    first_stage,
    ledger_parts,
)
from relaytrain.runtime.wire import StepResult
from tests.runtime.conftest import tiny_config

LOSSES = {0: (4.0, 3.9, 0.1), 1: (3.5, 3.4, 0.1), 2: (3.25, 3.2, 0.05), 3: (3.0, 3.0, 0.0)}


def _results(split: list[list[int]], finite: bool = True) -> dict[int, StepResult]:
    return {r: StepResult(step=1, losses={m: LOSSES[m] for m in mbs}, grad_norm=2.0 + r,
                          finite=finite, ids=[10 * r + m for m in mbs], time_data=0.1 * r,
                          time_compute=1.0 + r)
            for r, mbs in enumerate(split)}


def _placements(dp: int) -> dict[int, Placement]:
    return {r: Placement(rank=r, world=dp, dp_rank=r, dp=dp) for r in range(dp)}


def test_the_step_loss_is_the_same_for_every_split_of_the_micro_batches(tmp_path):
    cfg = tiny_config(tmp_path, "data", "train.global_batch=4", "train.micro_batch=1")
    one = combine(1, _results([[0, 1, 2, 3]]), _placements(1), cfg)
    two = combine(1, _results([[0, 1], [2, 3]]), _placements(2), cfg)
    four = combine(1, _results([[0], [1], [2], [3]]), _placements(4), cfg)
    assert one["loss"] == two["loss"] == four["loss"] == math.fsum(v[0] for v in
                                                                   LOSSES.values()) / 4
    assert four["time_compute"] == 4.0 and four["time_data"] == pytest.approx(0.3)


def test_the_record_carries_the_slowest_worker_s_gradient_reduction(tmp_path):
    """The reduction's fold and collective seconds and its bytes per parameter (the reducer's
    `ReduceStats`), the largest over workers."""
    cfg = tiny_config(tmp_path, "data", "train.global_batch=4", "train.micro_batch=1")
    results = _results([[0, 1], [2, 3]])
    for r, result in results.items():
        result.time_fold, result.time_comm, result.wire_bytes_per_param = 0.1 + r, 0.2 - r, 8.0
    record = combine(1, results, _placements(2), cfg)
    assert (record["time_fold"], record["time_comm"], record["wire_bytes_per_param"]) == (
        1.1, 0.2, 8.0)


def test_the_ledger_names_the_ids_of_each_dp_rank_in_rank_order():
    order = first_stage(_placements(2))
    assert ledger_parts(_results([[0, 1], [2, 3]]), order) == [[0, 1], [12, 13]]


def test_a_non_finite_step_stops_the_run_before_it_is_recorded(tmp_path):
    cfg = tiny_config(tmp_path / "run", "data", "train.global_batch=4", "train.micro_batch=1")
    (tmp_path / "run").mkdir()
    reporter = StepReporter(cfg, "fp", 100, quiet=True, last_checkpoint=lambda: 8)
    reporter.open(0, 1)
    with pytest.raises(TrainingStopped, match=r"diverged at step 9 .*checkpoint \(step 8\)"):
        reporter.check(9, [_results([[0, 1, 2, 3]], finite=False)], _placements(1))
    reporter.close()
    assert '"kind": "nan"' in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_skipped_step_says_so_in_its_metrics_record_and_its_data_counts_as_consumed(
        tmp_path):
    cfg = tiny_config(tmp_path / "run", "data", "train.global_batch=4", "train.micro_batch=1",
                      "optim.skip_spikes=true")
    (tmp_path / "run").mkdir()
    reporter = StepReporter(cfg, "fp", 100, quiet=True, last_checkpoint=lambda: 0)
    reporter.open(0, 2)
    per_step = [_results([[0, 1], [2, 3]]) for _ in range(2)]
    for r in per_step[1].values():
        r.skipped = True
    records = reporter.check(1, per_step, _placements(2))
    reporter.steps(1, per_step, records, _placements(2), 1.0, 0.0)
    reporter.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
             if x]
    assert [r["skipped"] for r in lines if r["kind"] == "step"] == [False, True]
    ledger = [json.loads(x) for x in (tmp_path / "run" / "ledger.jsonl").read_text().split()]
    assert [r["parts"] for r in ledger if r["kind"] == "step"] == [[[0, 1], [12, 13]]] * 2
    plain = tiny_config(tmp_path, "data", "train.global_batch=4", "train.micro_batch=1")
    assert "skipped" not in combine(1, per_step[1], _placements(2), plain)


def test_the_progress_bar_shows_the_unsaved_steps_until_a_newer_checkpoint_commits(
        tmp_path, capsys):
    cfg = tiny_config(tmp_path / "run", "data", "log.progress=true", "train.max_steps=20")
    (tmp_path / "run").mkdir()
    committed = [4]
    reporter = StepReporter(cfg, "fp", 100, quiet=False, last_checkpoint=lambda: committed[0])
    reporter.open(0, 1)
    reporter.start_progress(0, 1.0, 1.0)
    reporter.progress(5)
    assert "unsaved" not in reporter.bar.postfix  # a save may be in flight: not a failure
    reporter.unsaved(6, 6, 2, 4, "OSError: [Errno 28] No space left on device")
    reporter.progress(7)
    assert "unsaved=3" in reporter.bar.postfix
    committed[0] = 8  # a newer checkpoint committed
    reporter.progress(9)
    assert "unsaved" not in reporter.bar.postfix
    reporter.close()
    [rec] = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if '"unsaved"' in x]
    assert (rec["step"], rec["save_step"], rec["unsaved"], rec["last_committed"]) == (6, 6, 2, 4)
