"""Recovery decisions, driven by a scripted engine in milliseconds: what failed, where the
state comes from, who replaces whom, when the run shrinks, grows back, or stops."""

from __future__ import annotations

import json

import pytest
import torch

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.runtime.catalogue import CheckpointCatalogue
from relaytrain.runtime.failures import (
    RecoveryLimitExceeded,
    WorkerDied,
    WorkerHung,
    WorkerRaised,
)
from relaytrain.runtime.faults import FaultInjector
from relaytrain.runtime.recovery import Recovery
from relaytrain.runtime.reporter import StepReporter
from relaytrain.runtime.wire import WriteReport
from tests.runtime.conftest import tiny_config
from tests.runtime.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)

# 4 workers, 4 micro-batches per step: dp 4 splits them evenly, and so do 2 and 1 (not 3).
LAYOUT = ("train.global_batch=4", "train.micro_batch=1", "parallel.dp=4", "runtime.engine=ray")


def _recovery(tmp_path, snapshots, *extra, capacity=10, checkpoint_at=None):
    cfg = tiny_config(tmp_path / "run", "data", *LAYOUT, *extra)
    (tmp_path / "run").mkdir()
    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"))
    catalogue = CheckpointCatalogue(store, lambda step: {})
    if checkpoint_at is not None:
        part = store.write_part(checkpoint_at, "stage0", {"model.w": torch.ones(2)})
        store.commit(checkpoint_at, {"stage0": part}, {})
    reporter = StepReporter(cfg, "fp", 100, quiet=True, last_checkpoint=lambda: 0)
    reporter.open(0, cfg.parallel.dp)
    engine = FakeEngine(snapshots, capacity=capacity)
    rec = Recovery(cfg, engine, (), catalogue, reporter, FaultInjector([], 0.0))
    rec.start(0)
    return rec, engine


def _metrics(tmp_path, kind: str) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _ledger(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]


def test_a_dead_worker_is_replaced_in_its_rank_and_loads_a_peers_snapshot(tmp_path):
    rec, engine = _recovery(tmp_path, [5, 5, 5, 5])
    for w in engine.workers.values():
        w.snapshot = 5  # taken at the start of the failed step 6
    restored = rec.recover(WorkerDied(2, "SIGKILL"), done=5, in_flight=1)
    assert restored == 5
    assert rec.members[:2] == [0, 1] and rec.members[3] == 3 and rec.members[2] == 4
    assert set(engine.killed) == {2}
    new = engine.workers[4]
    assert new.built == (5, {"from": 0, "step": 5})  # a surviving peer's snapshot
    assert all(engine.workers[w].built == (5, None) for w in (0, 1, 3))  # their own
    assert rec.generation == 1 and rec.dp == 4
    rec.recovered(6)
    [record] = rec.log
    assert (record["source"], record["rank"], record["lost_steps"]) == ("memory", 2, 1)


def test_without_agreeing_snapshots_the_newest_checkpoint_is_restored(tmp_path):
    rec, engine = _recovery(tmp_path, [0, 0, 0, 0], checkpoint_at=4)
    for wid, step in zip(range(4), (7, 6, 7, 7), strict=True):
        engine.workers[wid].snapshot = step
    restored = rec.recover(WorkerDied(3, "gone"), done=7, in_flight=1)
    assert restored == 4
    assert all(w.built == (4, None) for w in engine.workers.values())  # each reads storage
    rollback = [r for r in _ledger(tmp_path) if r["kind"] == "rollback"]
    assert rollback == [{"kind": "rollback", "steps": [5, 6, 7], "to_step": 4}]
    rec.recovered(5)
    assert (rec.log[0]["source"], rec.log[0]["lost_steps"]) == ("checkpoint", 4)


def test_a_collective_error_is_blamed_on_the_peer_that_died(tmp_path):
    rec, engine = _recovery(tmp_path, [3, 3, 3, 3])
    engine.settled = {1: WorkerDied(1, "SIGKILL")}  # 2 and 3 raised: not gone
    rec.recover(WorkerRaised(0, "gloo: connection closed"), done=3, in_flight=1)
    assert set(engine.killed) == {1}  # not the worker that raised
    assert rec.members[0] == 0 and rec.members[1] == 4
    rec.recovered(4)
    assert (rec.log[0]["cause"], rec.log[0]["rank"]) == ("died", 1)


def test_a_worker_that_raised_alone_is_replaced(tmp_path):
    rec, engine = _recovery(tmp_path, [3, 3, 3, 3])
    rec.recover(WorkerRaised(2, "InjectedFault"), done=3, in_flight=1)
    assert set(engine.killed) == {2} and rec.members[2] == 4


