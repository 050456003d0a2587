"""Elastic training on real Ray actors: killed, hung and raising workers become exceptions, only
they are replaced, and the run continues to the same bits as a run without faults.

The collective and call timeouts are 120 s, longer than the deadline of the tests that check
recovery time: a survivor's collective is aborted the moment a failure is known, so no recovery
waits for either (runtime/abort.py)."""

from __future__ import annotations

import json
import re

import pytest

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.failures import RecoveryLimitExceeded
from tests.runtime.conftest import (
    assert_bit_identical,
    assert_reported_as_the_os_sees_them,
    assert_survivors_kept_their_processes,
    assert_went_on_at_once,
    tiny_config,
    watch_processes,
)

pytestmark = pytest.mark.timeout(300)

PATIENT = 120.0  # runtime.call_timeout and runtime.collective_timeout
COMMON = ("runtime.engine=ray", "train.global_batch=12", "train.micro_batch=1", "eval.every=4",
          "checkpoint.every=4", f"runtime.call_timeout={PATIENT}",
          f"runtime.collective_timeout={PATIENT}")


def _cfg(run, data, *extra, dp: int = 4):
    return tiny_config(run, data, *COMMON, f"parallel.dp={dp}", *extra)


def _records(run, kind: str) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
            if f'"kind": "{kind}"' in x]


def _no_phase_waits_for_a_timeout(recoveries: list[dict]) -> bool:
    return all(s < PATIENT / 2 for r in recoveries for s in r["phases"].values() if s is not None)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, corpus_data):
    """The reference every faulty run must reproduce to the bit. In exact mode the result does
    not depend on the number of workers (tests/runtime/test_data_parallel.py), so one
    in-process worker computes it."""
    run = tmp_path_factory.mktemp("clean") / "run"
    Controller(_cfg(run, corpus_data, "train.max_steps=12", "determinism=exact",
                    "runtime.engine=inline", dp=1)).run()
    return run


LONG = 60  # steps: time for the replacements to start and join (on 2 busy cores, 10-20 s)


@pytest.fixture(scope="module")
def long_fault_free(tmp_path_factory, corpus_data):
    """`fault_free`, LONG steps."""
    run = tmp_path_factory.mktemp("clean-long") / "run"
    Controller(_cfg(run, corpus_data, f"train.max_steps={LONG}", "determinism=exact",
                    "runtime.engine=inline", dp=1)).run()
    return run


# Three recoveries in one run, beside the other tests: none may wait out the 120 s collective
# timeout (each phase under 60 s, and the deadline, 110 s, is shorter than one such wait). A
# failure that finds no standby warm yet goes on at once on fewer workers (a fault's rank is
# taken modulo their number): the ranks faulted exist at every size the run may be at then.
@pytest.mark.timeout(110, func_only=True)
def test_a_kill_a_hang_and_a_raise_each_recover_without_waiting_for_the_collective_timeout(
        tmp_path, corpus_data, ray_cluster, fault_free, capsys):
    run = tmp_path / "faulty"
    with watch_processes(run) as seen:
        summary = Controller(_cfg(run, corpus_data, "train.max_steps=12", "determinism=exact",
                                  "faults.kill_at=[3]", "faults.kill_rank=1",
                                  "faults.hang_at=[6]", "faults.hang_rank=2",
                                  "faults.raise_at=[9]", "faults.raise_rank=1")).run()
    recoveries = _records(run, "recovery")
    assert [(r["cause"], r["rank"], r["failed_step"]) for r in recoveries] == [
        ("died", 1, 3), ("hung", 2, 6), ("raised", 1, 9)], recoveries
    assert all(r["source"] == "memory" and r["lost_steps"] <= 1 for r in recoveries)
    assert _no_phase_waits_for_a_timeout(recoveries), recoveries
    # The raise is named by rank, type and message, in its record and in one log line.
    raised = recoveries[2]
    assert raised["message"].startswith("InjectedFault: injected by faults.raise_at at step 9")
    [line] = [x for x in capsys.readouterr().err.splitlines() if "InjectedFault" in x]
    assert re.fullmatch(r"relaytrain: warning: step 9: worker rank 1 \(pid \d+\) raised: "
                        + re.escape(raised["message"]), line), line
    assert_bit_identical(run, fault_free)  # and the audit passes
    # Only the failed worker left, recovery by recovery (replaced at once by the standby, or
    # the run went on without it while the next standby warmed up): by the end ranks 1-3 all
    # had, so comparing the first generation with the last would hide a replaced healthy one.
    assert_survivors_kept_their_processes(run)
    assert summary.generation == len(_records(run, "generation")) - 1, summary
    assert_reported_as_the_os_sees_them(seen, summary.generation + 1)


