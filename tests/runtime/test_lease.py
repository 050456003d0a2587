"""One controller per run (runtime/lease.py): a live holder refuses a second one, naming it; a
dead or silent holder's lease is taken over with a warning; taking it is race-safe, on local
directories and on an object store; and end to end, a second `relaytrain train` on a run exits
2 at once, and after the first is SIGKILLed a new one takes over and resumes bit-identically."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relaytrain.checkpoint.store import open_checkpoint
from relaytrain.cli import main
from relaytrain.runtime import lease
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.lease import LEASE, STALE_S, LeaseHeld, RunLease, lease_places
from tests.runtime.conftest import same_tensors, step_records, tiny_config

pytestmark = pytest.mark.timeout(300)

TAKE = """
import sys, time
from relaytrain.runtime.lease import LeaseHeld, RunLease
try:
    with RunLease(sys.argv[1:]):
        print("won", flush=True)
        time.sleep(float(__import__("os").environ.get("HOLD_S", "60")))
except LeaseHeld as e:
    print("refused", e, flush=True)
"""


def _takers(places: list[str], n: int, hold_s: float = 4.0) -> list[subprocess.Popen]:
    env = {**os.environ, "HOLD_S": str(hold_s)}
    return [subprocess.Popen([sys.executable, "-c", TAKE, *places], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(n)]


def _outcomes(procs: list[subprocess.Popen]) -> list[str]:
    return [p.communicate(timeout=60)[0].split(" ")[0].strip() for p in procs]


def test_a_live_holder_refuses_another_in_one_line_naming_it_and_nothing_is_written(tmp_path):
    with RunLease([str(tmp_path)]):
        before = sorted(os.listdir(tmp_path)), (tmp_path / LEASE).read_bytes()
        with pytest.raises(LeaseHeld) as refused:
            RunLease([str(tmp_path)]).__enter__()
        after = sorted(os.listdir(tmp_path)), (tmp_path / LEASE).read_bytes()
    message = str(refused.value)
    assert "\n" not in message
    assert f"PID {os.getpid()}" in message and "host " in message and "since 20" in message
    assert before == after
    assert not (tmp_path / LEASE).exists()  # released at the end


def test_a_run_stopped_before_it_wrote_anything_leaves_no_directory_behind(tmp_path):
    run = tmp_path / "new-run"
    with RunLease([str(run)]):
        assert (run / LEASE).exists()
    assert not run.exists()


def test_a_dead_holders_lease_is_taken_over_with_a_warning(tmp_path, capsys):
    holder = _takers([str(tmp_path)], 1, hold_s=60)[0]
    assert holder.stdout.readline().startswith("won")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (tmp_path / LEASE).exists()  # nobody cleaned it up
    with RunLease([str(tmp_path)]) as taken:
        assert json.loads((tmp_path / LEASE).read_text())["token"] == taken.holder.token
    err = capsys.readouterr().err
    assert f"taking over the lease on {tmp_path}" in err
    assert f"its process {holder.pid} no longer runs" in err


def _foreign(path: Path, renewed_ago: float) -> None:
    """A lease written by a controller on another host, last renewed `renewed_ago` s ago."""
    now = time.time()
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "start": 1, "boot": "other-host",
                                "since": now - 3600, "renewed": now - renewed_ago,
                                "token": "theirs"}))


def test_a_lease_from_another_host_is_taken_over_only_after_stale_s_without_renewal(tmp_path):
    _foreign(tmp_path / LEASE, renewed_ago=STALE_S / 2)
    with pytest.raises(LeaseHeld, match="host elsewhere, PID 1"):
        RunLease([str(tmp_path)]).__enter__()
    _foreign(tmp_path / LEASE, renewed_ago=STALE_S + 1)
    with RunLease([str(tmp_path)]) as taken:
        assert json.loads((tmp_path / LEASE).read_text())["token"] == taken.holder.token


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_of_controllers_taking_one_lease_at_once_exactly_one_wins(tmp_path, stale):
    if stale:
        _foreign(tmp_path / LEASE, renewed_ago=STALE_S + 1)
    assert sorted(_outcomes(_takers([str(tmp_path)], 4))) == ["refused"] * 3 + ["won"]
    assert not [f for f in os.listdir(tmp_path) if f != LEASE]  # no debris of the race


def test_of_controllers_taking_a_lease_on_an_object_store_exactly_one_wins(s3_server):
    url = s3_server.url("run/checkpoints")
    assert sorted(_outcomes(_takers([url], 4))) == ["refused"] * 3 + ["won"]


def test_a_store_without_conditional_creates_writes_then_verifies():
    """fsspec's in-memory store stands for one without S3's or GCS's conditional create."""
    url = "memory://relaytrain-lease-test/run"
    with RunLease([url]) as held:
        with pytest.raises(LeaseHeld, match=f"PID {os.getpid()},"):
            RunLease([url]).__enter__()
        assert json.loads(held.places[0].fs.cat_file(held.places[0].path))["token"] \
            == held.holder.token
    assert held.places[0].read() is None


