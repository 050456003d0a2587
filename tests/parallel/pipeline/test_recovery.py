"""Elastic pipelines on real Ray actors: a stage worker killed mid-span is replaced like any other
worker, the pipeline restores the consistent cut (a span start, from a DP peer's in-memory
snapshot, or a checkpoint) and the run ends on the same bits as the uninterrupted run. The
collective and call timeouts (120 s) are longer than the tests' deadlines (110 s: they run beside
other tests) and than any recovery phase may take (60 s): the surviving stages' transfers are
aborted, not waited out (runtime/abort.py)."""

from __future__ import annotations

import json

import pytest

from relaytrain.runtime.controller import Controller
from relaytrain.runtime.summary import RunSummary
from tests.runtime.conftest import (
    assert_bit_identical,
    assert_only_failed_ranks_replaced,
    step_records,
    tiny_config,
)

# Two stages, 8 micro-batches per step, spans of 3 steps (an asynchronous pipeline drains at each
# end) and synchronous checkpoints every 3 steps: every span start is a consistent cut. The kill
# is due 20 ms into the span of steps 4-6; should that span be over by then, the next call fails.
CUT = 3
COMMON = ("runtime.engine=ray", "parallel.pp=2", f"parallel.span={CUT}", "train.max_steps=9",
          "train.micro_batch=1", "eval.every=0", f"checkpoint.every={CUT}",
          "checkpoint.async_write=false", "runtime.call_timeout=120",
          "runtime.collective_timeout=120", "elastic.replace_timeout=120")


# interleaved-1f1b: two chunks per stage, so four layers (virtual stages 0, 2 | 1, 3)
OPTIONS = {"interleaved-1f1b": ("parallel.virtual_stages=2", "model.n_layers=4")}


def _run(run_dir, data, schedule: str, dp: int, *extra: str) -> RunSummary:
    return Controller(tiny_config(run_dir, data, *COMMON, f"parallel.schedule={schedule}",
                                  *OPTIONS.get(schedule, ()), f"parallel.dp={dp}",
                                  *extra)).run()


# 1f1b and zb-h1 make the same updates to the bit (tests/train/test_pipeline_stage.py): one
# uninterrupted run serves both
SAME_RUN = {"zb-h1": "1f1b"}


@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory, corpus_data, ray_cluster):
    """The uninterrupted run of a schedule, DP size and `extra` options, each made once."""
    done = {}

    def run(schedule: str, dp: int, extra: tuple[str, ...]):
        key = (SAME_RUN.get(schedule, schedule), dp, extra)
        if key not in done:
            done[key] = tmp_path_factory.mktemp("clean") / "run"
            _run(done[key], corpus_data, *key[:2], *extra)
        return done[key]

    return run


@pytest.fixture
def clean(request, clean_runs):
    """The uninterrupted run of the test's schedule, DP size and `extra` options (made outside
    its deadline)."""
    params = request.node.callspec.params
    return clean_runs(params["schedule"], params["dp"], tuple(params.get("extra", ())))


@pytest.mark.timeout(110, func_only=True)
@pytest.mark.parametrize(("schedule", "dp", "source"), [
    ("1f1b", 1, "checkpoint"),
    ("zb-h1", 1, "checkpoint"),
    ("interleaved-1f1b", 1, "checkpoint"),
    # an asynchronous schedule restored from a DP peer's snapshot, and the same paths again for
    # the other two schedules: on demand (pytest -m soak)
    pytest.param("paci", 2, "memory", marks=pytest.mark.soak),
    pytest.param("gpipe", 1, "checkpoint", marks=pytest.mark.soak),
    pytest.param("pipedream", 2, "memory", marks=pytest.mark.soak)])
def test_a_killed_stage_worker_is_replaced_and_the_run_is_bit_identical(
        tmp_path, corpus_data, ray_cluster, clean, schedule, dp, source):
    faulty = tmp_path / "faulty"
    killed = 2 * dp - 1  # the last DP rank of the last stage
    summary = _run(faulty, corpus_data, schedule, dp, "faults.kill_at=[5]",
                   f"faults.kill_rank={killed}")

    [rec] = [r for r in map(json.loads, (faulty / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "recovery"]
    assert (rec["rank"], rec["cause"], rec["source"]) == (killed, "died", source)
    assert rec["restored_step"] == (rec["failed_step"] - 1) // CUT * CUT  # the newest cut
    assert all(s < 60 for s in rec["phases"].values() if s is not None), rec
    assert_bit_identical(faulty, clean, range(1, 10))
    # Every other stage worker is the process it was (PID and start time, as it reported).
    gens = assert_only_failed_ranks_replaced(faulty)
    assert len(gens) == 2 and len(gens[1]["workers"]) == 2 * dp and summary.generation == 1
    b = step_records(faulty)
    stale = [max(b[s]["pipeline"]["0"]["staleness"]) for s in b]
    # the recovered span was asynchronous indeed (or not)
    assert (max(stale) > 0) == (schedule in ("pipedream", "paci"))


@pytest.mark.timeout(110, func_only=True)
@pytest.mark.parametrize(("schedule", "dp", "extra"), [("1f1b", 2, ("determinism=exact",))])
def test_a_replica_that_loses_a_stage_worker_drops_out_and_the_other_goes_on_at_once(
        tmp_path, corpus_data, ray_cluster, clean, schedule, dp, extra):
    """pp 2 x dp 2 without the standby (ranks 0, 1: stage 0; 2, 3: stage 1): rank 3 dies and
    no worker is up. Its replica drops out and the other goes on at once at dp 1, its two
    processes as they were, each stage running all 8 micro-batches (growing back, once a new
    worker is up: tests/runtime/test_recovery.py): in exact mode, the same bits as the
    uninterrupted dp 2 run."""
    faulty = tmp_path / "faulty"
    _run(faulty, corpus_data, schedule, dp, *extra, "faults.kill_at=[5]", "faults.kill_rank=3",
         "elastic.standby=false")
    metrics = [json.loads(x) for x in (faulty / "metrics.jsonl").read_text().splitlines()]
    [rec] = [r for r in metrics if r["kind"] == "recovery"]
    assert (rec["rank"], rec["dp"], rec["continued_on"]) == (3, 1, 2), rec
    assert (rec["waited_for_replacement"], rec["replaced"]) == (None, 0), rec
    gens = [r for r in metrics if r["kind"] == "generation"]
    assert gens[1]["workers"] == {"0": gens[0]["workers"]["0"], "1": gens[0]["workers"]["2"]}
    assert_bit_identical(faulty, clean, range(1, 10))