def test_without_capacity_the_run_shrinks_to_the_largest_even_split_then_grows_back(tmp_path):
    rec, engine = _recovery(tmp_path, [2, 2, 2, 2], capacity=0)
    rec.recover(WorkerHung(1, "SIGSTOP"), done=2, in_flight=1)
    # 3 survivors, but 4 micro-batches split evenly only over 2: one survivor is left out,
    # kept (a warm process) to join first
    assert rec.dp == 2 and rec.members == [0, 2] and set(engine.killed) == {1}
    assert [r["dp"] for r in _ledger(tmp_path) if r["kind"] == "header"] == [4, 2]
    rec.maybe_grow(3)  # no capacity yet: 2 + the one kept make no larger size
    assert rec.dp == 2
    engine.capacity = 2
    rec.maybe_grow(4)
    assert rec.dp == 4 and rec.members[:3] == [0, 2, 3] and len(rec.members) == 4
    assert engine.capacity == 1  # one new worker: the survivor kept took the other place
    assert all(engine.workers[w].built == (4, {"from": 0, "step": 4})
               for w in rec.members[2:])
    assert set(engine.killed) == {1}
    assert [r["dp"] for r in _ledger(tmp_path) if r["kind"] == "header"] == [4, 2, 4]


def test_with_no_worker_up_the_survivors_go_on_at_once_and_the_replacement_joins_once_up(
        tmp_path):
    """12 micro-batches: the 3 survivors are a valid DP size. No replacement is up (a new
    process takes seconds to start): they go on without it, and it joins when it is."""
    rec, engine = _recovery(tmp_path, [2, 2, 2, 2], "train.global_batch=12")
    engine.up_now = False
    rec.recover(WorkerDied(1, "SIGKILL"), done=2, in_flight=1)
    assert rec.dp == 3 and rec.members == [0, 2, 3] and set(engine.killed) == {1}
    assert engine.waited == [] and engine.prestarted == 1  # it starts in the background
    rec.recovered(3)
    [record] = rec.log
    assert (record["continued_on"], record["waited_for_replacement"]) == (3, None)
    assert record["phases"]["wait_replacement"] == 0.0
    rec.maybe_grow(3)  # still starting
    assert rec.dp == 3 and engine.refills == 1  # after the recovery's first step
    engine.up_now = True
    rec.maybe_grow(4)
    assert rec.dp == 4 and rec.members[:3] == [0, 2, 3]
    assert engine.workers[rec.members[3]].built == (4, {"from": 0, "step": 4})
    # the growth took the worker up (the standby): a new one starts, for the next failure
    assert engine.refills == 2
    [resize] = _metrics(tmp_path, "resize")
    assert resize["dp"] == 4 and resize["since_failure_s"] >= 0
    assert [r["dp"] for r in _ledger(tmp_path) if r["kind"] == "header"] == [4, 3, 4]


def test_a_pipeline_of_one_replica_with_a_stage_lost_waits_for_its_replacement_and_says_why(
        tmp_path):
    rec, engine = _recovery(tmp_path, [1, 1], "parallel.dp=1", "parallel.pp=2")
    engine.up_now = False
    rec.recover(WorkerDied(1, "gone"), done=1, in_flight=1)
    assert rec.dp == 1 and rec.members == [0, 2] and len(engine.waited) == 1
    rec.recovered(2)
    assert "a stage missing" in rec.log[0]["waited_for_replacement"]
    assert rec.log[0]["continued_on"] == 2


@pytest.mark.parametrize("schedule", ["paci", "pipedream"])
def test_an_asynchronous_pipeline_waits_for_its_replacement_rather_than_drop_a_replica(
        tmp_path, schedule):
    """Its updates take each DP rank's own micro-batches: at dp 1 each would take twice as
    many of them and the run would train otherwise. So it does not go on at once (tests/
    parallel/pipeline/test_recovery.py: the same bits after the kill)."""
    rec, engine = _recovery(tmp_path, [1, 1, 1, 1], "parallel.dp=2", "parallel.pp=2",
                            f"parallel.schedule={schedule}")
    engine.up_now = False
    rec.recover(WorkerDied(3, "gone"), done=1, in_flight=1)
    assert rec.dp == 2 and len(engine.waited) == 1 and rec.members[:3] == [0, 1, 2]
    rec.recovered(2)
    assert f"schedule {schedule} updates on each" in rec.log[0]["waited_for_replacement"]
    assert rec.log[0]["continued_on"] == 4


def test_a_pipeline_that_loses_a_stage_worker_drops_its_replica_then_grows_back(tmp_path):
    """pp 2 x dp 2 (ranks 0, 1: stage 0; 2, 3: stage 1): rank 3 dies with no worker up. The
    other replica goes on at once; rank 1, its replica dropped, waits to join, and growing back
    takes it and one new worker for stage 1, given stage 1's state."""
    rec, engine = _recovery(tmp_path, [1, 1, 1, 1], "parallel.dp=2", "parallel.pp=2")
    engine.up_now = False
    rec.recover(WorkerDied(3, "gone"), done=1, in_flight=1)
    assert rec.dp == 1 and rec.members == [0, 2] and engine.waited == []
    assert set(engine.killed) == {3} and engine.prestarted == 1
    assert [p.stage for p in rec.placements().values()] == [0, 1]
    rec.recovered(2)
    assert (rec.log[0]["continued_on"], rec.log[0]["waited_for_replacement"]) == (2, None)
    engine.up_now = True
    rec.maybe_grow(3)
    assert rec.dp == 2 and rec.members[:3] == [0, 1, 2] and rec.members[3] not in (1, 3)
    assert {w: p.stage for w, p in rec.placements().items()} == {
        0: 0, 1: 0, 2: 1, rec.members[3]: 1}
    assert engine.workers[1].built == (3, {"from": 0, "step": 3})  # stage 0's state
    assert engine.workers[rec.members[3]].built == (3, {"from": 2, "step": 3})  # stage 1's
    assert [r["dp"] for r in _ledger(tmp_path) if r["kind"] == "header"] == [2, 1, 2]


