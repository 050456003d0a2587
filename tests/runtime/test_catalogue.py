"""The checkpoint catalogue: a checkpoint is committed once every part arrived and never when
one failed; storage that is unavailable is waited for, and only then."""

from __future__ import annotations

import errno

import pytest
import torch

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.runtime.catalogue import CheckpointCatalogue, prove_writable, wait_for_storage
from relaytrain.runtime.wire import WriteReport
from relaytrain.storage import FULL_SUFFIX, StorageError, local_bytes


def _catalogue(tmp_path, failed: list[int] | None = None) -> CheckpointCatalogue:
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    return CheckpointCatalogue(store, lambda step: {"note": step},
                               on_failed_write=(failed if failed is not None else []).append)


def _part(cat: CheckpointCatalogue, step: int, name: str) -> WriteReport:
    return WriteReport(step, name, info=cat.store.write_part(step, name, {"w": torch.ones(2)}))


def test_a_checkpoint_is_committed_once_every_part_arrived(tmp_path):
    cat = _catalogue(tmp_path)
    cat.expect(4, {"stage0", "stage1"})
    cat.record([_part(cat, 4, "stage0")])
    assert cat.store.committed_steps() == [] and cat.last_committed == 0
    cat.record([_part(cat, 4, "stage1")])
    assert cat.store.committed_steps() == [4] and cat.last_committed == 4 and not cat.pending
    assert cat.newest_good_manifest()["note"] == 4


def test_a_failed_part_is_never_committed_and_its_fault_is_cleared(tmp_path, capsys):
    failed: list[int] = []
    cat = _catalogue(tmp_path, failed)
    cat.expect(2, {"stage0", "stage1"})
    cat.record([WriteReport(2, "stage0", error="OSError: disk full"), _part(cat, 2, "stage1")])
    assert cat.store.committed_steps() == [] and not cat.pending and failed == [2]
    assert "writing part stage0 failed (OSError: disk full)" in capsys.readouterr().err


def test_a_part_whose_writer_died_before_reporting_it_counts_once_its_record_is_stored(
        tmp_path):
    """Before a restore picks the newest checkpoint, parts finished but never reported (their
    writer killed) are taken from the record written beside them, if of the same save."""
    cat = _catalogue(tmp_path)
    cat.expect(4, {"stage0", "stage1"}, attempt="a4")
    cat.store.write_part(4, "stage1", {"w": torch.ones(2)}, attempt="a4")  # never reported
    cat.record([WriteReport(4, "stage0", info=cat.store.write_part(
        4, "stage0", {"w": torch.ones(2)}, attempt="a4"))])
    assert cat.store.committed_steps() == []  # record() waits for reports
    assert cat.latest_readable_step() == 4 and cat.last_committed == 4 and not cat.pending


def test_an_unfinished_part_or_one_of_an_earlier_save_is_not_taken_from_storage(tmp_path):
    cat = _catalogue(tmp_path)
    cat.store.write_part(6, "stage1", {"w": torch.zeros(2)}, attempt="before-a-restore")
    cat.expect(6, {"stage0", "stage1"}, attempt="a6")
    cat.record([WriteReport(6, "stage0", info=cat.store.write_part(
        6, "stage0", {"w": torch.ones(2)}, attempt="a6"))])
    cat.expect(8, {"stage0"}, attempt="a8")  # its writer died mid-write: no record
    assert cat.latest_readable_step() == 0 and len(cat.pending) == 2


def test_a_restore_forgets_the_checkpoints_being_written_after_it(tmp_path):
    cat = _catalogue(tmp_path)
    for step in (2, 4, 6):
        cat.expect(step, {"stage0"})
    cat.forget_after(4)
    assert [p.step for p in cat.pending] == [2, 4]


def test_the_wait_for_storage_retries_transient_errors_only(capsys):
    attempts = []

    def flaky() -> int:
        attempts.append(1)
        if len(attempts) < 3:
            raise OSError(errno.ELOOP, "Too many levels of symbolic links")
        return 7

    assert wait_for_storage(flaky, "/ckpt", "to restore", seconds=30, poll=0.0) == 7
    assert len(attempts) == 3
    assert capsys.readouterr().err.count("waiting up to 30s to restore") == 1
    with pytest.raises(ValueError):
        wait_for_storage(lambda: (_ for _ in ()).throw(ValueError("bad")), "/ckpt", "x",
                         seconds=30, poll=0.0)


def test_the_wait_for_storage_gives_up_after_its_deadline():
    def down() -> None:
        raise OSError(errno.ELOOP, "Too many levels of symbolic links")

    with pytest.raises(OSError):
        wait_for_storage(down, "/ckpt", "to restore", seconds=0.0, poll=0.0)


def test_a_failed_save_leaves_nothing_once_its_writes_returned_and_spares_committed_ones(
        tmp_path, capsys):
    cat = _catalogue(tmp_path)
    cat.expect(2, {"stage0"})
    cat.record([_part(cat, 2, "stage0")])
    cat.expect(4, {"stage0", "stage1"})
    cat.record([WriteReport(4, "stage0", error="OSError: [Errno 28] No space left on device")])
    step4 = tmp_path / "checkpoints" / "step_00000004"
    cat.store.write_part(4, "stage1", {"w": torch.ones(2)})  # stage 1 was still writing
    assert step4.exists() and [p.step for p in cat.pending] == [4]
    cat.record([WriteReport(4, "stage1", info=cat.store.part_record(4, "stage1"))])
    assert not step4.exists() and not cat.pending  # its last write returned: deleted
    assert [(f.step, "No space left" in f.error) for f in cat.take_failures()] == [(4, True)]
    assert cat.take_failures() == [] and cat.last_committed == 2
    assert not cat.store.discard(2) and cat.store.verify(2)["step"] == 2  # never touched
    assert "checkpoint step 4: writing part stage0 failed" in capsys.readouterr().err


def test_a_commit_that_meets_a_full_disk_is_a_failed_save_not_a_deferred_one(tmp_path):
    cat = _catalogue(tmp_path)
    cat.expect(2, {"stage0"})
    part = _part(cat, 2, "stage0")
    root = str(tmp_path / "checkpoints")
    with open(root + FULL_SUFFIX, "w") as f:  # no room for the manifest
        f.write(str(local_bytes(root)))
    cat.record([part])
    assert not cat.pending and cat.store.committed_steps() == []
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()
    [failed] = cat.take_failures()
    assert failed.step == 2 and "its commit failed (OSError: [Errno 28]" in failed.error


def test_a_location_is_proven_writable_and_the_proof_leaves_nothing(tmp_path):
    prove_writable(str(tmp_path / "new" / "run"), "run_dir")
    assert list(tmp_path.iterdir()) == []  # the directories made for the probe are gone too
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(StorageError) as err:
        prove_writable(str(blocked / "checkpoints"), "checkpoint.url")
    assert str(err.value) == (
        f"config key 'checkpoint.url': {blocked}/checkpoints is not writable "
        f"(NotADirectoryError: [Errno 20] Not a directory: '{blocked}/checkpoints'); nothing "
        "was trained: give a location this process can write, read and delete in")
