"""`relaytrain train` end to end on the in-process engine: metrics, held-out evaluation, alarms,
checkpoints, bit-exact resume and clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relaytrain.checkpoint.store import CheckpointStore, open_checkpoint
from relaytrain.cli import main
from relaytrain.data import order
from relaytrain.runtime.controller import Controller, TrainingStopped
from tests.runtime.conftest import step_records, tiny_config

STEP_FIELDS = {"loss", "ce_loss", "z_loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu",
               "time_data", "time_compute", "time_checkpoint", "state_bytes", "peak_rss"}


def test_a_run_logs_every_step_evaluates_checkpoints_and_passes_the_audit(tmp_path, corpus_data,
                                                                          capsys):
    run = tmp_path / "run"
    summary = Controller(tiny_config(run, corpus_data, "train.max_steps=12", "eval.every=4",
                                     "checkpoint.every=5")).run()
    steps = step_records(run)
    assert sorted(steps) == list(range(1, 13))
    assert STEP_FIELDS <= set(steps[1])
    assert steps[12]["loss"] < steps[1]["loss"]
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in x]
    assert [e["step"] for e in evals] == [4, 8, 12]
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"]
    assert CheckpointStore(str(run / "checkpoints")).committed_steps() == [10, 12]
    assert summary.checkpoint_step == 12
    assert main(["data", "audit", str(run)]) == 0
    assert main(["eval", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["heldout_loss"] == pytest.approx(evals[-1]["heldout_loss"], abs=0)
    assert main(["plot", str(run)]) == 0
    assert (run / "loss.png").stat().st_size > 10_000


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    _, tensors = open_checkpoint(str(run))
    return tensors


def _train_cmd(run: Path, data: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "relaytrain.cli", "train", "configs/tiny.yaml",
            f"run_dir={run}", f"data.path={data}", "train.max_steps=16", "checkpoint.every=3",
            "eval.every=4", "log.progress=false", *extra]


def _kill_after_step(cmd: list[str], run: Path, step: int, delay: float) -> None:
    """Start a real training process and SIGKILL it `delay` s after it logs `step` (and has
    committed a checkpoint at or after step - 3, so the kill always costs a resume)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = CheckpointStore(str(run / "checkpoints"))
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            recs = step_records(run) if (run / "metrics.jsonl").exists() else {}
            if recs and max(recs) >= step and (store.latest_step() or 0) >= step - 3:
                time.sleep(delay)
                break
            assert proc.poll() is None, "training ended before it could be interrupted"
            time.sleep(0.005)
        else:
            pytest.fail("training never reached the step to interrupt")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.timeout(300)
