"""The simulated engine drives the real controller: its step loop, reporter, ledger, catalogue
and recovery, on workers that do not train (runtime/engines/simulated.py)."""

from __future__ import annotations

import gc
import io
import json
import pickle
from pathlib import Path

import pytest

from relaytrain.data.audit import audit
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.engines.base import Invocation
from relaytrain.runtime.engines.simulated import SimulatedEngine
from tests.runtime.conftest import resolved, tiny_config


def _run(tmp_path: Path, data: str, ahead: bool, fail_at: int | None = None,
         workers: int = 8, start_s: float = 0.0, engine_type: type = SimulatedEngine
         ) -> tuple[Path, SimulatedEngine, object]:
    run = tmp_path / f"run-{ahead}-{start_s}"
    cfg = tiny_config(run, data, "runtime.engine=ray", "data.seq_len=8", f"parallel.dp={workers}",
                      f"train.global_batch={workers}", "train.micro_batch=1",
                      "train.max_steps=24", "eval.every=0", "checkpoint.every=10",
                      f"runtime.dispatch_ahead={str(ahead).lower()}")
    engine = engine_type(step_s=0.02, start_s=start_s)
    if fail_at is not None:
        engine.fail(fail_at, rank=3)
    summary = Controller(cfg, quiet=True, engine=engine).run()
    return run, engine, summary


class Observed(SimulatedEngine):
    """Records, as the controller takes each call's results, how many objects the garbage
    collector leaves out (runtime/heap.py; counting them takes milliseconds: not for the
    timing tests), each generation's rounds of calls (joining, building) as they were
    sent, the workers asked for their snapshot step, and the workers' answers to every step
    as they crossed (pickled)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.frozen: list[int] = []
        self.setups: list[dict[int, Invocation]] = []
        self.builds: list[dict[int, Invocation]] = []
        self.snapshot_asked: list[int] = []
        self.step_answers: list[bytes] = []

    def _answer(self, seq: int):
        answer = super()._answer(seq)
        if seq in self._steps:
            self.step_answers += answer[0].values()
        return answer

    def _start(self, invocations: dict[int, Invocation]) -> int:
        methods = {c.method for c in invocations.values()}
        if methods & {"setup", "rejoin"}:
            self.setups.append(dict(invocations))
        if methods == {"build"}:
            self.builds.append(dict(invocations))
        self.snapshot_asked += [w for w, c in invocations.items() if c.method == "snapshot_step"]
        return super()._start(invocations)

    def finish(self, started: int) -> dict:
        self.frozen.append(gc.get_freeze_count())
        return super().finish(started)


class _Classes(pickle.Unpickler):
    """The classes a pickle names, as it is read."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.named: list[str] = []

    def find_class(self, module: str, name: str):
        self.named.append(name)
        return super().find_class(module, name)


def _classes(data: bytes) -> list[str]:
    reader = _Classes(data)
    reader.load()
    return reader.named


def _records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.timeout(120)
def test_a_failure_is_recovered_by_the_real_recovery_and_the_ledger_audits(tmp_path,
                                                                           corpus_data):
    run, engine, summary = _run(tmp_path, corpus_data, ahead=True, fail_at=13,
                                engine_type=Observed)
    [rec] = _records(run, "recovery")
    # The failed step and the step dispatched ahead of its results are all that is lost.
    assert (rec["failed_step"], rec["cause"], rec["source"]) == (13, "died", "memory")
    assert rec["lost_steps"] == 1 and rec["discarded_ahead"] == 1
    assert sorted({r["step"] for r in _records(run, "step")}) == list(range(1, 25))
    assert summary.checkpoint_step == 24
    assert audit(run).ok
    # Every rank but the failed one kept its (simulated) process: the recovery's generation
    # record names the failed rank alone, the others by the generation they are the processes of.
    written = _records(run, "generation")
    assert (list(written[1]["workers"]), written[1]["same_as"]) == (["3"], 0)
    gens = resolved(written)
    assert [r for r in gens[0]["workers"] if gens[0]["workers"][r] != gens[1]["workers"][r]] \
        == ["3"]
    # Only the failed rank was placed again: the survivors, kept in their ranks, were sent one
    # call (pickled once, whatever their number) with the new generation and no placement,
    # that also restored their state; the second round, building, went to the replacement
    # alone.
    first, again = engine.setups
    assert len({id(c) for c in first.values()}) == 8
    placed = {c.args[1].rank for c in again.values() if c.method == "setup"}
    kept = [c for c in again.values() if c.method == "rejoin"]
    assert placed == {3} and len(kept) == 7 and len({id(c) for c in kept}) == 1
    assert [len(b) for b in engine.builds] == [8, 1]
    # The restore point took no round of its own: every survivor's failed step call (aborted,
    # or refused behind it) carried its snapshot step, and none was asked for it.
    assert engine.snapshot_asked == []
    # Every worker's answer to every step crossed as plain values (runtime/wire.py), read back
    # with no class looked up (at 1,024 workers, most of the controller's unpickling): only
    # the reports of checkpoint writes that finished with a step name theirs
    named = [_classes(b) for b in engine.step_answers]
    assert len(named) >= 8 * 24 and {c for n in named for c in n} <= {"WriteReport"}
    assert sum(not n for n in named) >= 8 * 22
    # The step loop ran with the set-up's objects out of the collector's passes (every step's
    # results taken so), and the run gave them back.
    assert sum(f > 10_000 for f in engine.frozen) >= 24
    assert gc.get_freeze_count() == 0


@pytest.mark.timeout(120)
def test_dispatch_ahead_leaves_no_gap_between_steps_and_changes_no_record(tmp_path,
                                                                         corpus_data):
    ahead, with_ahead, _ = _run(tmp_path, corpus_data, ahead=True)
    lockstep, without, _ = _run(tmp_path, corpus_data, ahead=False)
    # Between steps that end at no barrier, the workers waited for the controller only
    # without dispatch ahead (steps 10 and 20 end at checkpoints: barriers either way).
    gaps = sorted(with_ahead.idle_s)
    assert gaps[len(gaps) // 2] == 0.0 and min(without.idle_s) > 0.0
    ledgers = [[{k: v for k, v in json.loads(x).items() if k != "wall"}
                for x in (run / "ledger.jsonl").read_text().splitlines()]
               for run in (ahead, lockstep)]
    assert ledgers[0] == ledgers[1]
    losses = [[r["loss"] for r in _records(run, "step")] for run in (ahead, lockstep)]
    assert losses[0] == losses[1]
    assert audit(ahead).ok and audit(lockstep).ok


@pytest.mark.timeout(120)
def test_a_failure_with_no_worker_up_goes_on_at_once_and_grows_back_once_one_is(tmp_path,
                                                                              corpus_data):
    """A new worker takes 0.3 s to come up (15 steps' time): the 7 survivors go on at once on
    the largest of them that splits the 8 micro-batches (4), and the run is back at 8 once the
    replacements are up, through the same recovery code as on Ray."""
    run, _, summary = _run(tmp_path, corpus_data, ahead=True, fail_at=5, start_s=0.3)
    [rec] = _records(run, "recovery")
    assert (rec["continued_on"], rec["dp"], rec["replaced"]) == (4, 4, 0), rec
    assert rec["waited_for_replacement"] is None and rec["phases"]["wait_replacement"] == 0.0
    [grow] = _records(run, "resize")
    assert (grow["dp"], summary.dp) == (8, 8) and grow["since_failure_s"] >= 0.3, grow
    assert sorted({r["step"] for r in _records(run, "step")}) == list(range(1, 25))
    assert audit(run).ok