def test_the_lease_is_renewed_and_a_holder_that_lost_it_is_told(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_S", 0.1)
    lost: list[str] = []
    with RunLease([str(tmp_path)], on_lost=lost.append):
        first = json.loads((tmp_path / LEASE).read_text())["renewed"]
        time.sleep(0.5)
        assert json.loads((tmp_path / LEASE).read_text())["renewed"] > first
        _foreign(tmp_path / LEASE, renewed_ago=0)  # taken over meanwhile
        time.sleep(0.5)
    assert lost and "held by host elsewhere, PID 1" in lost[0]
    assert json.loads((tmp_path / LEASE).read_text())["token"] == "theirs"  # not released


def test_the_run_directory_and_a_checkpoint_url_elsewhere_are_both_leased(tmp_path):
    run = str(tmp_path / "run")
    assert lease_places(run, os.path.join(run, "checkpoints")) == [run]
    assert lease_places(run, "s3://b/ckpt") == ["s3://b/ckpt", run]


# ---- end to end -------------------------------------------------------------------------------
STEPS = 30
RUN = ("train.global_batch=8", "train.micro_batch=2", "eval.every=0", "checkpoint.every=5",
       "determinism=exact", f"train.max_steps={STEPS}", "runtime.engine=inline")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_data) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    Controller(tiny_config(run, corpus_data, *RUN)).run()
    return run


def _train(run: Path, data: str, *extra: str, quiet: bool = False) -> subprocess.Popen:
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen(
        [sys.executable, "-m", "relaytrain.cli", "train", "configs/tiny.yaml", f"run_dir={run}",
         f"data.path={data}", "log.progress=false", *RUN, *extra],
        stdout=out, stderr=out, text=True)


def test_eval_audit_and_convert_read_a_run_without_taking_its_lease(reference, tmp_path):
    """This process holds the lease (alive): a command that took it would be refused."""
    with RunLease([str(reference)]):
        held = (reference / LEASE).read_bytes()
        assert main(["data", "audit", str(reference)]) == 0
        assert main(["eval", str(reference), "--json"]) == 0
        assert main(["convert", "relay-to-hf", str(reference), str(tmp_path / "hf")]) == 0
        assert (reference / LEASE).read_bytes() == held


# On an object store the lease's conditional create is raced above; the whole takeover there
# (a minute with moto) on demand
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.soak)])
def test_a_second_controller_exits_2_at_once_and_after_a_sigkill_a_new_one_takes_over(
        tmp_path, corpus_data, reference, request, where):
    run = tmp_path / "run"
    extra = ()
    if where == "s3":
        extra = (f"checkpoint.url={request.getfixturevalue('s3_server').url('run')}",)
    first = _train(run, corpus_data, *extra, quiet=True)
    try:
        deadline = time.monotonic() + 180
        while not (run / "metrics.jsonl").exists() or max(step_records(run) or [0]) < 3:
            assert first.poll() is None, "the first run ended before step 3"
            assert time.monotonic() < deadline, "the first run reached no step 3 in 180s"
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)  # alive (the lease's owner) while the second tries
        files = {p: p.stat().st_mtime_ns for p in run.iterdir()}
        t0 = time.monotonic()
        second = _train(run, corpus_data, *extra)
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, err
        assert time.monotonic() - t0 < 30  # refused before anything is built
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"PID {first.pid}," in lines[0], err
        assert "held by another `relaytrain train`" in lines[0]
        assert {p: p.stat().st_mtime_ns for p in run.iterdir()} == files  # nothing written
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    third = _train(run, corpus_data, *extra)
    out, err = third.communicate(timeout=240)
    assert third.returncode == 0, err
    assert f"its process {first.pid} no longer runs" in err
    a, b = step_records(reference), step_records(run)
    assert sorted(b) == list(range(1, STEPS + 1))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]
    checkpoints = extra[0].split("=", 1)[1] if extra else str(run)
    assert same_tensors(open_checkpoint(str(reference))[1], open_checkpoint(checkpoints)[1])
    assert main(["data", "audit", str(run)]) == 0