def test_kill_and_resume_twice_is_bit_identical_to_an_uninterrupted_run(tmp_path, corpus_data):
    """Killed mid-step (mid-accumulation: 4 micro-batches per step) twice, resumed each time."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert subprocess.run(_train_cmd(straight, corpus_data), timeout=240).returncode == 0
    _kill_after_step(_train_cmd(broken, corpus_data), broken, step=4, delay=0.02)
    _kill_after_step(_train_cmd(broken, corpus_data), broken, step=11, delay=0.05)
    assert subprocess.run(_train_cmd(broken, corpus_data), timeout=240).returncode == 0

    a, b = step_records(straight), step_records(broken)
    assert sorted(a) == sorted(b) == list(range(1, 17))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]
    assert [a[s]["grad_norm"] for s in a] == [b[s]["grad_norm"] for s in a]
    wa, wb = _final_weights(straight), _final_weights(broken)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    kinds = [json.loads(x)["kind"] for x in (broken / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("restart") == 2
    assert main(["data", "audit", str(broken)]) == 0
    assert main(["compare", str(broken), str(straight), "--tolerance", "0"]) == 0


def test_the_memorisation_alarm_fires_when_the_loader_repeats_a_small_subset(
        tmp_path, corpus_data, monkeypatch, capsys):
    real = order.Order.global_batch

    def repeating(self, global_batch, batch_index):
        # A deliberately broken loader: only ever serves 16 instances, over and over.
        epochs, ids = real(self, global_batch, batch_index)
        return epochs, ids % 16

    overrides = ("train.max_steps=80", "eval.every=10", "optim.lr=1e-2", "optim.warmup=2",
                 "checkpoint.every=0")
    monkeypatch.setattr(order.Order, "global_batch", repeating)
    bad = tmp_path / "bad"
    Controller(tiny_config(bad, corpus_data, *overrides)).run()
    alarms = [json.loads(x) for x in (bad / "metrics.jsonl").read_text().splitlines()
              if '"alarm"' in x]
    assert alarms and "MEMORISATION ALARM" in alarms[0]["message"]

    monkeypatch.setattr(order.Order, "global_batch", real)
    # The ledger holds what the loader served, so the audit (against the real order) names it.
    capsys.readouterr()
    assert main(["data", "audit", str(bad), "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {n for n, r in report["results"].items() if not r["ok"]} == {
        "shards_disjoint", "continuity", "shards_complete", "exactly_once"}
    assert "instance 4 is twice on rank 0" in report["first_failure"]["message"]
    good = tmp_path / "good"
    Controller(tiny_config(good, corpus_data, *overrides)).run()
    assert '"alarm"' not in (good / "metrics.jsonl").read_text()

    monkeypatch.setattr(order.Order, "global_batch", repeating)
    with pytest.raises(TrainingStopped, match="MEMORISATION"):
        Controller(tiny_config(tmp_path / "stop", corpus_data, *overrides,
                               "eval.stop_on_alarm=true")).run()


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, corpus_data):
    run = tmp_path / "run"
    cfg = tiny_config(run, corpus_data, "train.max_steps=40", "optim.lr=1e4", "optim.warmup=0",
                      "train.clip=0", "checkpoint.every=1", "checkpoint.async_write=false")
    with pytest.raises(TrainingStopped, match="diverged at step"):
        Controller(cfg).run()
    nan = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
           if '"nan"' in x]
    assert len(nan) == 1 and nan[0]["step"] not in step_records(run)
    manifest, tensors = open_checkpoint(str(run))
    assert manifest["step"] == nan[0]["step"] - 1
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, corpus_data, capsys):
    run = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", f"run_dir={run}",
                 f"data.path={tmp_path / 'missing'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing" in err
    assert not run.exists()
    assert main(["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}",
                 "train.global_batch=100000"]) == 2
    assert "training instances" in capsys.readouterr().err
    assert not run.exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write in, however privileged: a read-only tmpfs where
    mounting is allowed (root here), else one without write permission (not root), else (root
    without mounts: permissions do not stop root) a path under a regular file."""
    path = tmp_path / "read-only"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                      capture_output=True, timeout=30).returncode == 0:
        yield path, "Read-only file system"
        subprocess.run(["umount", str(path)], check=True, timeout=30)
    elif os.geteuid() != 0:
        path.chmod(0o555)
        yield path, "Permission denied"
        path.chmod(0o755)
    else:
        path.rmdir()
        path.write_text("a file where a directory should be")
        yield path / "under-a-file", "Not a directory"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["checkpoint.url", "run_dir"])