# Dispatch ahead: step 7 is started on both workers before step 6's results are in. Rank 1
# raises at 6; rank 0 waits for it in step 6's collective until the abort. Neither may then
# run step 7 on the state step 6 left (nor snapshot that state as step 6's): only the steps in
# flight are lost, and the run is bit-identical to one without the fault.
@pytest.mark.timeout(120, func_only=True)
def test_a_raise_while_the_next_step_is_dispatched_ahead_loses_only_the_steps_in_flight(
        tmp_path, corpus_data, ray_cluster, fault_free):
    run = tmp_path / "raised"
    Controller(_cfg(run, corpus_data, "train.max_steps=12", "determinism=exact",
                    "faults.raise_at=[6]", "faults.raise_rank=1", dp=2)).run()
    [rec] = _records(run, "recovery")
    assert (rec["failed_step"], rec["cause"], rec["source"], rec["restored_step"]) == \
        (6, "raised", "memory", 5), rec
    assert rec["lost_steps"] == 1 and rec["discarded_ahead"] == 1, rec
    assert_bit_identical(run, fault_free)  # and the audit passes


@pytest.mark.soak  # random fault plans on top of the deterministic faults above (~90 s)
def test_three_kills_a_hang_and_a_raise_recover_to_the_same_bits(tmp_path, corpus_data,
                                                                 ray_cluster, fault_free):
    run = tmp_path / "faulty"
    summary = Controller(_cfg(run, corpus_data, "train.max_steps=12", "determinism=exact",
                              "faults.random_kills=3", "faults.random_hangs=1",
                              "faults.raise_at=[7]", "faults.raise_rank=2")).run()
    recoveries = _records(run, "recovery")
    assert sorted(r["cause"] for r in recoveries) == ["died", "died", "died", "hung", "raised"]
    # Faults a step or two apart find no standby warm yet: the survivors go on at once on
    # fewer workers, and a fault that then takes the last holder of the state leaves only the
    # newest checkpoint
    assert all(r["lost_steps"] <= 1 for r in recoveries if r["source"] == "memory")
    assert all(r["source"] == "memory" or r["restored_step"] % 4 == 0  # checkpoint.every
               for r in recoveries)
    assert_bit_identical(run, fault_free)  # and the audit passes
    assert_survivors_kept_their_processes(run)
    assert summary.generation == len(_records(run, "generation")) - 1, summary


# No standby (a GPU run's default): a replacement is a new process, seconds to start. The
# survivors do not wait for one: they go on at once on fewer workers (12 micro-batches split
# 3 ways, or 2), and the replacements join at a step boundary once up. The first failure finds
# no worker up (none was started before it); the hang 5 steps later may find the first
# replacement up, and takes it at once. Half a CPU per worker: a stopped worker's slot, which
# Ray reclaims only seconds after the kill, does not hold up a replacement's placement.
@pytest.mark.timeout(150, func_only=True)
def test_without_a_standby_the_survivors_of_a_kill_and_a_hang_go_on_at_once_then_grow_back(
        tmp_path, corpus_data, ray_cluster, long_fault_free):
    run = tmp_path / "at-once"
    summary = Controller(_cfg(run, corpus_data, f"train.max_steps={LONG}", "determinism=exact",
                              "elastic.standby=false", "runtime.cpus_per_worker=0.5",
                              "faults.kill_at=[3]", "faults.kill_rank=1", "faults.hang_at=[8]",
                              "faults.hang_rank=2")).run()
    recoveries = assert_went_on_at_once(run, workers=4)
    assert [r["cause"] for r in recoveries] == ["died", "hung"], recoveries
    assert (recoveries[0]["dp"], recoveries[0]["replaced"]) == (3, 0), recoveries[0]
    assert all(r["source"] == "memory" and r["lost_steps"] <= 1 for r in recoveries)
    assert _no_phase_waits_for_a_timeout(recoveries), recoveries
    grows = _records(run, "resize")
    assert grows[-1]["dp"] == 4 and summary.dp == 4, grows
    assert grows[-1]["since_failure_s"] > 0, grows
    assert_bit_identical(run, long_fault_free)  # and the audit passes


