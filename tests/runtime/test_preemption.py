"""SIGTERM or SIGINT to a real `relaytrain train` process (runtime/preemption.py): the last
completed step is committed within the grace, the exit code is the requeue code, no worker is
left, and the resumed run is bit-identical to one never interrupted; a second signal stops at
once with nothing half-committed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.cli import main
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.faults import end_storage_outage
from relaytrain.runtime.preemption import PREEMPTED, Notice, Preempted
from tests.runtime.conftest import (
    final_state,
    records,
    same_tensors,
    step_records,
    tiny_config,
)

pytestmark = pytest.mark.timeout(420)

STEPS = 24  # the signal comes at step 3: the run is still going when it lands
GRACE = 20.0
RUN = ("train.global_batch=12", "train.micro_batch=1", "eval.every=0", "checkpoint.every=1000",
       "determinism=exact", f"train.max_steps={STEPS}", f"checkpoint.preempt_grace={GRACE}")
DUMPS = ("Traceback", "logging.cc", "SIGTERM received at", "PC: @")
RAY_PROCESS_LINE = re.compile(r"^(\x1b\[\d+m)?\((pid=|Worker\()")  # Ray relays their output


def _dumps(log: str) -> list[str]:
    """The controller's lines that are part of a stack dump. Ray's worker processes are left
    out: one killed by the shutdown while still starting up (a spare) once aborted in Ray's own
    mutex check (`mutex.cc ... Mutex corrupt`, absl's dump) under the suite's load."""
    return [line for line in log.splitlines()
            if not RAY_PROCESS_LINE.match(line) and any(d in line for d in DUMPS)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_data) -> Path:
    """The uninterrupted run, on one worker in this process (exact mode: any dp, same bits)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    Controller(tiny_config(run, corpus_data, "runtime.engine=inline", *RUN)).run()
    return run


def _train(run: Path, data: str, *extra: str) -> subprocess.Popen:
    log = open(f"{run}.log", "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "relaytrain.cli", "train", "configs/tiny.yaml",
             f"run_dir={run}", f"data.path={data}", "log.progress=false", "runtime.engine=ray",
             "parallel.dp=2", *RUN, *extra], stdout=log, stderr=log)
    finally:
        log.close()


def _log(run: Path) -> str:
    return Path(f"{run}.log").read_text()


def _wait_for(proc: subprocess.Popen, ready, what: str, seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert proc.poll() is None, f"training ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds:.0f}s"
        time.sleep(0.01)


def _stepped(run: Path, step: int):
    return lambda: (run / "metrics.jsonl").exists() and max(step_records(run) or [0]) >= step


def _running(pid: int, start: int) -> str | None:
    """The OS's state letter of process `pid` if it is still the process started at `start`
    and not a zombie (dead, its exit status not yet collected); else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] if int(fields[19]) == start and fields[0] not in "ZX" else None


def _no_worker_left(run: Path, within: float = 3.0) -> None:
    """Every worker process the run reported (PID and OS start time) is gone within `within`
    seconds of the controller's exit."""
    workers = [(w["pid"], w["start"]) for gen in records(run, "generation")
               for w in gen["workers"].values()]
    assert workers
    deadline = time.monotonic() + within
    while (left := {p: s for p, s in workers if _running(p, s)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"worker processes left: {[(p, _running(p, s)) for p, s in left.items()]}"


def test_a_first_signal_only_gives_notice_and_the_handlers_are_restored_after():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with Notice(grace=30.0) as notice:
        assert not notice.received and notice.left() == float("inf")
        signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt: the run goes on to save
        assert notice.signum == signal.SIGINT and 29 < notice.left() <= 30
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_notice_while_the_run_is_set_up_starts_nothing(tmp_path, corpus_data):
    run = tmp_path / "run"
    with Notice(grace=30.0) as notice:
        controller = Controller(tiny_config(run, corpus_data), notice=notice)
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(Preempted, match="preempted by SIGTERM after step 0: nothing was "
                                            "trained"):
            controller.run()
    assert not run.exists()


# SIGINT takes the same handler as SIGTERM (runtime/preemption.py): on demand (`-m soak`)
@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.soak)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_commits_the_last_completed_step_and_the_resume_is_bit_identical(
        tmp_path, corpus_data, reference, sig):
    run = tmp_path / "run"
    proc = _train(run, corpus_data)
    try:
        _wait_for(proc, _stepped(run, 3), "step 3")
        t_signal = time.time()
        proc.send_signal(sig)
        rc = proc.wait(timeout=GRACE + 30)
    finally:
        proc.kill()
    log = _log(run)
    assert rc == PREEMPTED, log
    last = max(step_records(run))
    assert 3 <= last < STEPS
    store = CheckpointStore(str(run / "checkpoints"))
    assert store.committed_steps() == [last]  # the step in flight finished, and was saved
    assert store.read_manifest(last)["committed_at"] - t_signal < GRACE
    name = signal.Signals(sig).name
    assert f"preempted by {name} after step {last}: checkpoint step {last} committed" in log
    assert not _dumps(log), log
    _no_worker_left(run)

    # The requeued job, on one worker in its own process (no second Ray cluster to start: exact
    # mode gives any layout the same bits; resumes on Ray: tests/runtime/test_data_parallel.py)
    resumed = _train(run, corpus_data, "runtime.engine=inline", "parallel.dp=1")
    assert resumed.wait(timeout=300) == 0, _log(run)
    a, b = step_records(reference), step_records(run)
    assert sorted(b) == list(range(1, STEPS + 1))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]
    assert [a[s]["grad_norm"] for s in a] == [b[s]["grad_norm"] for s in a]
    assert same_tensors(final_state(reference), final_state(run))
    assert main(["data", "audit", str(run)]) == 0


def test_a_second_signal_during_the_save_stops_at_once_with_nothing_half_committed(
        tmp_path, corpus_data):
    """The checkpoint storage is made unavailable at step 2, so the notice's save retries its
    write for seconds; the second SIGTERM comes meanwhile."""
    run = tmp_path / "run"
    proc = _train(run, corpus_data, "faults.storage_outage_at=[2]",
                  "faults.storage_outage_seconds=600")
    try:
        _wait_for(proc, _stepped(run, 3), "step 3")
        proc.send_signal(signal.SIGTERM)
        _wait_for(proc, lambda: "SIGTERM received" in _log(run), "notice", 30)
        time.sleep(0.3)
        t_second = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        stopped_s = time.monotonic() - t_second
    finally:
        proc.kill()
    log = _log(run)
    assert rc == 128 + signal.SIGTERM, log
    assert stopped_s < 8, f"took {stopped_s:.1f}s to stop"  # Ray's own shutdown included
    assert "stopped at once (a second SIGTERM): nothing more was committed" in log
    assert not _dumps(log), log
    _no_worker_left(run)
    root = str(run / "checkpoints")
    assert end_storage_outage(root)  # the storage back: nothing the save began is loadable
    store = CheckpointStore(root)
    assert store.committed_steps() == [] and store.latest_step() is None
    assert os.path.isdir(root)
