"""The checkpoint catalogue: a checkpoint is committed once every part arrived and never when
one failed; storage that is unavailable is waited for, and only then."""

from __future__ import annotations

import errno

import pytest
import torch

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.runtime.catalogue import CheckpointCatalogue, wait_for_storage
from relaytrain.runtime.wire import WriteReport


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