# A worker stopped for 1 s (SIGSTOP, SIGCONT: under the ping deadline) every 4 steps after the
# shrink: the 60 tiny steps outlast the held slot and a new process's start on a loaded host.
GROWTH_ROOM = f"faults.slow_at={list(range(8, 56, 4))}".replace(" ", "")


@pytest.mark.timeout(150, func_only=True)
def test_a_kill_without_capacity_goes_on_at_once_on_fewer_workers_then_grows_back(
        tmp_path, corpus_data, ray_cluster, long_fault_free):
    run = tmp_path / "elastic"
    summary = Controller(_cfg(run, corpus_data, f"train.max_steps={LONG}", "determinism=exact",
                              "elastic.standby=false", "faults.kill_at=[3]",
                              "faults.hold_capacity_s=2", GROWTH_ROOM)).run()
    [rec] = assert_went_on_at_once(run, workers=4)
    assert rec["dp"] == 3  # 12 micro-batches over the 3 survivors
    assert _no_phase_waits_for_a_timeout([rec]), rec
    [grow] = _records(run, "resize")
    # The recovery record is written at the first step after the shrink; the growth comes at
    # that step's boundary or later, once the held capacity is released (timing-dependent).
    assert grow["dp"] == 4 and grow["step"] >= rec["step"] and grow["since_failure_s"] > 2
    assert summary.dp == 4
    assert_bit_identical(run, long_fault_free)  # and the audit passes


@pytest.mark.soak  # crash safety of a write: tests/checkpoint/test_checkpoint_crash.py
def test_a_kill_during_checkpoint_writes_leaves_nothing_broken_loadable(tmp_path, corpus_data,
                                                                         ray_cluster):
    run = tmp_path / "ckpt"
    with watch_processes(run) as seen:
        Controller(_cfg(run, corpus_data, "train.max_steps=7", "checkpoint.every=1",
                        "checkpoint.keep_last=8", "faults.kill_at=[3]", "faults.kill_rank=0",
                        "faults.fail_checkpoint_at=[5]", dp=2)).run()
    [rec] = _records(run, "recovery")  # the kill did happen, and rank 0 alone was replaced
    assert (rec["rank"], rec["cause"]) == (0, "died"), rec
    assert_survivors_kept_their_processes(run)
    assert_reported_as_the_os_sees_them(seen, len(_records(run, "generation")))
    store = CheckpointStore(str(run / "checkpoints"))
    steps = store.committed_steps()
    assert 5 not in steps and steps[-1] == 7
    for step in steps:
        store.verify(step)


def test_a_recovery_during_a_storage_outage_waits_for_it_and_restores_the_newest_checkpoint(
        tmp_path, corpus_data, ray_cluster, fault_free, capsys):
    run = tmp_path / "outage"
    Controller(_cfg(run, corpus_data, "train.max_steps=12", "determinism=exact",
                    "faults.storage_outage_at=[9]", "faults.storage_outage_seconds=3",
                    "faults.kill_at=[10]", dp=1)).run()
    # One worker: no peer holds a snapshot, so the recovery needs storage, and waits for it.
    [rec] = _records(run, "recovery")
    assert (rec["cause"], rec["source"]) == ("died", "checkpoint")
    assert "is unavailable (OSError); waiting up to 30s to restore" in capsys.readouterr().err
    # Commits follow the async writes, so checkpoint 8 is the newest if its write was reported
    # before the kill (then committed after the outage), else 4. Never 0: nothing was lost.
    assert rec["restored_step"] in (4, 8)
    assert_bit_identical(run, fault_free)  # and the audit passes


@pytest.mark.soak  # the limit itself is decided in tests/runtime/test_recovery.py
def test_a_crash_loop_ends_with_a_clear_error(tmp_path, corpus_data, ray_cluster):
    cfg = _cfg(tmp_path / "loop", corpus_data, "train.max_steps=8", "faults.kill_at=[2, 3]",
               "elastic.max_recoveries=1", dp=2)
    with pytest.raises(RecoveryLimitExceeded, match="elastic.max_recoveries=1"):
        Controller(cfg).run()