def test_past_replace_timeout_the_run_stops_trying_to_grow_back(tmp_path):
    rec, engine = _recovery(tmp_path, [2, 2, 2, 2], "train.global_batch=12",
                            "elastic.replace_timeout=0")
    engine.up_now = False
    rec.recover(WorkerDied(1, "SIGKILL"), done=2, in_flight=1)
    rec.maybe_grow(3)
    engine.up_now = True
    rec.maybe_grow(4)  # given up: the run goes on at its size
    assert rec.dp == rec.target_dp == 3 and rec.members == [0, 2, 3]


def test_a_sharded_stages_replacement_pulls_its_rows_from_its_own_stages_replicas(tmp_path):
    """dp 2 x fsdp 2 x pp 2: rank 6 (stage 1, replica 1, shard 0) dies; its rows are those of
    shard 0 of stage 1, held by rank 4 (replica 0), and only stage 1's holders are asked."""
    rec, engine = _recovery(tmp_path, [3] * 8, "train.global_batch=8", "parallel.dp=2",
                            "parallel.fsdp=2", "parallel.pp=2")
    for w in engine.workers.values():
        w.snapshot = 3  # taken at the end of step 3
    rec.recover(WorkerDied(6, "SIGKILL"), done=3, in_flight=1)
    new = engine.workers[rec.members[6]]
    assert new.built is not None and new.built[0] == 3
    assert sorted(piece["from"] for piece in new.built[1]) == [4, 5]  # stage 1's, not 0 and 1
    assert {piece["rows of shard"] for piece in new.built[1]} == {(0, 2)}


def test_a_stage_shard_with_no_survivor_is_restored_from_the_checkpoint(tmp_path):
    """Both holders of stage 1's shard 0 die: every stage and every shard still has a survivor,
    but not that pair, so memory cannot restore it."""
    rec, engine = _recovery(tmp_path, [3] * 8, "train.global_batch=8", "parallel.dp=2",
                            "parallel.fsdp=2", "parallel.pp=2", checkpoint_at=2)
    for w in engine.workers.values():
        w.snapshot = 3
    engine.settled = {4: WorkerDied(4, "SIGKILL")}
    assert rec.recover(WorkerDied(6, "SIGKILL"), done=3, in_flight=1) == 2


def test_the_survivors_writes_in_progress_may_complete_the_checkpoint_restored(tmp_path):
    """A one-replica sharded run restores a dead worker's shard from storage. It had finished
    its part of step 4 (the part's record is beside it) while the survivors were still writing
    theirs: their writes are waited for, and step 4 is restored, not step 2."""
    rec, engine = _recovery(tmp_path, [4, 4, 4, 4], "parallel.dp=1", "parallel.fsdp=4",
                            checkpoint_at=2)
    store, parts = rec.catalogue.store, rec.save_parts()
    rec.catalogue.expect(4, set(parts.values()), "save-4")

    def part_of(wid: int) -> WriteReport:
        info = store.write_part(4, parts[wid], {f"model.w{wid}": torch.ones(2)},
                                attempt="save-4")
        return WriteReport(4, parts[wid], info=info)

    part_of(3)  # finished, not reported: the worker dies
    for wid in (0, 1, 2):
        engine.workers[wid].writing = [lambda wid=wid: part_of(wid)]
    assert rec.recover(WorkerDied(3, "SIGKILL"), done=4, in_flight=1) == 4
    assert all(not engine.workers[w].writing for w in (0, 1, 2))


def test_a_pipeline_of_one_replica_cannot_shrink(tmp_path):
    rec, _ = _recovery(tmp_path, [1, 1], "parallel.dp=1", "parallel.pp=2", capacity=0)
    with pytest.raises(RecoveryLimitExceeded, match="a stage missing"):
        rec.recover(WorkerDied(1, "gone"), done=1, in_flight=1)


def test_shrinking_below_min_workers_stops_the_run(tmp_path):
    rec, _ = _recovery(tmp_path, [1, 1, 1, 1], "elastic.min_workers=4", capacity=0)
    with pytest.raises(RecoveryLimitExceeded, match="elastic.min_workers=4"):
        rec.recover(WorkerDied(0, "gone"), done=1, in_flight=1)


def test_too_many_recoveries_within_the_window_is_a_crash_loop(tmp_path):
    rec, _ = _recovery(tmp_path, [1, 1, 1, 1], "elastic.max_recoveries=1")
    rec.recover(WorkerDied(0, "gone"), done=1, in_flight=1)
    with pytest.raises(RecoveryLimitExceeded, match="elastic.max_recoveries=1"):
        rec.recover(WorkerDied(1, "gone"), done=1, in_flight=1)