def test_an_unwritable_location_is_one_line_exit_2_before_step_1(tmp_path, corpus_data, capsys,
                                                                 read_only_dir, key):
    where, error = read_only_dir
    run = tmp_path / "run" if key == "checkpoint.url" else where / "run"
    target = where / "checkpoints" if key == "checkpoint.url" else run
    args = [f"run_dir={run}", f"data.path={corpus_data}", "log.progress=false"]
    assert main(["train", "configs/tiny.yaml", *args, f"checkpoint.url={where / 'checkpoints'}"
                 if key == "checkpoint.url" else "train.max_steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"relaytrain: error: config key '{key}': {target} is not writable ("), \
        err
    assert error in err
    assert not run.exists()  # nothing trained, nothing written


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MiB file system (tmpfs), room for two checkpoints of the tiny model; skipped where
    this process may not mount (tests/runtime/test_faults.py injects ENOSPC instead)."""
    path = tmp_path / "disk"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(path)],
                      capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot mount a size-limited file system here")
    yield path
    subprocess.run(["umount", str(path)], check=True, timeout=30)


@pytest.mark.timeout(180)
def test_a_real_full_disk_stops_loud_leaves_no_debris_and_resumes_once_space_is_freed(
        tmp_path, corpus_data, capsys, small_disk):
    run, root = tmp_path / "run", small_disk / "checkpoints"
    args = ["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}",
            "log.progress=false", f"checkpoint.url={root}", "train.max_steps=12",
            "checkpoint.every=2", "checkpoint.keep_last=3", "eval.every=0",
            "checkpoint.max_unsaved_steps=6"]
    assert main(args) == 3
    out, err = capsys.readouterr()
    assert "done:" not in out and "[Errno 28] No space left on device" in err
    assert "steps are unsaved since the newest committed checkpoint (step 4)" in err
    assert err.strip().splitlines()[-1].startswith(
        "relaytrain: stopped at step 11: steps 5..11 (7) are not saved")
    store = CheckpointStore(str(root))
    assert [store.verify(s)["step"] for s in store.committed_steps()] == [2, 4]
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004"]  # no debris
    assert all(not name.endswith(".tmp") for d in os.listdir(root)
               for name in os.listdir(root / d))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True, timeout=30)
    assert main(args) == 0  # space freed: it resumes from step 4 and ends done
    assert "done: 12 steps" in capsys.readouterr().out
    assert store.committed_steps() == [8, 10, 12]
    assert main(["data", "audit", str(run)]) == 0


def test_resume_refuses_a_changed_seed_and_a_finished_run(tmp_path, corpus_data, capsys):
    run = tmp_path / "run"
    Controller(tiny_config(run, corpus_data, "train.max_steps=3")).run()
    before = (run / "metrics.jsonl").read_text()
    args = ["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}"]
    assert main([*args, "train.max_steps=5", "seed=7"]) == 2
    assert "config key 'seed'" in capsys.readouterr().err
    assert main([*args, "train.max_steps=3"]) == 2
    assert "already reached step 3" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == before


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, corpus_data):
    run = tmp_path / "run"
    Controller(tiny_config(run, corpus_data, "train.max_steps=6", "checkpoint.every=3")).run()
    part = run / "checkpoints" / "step_00000006" / "stage0.safetensors"
    data = bytearray(part.read_bytes())
    data[-10] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="stage0.safetensors"):
        summary = Controller(tiny_config(run, corpus_data, "train.max_steps=7")).run()
    assert summary.resumed_from == 3
    assert os.path.exists(run / "checkpoints" / "step_00000007" / "manifest.json")


def test_a_run_whose_checkpoints_all_fail_verification_stops_unless_told_to_start_over(
        tmp_path, corpus_data, capsys):
    run = tmp_path / "run"
    Controller(tiny_config(run, corpus_data, "train.max_steps=4", "checkpoint.every=2",
                           "eval.every=0")).run()
    for step in (2, 4):
        part = run / "checkpoints" / f"step_{step:08d}" / "stage0.safetensors"
        data = bytearray(part.read_bytes())
        data[-10] ^= 0xFF
        part.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    args = ["train", "configs/tiny.yaml", f"run_dir={run}", f"data.path={corpus_data}",
            "log.progress=false", "eval.every=0", "train.max_steps=6"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every checkpoint" in err[0] and "step 4" in err[0] \
        and "step 2" in err[0] and "checkpoint.start_over=true" in err[0]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    summary = Controller(tiny_config(run, corpus_data, "train.max_steps=6", "eval.every=0",
                                     "checkpoint.start_over=true")).run()
    assert summary.resumed_from == 0


def test_compare_separates_runs_with_different_seeds(tmp_path, corpus_data, capsys):
    a, b = tmp_path / "seed0", tmp_path / "seed1"
    Controller(tiny_config(a, corpus_data, "train.max_steps=4", "seed=0")).run()
    Controller(tiny_config(b, corpus_data, "train.max_steps=4", "seed=1")).run()
    assert main(["compare", str(a), str(b), "--tolerance", "0.001", "--json"]) == 1
    again = tmp_path / "seed0-again"  # another run, not `a` compared with itself
    Controller(tiny_config(again, corpus_data, "train.max_steps=4", "seed=0")).run()
    assert main(["compare", str(again), str(a), "--tolerance", "0"]) == 0
