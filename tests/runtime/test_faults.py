"""Fault injection: the plan is a pure function of the config and the seed, and a storage outage
is real (every process's access to the checkpoint root fails) yet costs a run nothing."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.cli import main
from relaytrain.config.sections import FaultsSection
from relaytrain.runtime.catalogue import PendingCheckpoint
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.faults import (
    OUTAGE_SUFFIX,
    InjectedFault,
    RaiseHook,
    end_disk_full,
    end_storage_outage,
    plan_faults,
    start_storage_outage,
)
from relaytrain.storage import is_transient
from tests.runtime.conftest import (
    final_state,
    records,
    same_tensors,
    step_records,
    tiny_config,
)

pytestmark = pytest.mark.timeout(120)


def test_a_raise_hits_the_given_rank_or_one_drawn_from_the_seed():
    given = plan_faults(FaultsSection(raise_at=[5], raise_rank=2), seed=0, max_steps=10, world=4)
    assert [(f.step, f.kind, f.rank) for f in given] == [(5, "raise", 2)]
    drawn = {s: plan_faults(FaultsSection(raise_at=[3, 7]), seed=s, max_steps=10, world=4)
             for s in range(5)}
    assert drawn[1] == plan_faults(FaultsSection(raise_at=[3, 7]), seed=1, max_steps=10, world=4)
    assert all(f.kind == "raise" and 0 <= f.rank < 4 for f in drawn[1])
    ranks = {s: tuple(f.rank for f in plan) for s, plan in drawn.items()}
    assert len(set(ranks.values())) > 1, ranks  # the ranks come from the seed
    outage = plan_faults(FaultsSection(storage_outage_at=[4]), seed=0, max_steps=10, world=4)
    assert [(f.step, f.kind) for f in outage] == [(4, "storage_outage")]


def test_an_armed_hook_raises_once_when_its_step_starts():
    hook = RaiseHook()
    hook.arm(6)
    hook.check(1, 5)  # steps 1..5: not yet
    with pytest.raises(InjectedFault, match="faults.raise_at at step 6"):
        hook.check(5, 3)  # a span 5..7 holds step 6
    hook.check(6, 1)  # spent: the step is retried without it


def test_during_an_outage_every_access_fails_transiently_and_nothing_is_lost(tmp_path):
    root = str(tmp_path / "checkpoints")
    store = CheckpointStore(root)
    part = store.write_part(1, "model", {"model.w": torch.ones(4)})
    store.commit(1, {"model": part}, {})
    start_storage_outage(root)
    for access in (lambda: store.write_part(2, "model", {"model.w": torch.zeros(4)}),
                   lambda: store.commit(1, {"model": part}, {}), store.latest_step,
                   store.committed_steps,  # not an empty listing: that would read as "none"
                   lambda: store.read(1)):
        with pytest.raises(OSError) as err:
            access()
        assert is_transient(err.value), err.value
    assert os.path.isdir(root + OUTAGE_SUFFIX)  # the real directory, aside and untouched
    assert end_storage_outage(root)
    assert not end_storage_outage(root)  # idempotent: nothing to restore any more
    assert not os.path.lexists(root + OUTAGE_SUFFIX)
    assert store.latest_step() == 1 and torch.equal(store.read(1)[1]["model.w"], torch.ones(4))
    store.commit(2, {"model": store.write_part(2, "model", {"model.w": torch.zeros(4)})}, {})
    assert store.committed_steps() == [1, 2]


def test_training_rides_out_a_storage_outage_to_the_same_bits(tmp_path, corpus_data, capsys,
                                                              caplog):
    common = ("train.max_steps=10", "checkpoint.every=1", "checkpoint.keep_last=10",
              "eval.every=0")
    Controller(tiny_config(tmp_path / "clean", corpus_data, *common)).run()
    run = tmp_path / "outage"
    with caplog.at_level(logging.WARNING, logger="relaytrain.checkpoint.writer"):
        Controller(tiny_config(run, corpus_data, *common, "faults.storage_outage_at=[4]",
                               "faults.storage_outage_seconds=1")).run()
    # The outage is one line, and it really hit a checkpoint save, which the writer retried.
    err = capsys.readouterr().err
    assert [x for x in err.splitlines() if "storage outage" in x] == [
        f"relaytrain: warning: step 4: injected storage outage: {run / 'checkpoints'} is "
        "unavailable for 1s"]
    assert any("failed (OSError: [Errno 40] Too many levels of symbolic links" in r.getMessage()
               for r in caplog.records)
    a, b = step_records(tmp_path / "clean"), step_records(run)
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]
    assert same_tensors(final_state(run), final_state(tmp_path / "clean"))
    store = CheckpointStore(str(run / "checkpoints"))
    steps = store.committed_steps()
    assert steps == list(range(1, 11))
    for step in steps:
        store.verify(step)
    assert not os.path.lexists(str(run / "checkpoints") + OUTAGE_SUFFIX)
    assert main(["data", "audit", str(run)]) == 0
    assert records(run, "unsaved") == []  # late commits are no failed saves: nothing to say


def test_a_commit_that_meets_an_outage_waits_for_storage_and_is_never_half_done(
        tmp_path, corpus_data, capsys):
    cat = Controller(tiny_config(tmp_path / "run", corpus_data)).catalogue
    part = cat.store.write_part(2, "stage0", {"model.w": torch.ones(4)})
    cat.pending = [PendingCheckpoint(2, parts={"stage0": part}, expected={"stage0"})]
    start_storage_outage(cat.store.url)
    cat.commit_ready()  # what the controller does after every step
    cat.commit_ready()
    assert [p.step for p in cat.pending] == [2] and cat.last_committed == 0
    assert capsys.readouterr().err.count("checkpoint step 2: storage unavailable") == 1
    end_storage_outage(cat.store.url)
    assert cat.store.committed_steps() == []  # nothing was committed while it was down
    cat.commit_ready()
    assert cat.pending == [] and cat.last_committed == 2
    assert cat.store.verify(2)["step"] == 2


def test_a_run_killed_during_an_outage_gets_its_storage_back_on_resume(tmp_path, corpus_data,
                                                                       capsys):
    run = tmp_path / "run"
    Controller(tiny_config(run, corpus_data, "train.max_steps=4", "eval.every=0")).run()
    start_storage_outage(str(run / "checkpoints"))  # as a SIGKILLed controller leaves it
    summary = Controller(tiny_config(run, corpus_data, "train.max_steps=6",
                                     "eval.every=0")).run()
    assert summary.resumed_from == 4
    assert "left unavailable by an injected storage outage" in capsys.readouterr().err
    assert CheckpointStore(str(run / "checkpoints")).latest_step() == 6


FULL = ("determinism=exact", "checkpoint.every=2", "checkpoint.keep_last=3", "eval.every=0",
        "checkpoint.async_write=false",
        "faults.disk_full_at=[5]")  # steps 2 and 4 commit, then the disk is full


def checkpoint_files(root) -> dict[str, list[str]]:
    """Every step directory under `root` and the files in it (debris included)."""
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(root.iterdir())}


def test_a_full_disk_is_loud_stops_after_max_unsaved_steps_and_resumes_to_the_same_bits(
        tmp_path, corpus_data, capsys):
    clean, run = tmp_path / "clean", tmp_path / "full"
    Controller(tiny_config(clean, corpus_data, *FULL[:-1], "train.max_steps=12")).run()
    args = ["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}",
            "log.progress=false", "train.max_steps=12", *FULL]
    assert main([*args, "checkpoint.max_unsaved_steps=6"]) == 3
    err = capsys.readouterr().err
    # Every failed save says what is now unsaved; past the limit one last attempt, then the
    # stop, naming the newest committed step and the steps lost.
    for step, unsaved in ((6, 2), (8, 4), (10, 6)):
        assert f"checkpoint step {step}: writing part stage0 failed (OSError: [Errno 28] No " \
            "space left on device" in err
        assert f"checkpoint step {step} was not saved: {unsaved} steps are unsaved since the " \
            "newest committed checkpoint (step 4)" in err
    assert "step 11: 7 steps are unsaved, over checkpoint.max_unsaved_steps=6; a last attempt" \
        in err
    assert err.strip().splitlines()[-1] == (
        "relaytrain: stopped at step 11: steps 5..11 (7) are not saved, over "
        "checkpoint.max_unsaved_steps=6, and the last attempt failed; the newest committed "
        f"checkpoint is step 4 in {run / 'checkpoints'} (free or fix the storage, then run "
        "again to resume from it)")
    assert "done:" not in capsys.readouterr().out
    assert [(r["step"], r["save_step"], r["unsaved"], r["last_committed"])
            for r in records(run, "unsaved")] == [(6, 6, 2, 4), (8, 8, 4, 4), (10, 10, 6, 4),
                                                  (11, 11, 7, 4)]
    # No debris: the failed saves left no temporary file and no step directory; the committed
    # checkpoints are intact.
    assert checkpoint_files(run / "checkpoints") == {
        f"step_0000000{s}": ["manifest.json", "stage0.record.json", "stage0.safetensors"]
        for s in (2, 4)}
    store = CheckpointStore(str(run / "checkpoints"))
    assert [store.verify(s)["step"] for s in store.committed_steps()] == [2, 4]
    # Space freed: the resume deletes what a killed save left, continues from step 4, to the
    # bits of a run that never failed.
    assert end_disk_full(str(run / "checkpoints"))
    (run / "checkpoints" / "step_00000009").mkdir()
    (run / "checkpoints" / "step_00000009" / "stage0.safetensors.tmp").write_bytes(b"torn")
    assert main([*args[:-1]]) == 0
    assert "deleted what earlier failed or interrupted saves left in " \
        f"{run / 'checkpoints'}: uncommitted step 9" in capsys.readouterr().err
    assert records(run, "restart")[-1]["step"] == 4
    assert same_tensors(final_state(run), final_state(clean))
    a, b = step_records(clean), step_records(run)
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]
    assert main(["data", "audit", str(run)]) == 0


def test_a_final_checkpoint_that_cannot_be_committed_is_a_distinct_exit_naming_the_steps(
        tmp_path, corpus_data, capsys):
    run = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}",
                 "log.progress=false", "train.max_steps=7", *FULL,
                 "checkpoint.max_unsaved_steps=0"]) == 3  # 0: never stops before the end
    out, err = capsys.readouterr()
    assert "done:" not in out
    assert err.count("the final checkpoint (step 7) is not committed; saving it again from "
                     "memory") == 2
    assert err.strip().splitlines()[-1] == (
        "relaytrain: the final checkpoint (step 7) could not be committed after 3 attempts: "
        "steps 5..7 (3) are not saved; the newest committed checkpoint is step 4 in "
        f"{run / 'checkpoints'} (free or fix the storage, then run again to resume from it)")
    assert [r["save_step"] for r in records(run, "unsaved")] == [6, 7, 7, 7]
    assert sorted(checkpoint_files(run / "checkpoints")) == ["step_00000002", "step_00000004"]


def test_a_full_disk_releases_what_retention_would_delete_and_the_save_goes_through(
        tmp_path, corpus_data, capsys):
    run = tmp_path / "run"
    summary = Controller(tiny_config(run, corpus_data, *FULL, "train.max_steps=8",
                                     "checkpoint.keep_last=2")).run()
    # keep_last=2: each save met the full disk, released the older of the two committed
    # checkpoints (which its commit would have retired) and went through.
    assert summary.checkpoint_step == 8 and records(run, "unsaved") == []
    assert sorted(checkpoint_files(run / "checkpoints")) == ["step_00000006", "step_00000008"]
    assert "injected full disk" in capsys.readouterr().err
