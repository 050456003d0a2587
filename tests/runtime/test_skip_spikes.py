"""optim.skip_spikes in whole runs: a learning rate far too high makes spikes the rule skips; in
exact mode dp 2, fsdp 2 and pp 2 (flush schedules) skip the same steps as dp 1 and end on the
same bits, a run resumed from a checkpoint skips the steps an uninterrupted one skips (the
window rides in the manifest), and a skipped step's data counts as consumed (the audit
passes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaytrain.checkpoint.store import open_checkpoint
from relaytrain.cli import main
from tests.runtime.conftest import (
    DP,
    final_state,
    records,
    run_layout,
    same_tensors,
    step_records,
)

pytestmark = pytest.mark.timeout(240)

# lr 0.2 after 3 warm-up steps: the loss jumps from step 4 on; a window of 6 steps (the rule
# applies from step 3) and 1 sigma skip some of those steps and not others.
SPIKES = ("determinism=exact", "eval.every=0", "optim.lr=0.2", "optim.warmup=3",
          "optim.skip_spikes=true", "optim.skip_window=6", "optim.skip_sigma=1",
          "model.matmul=aten", "model.kernels=torch", "model.attention=sdpa")


def skipped(run: Path) -> dict[int, bool]:
    return {s: r["skipped"] for s, r in sorted(step_records(run).items())}


def curve(run: Path) -> dict[int, tuple[float, float]]:
    return {s: (r["loss"], r["grad_norm"]) for s, r in sorted(step_records(run).items())}


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, corpus_data) -> Path:
    run = tmp_path_factory.mktemp("skip") / "dp1"
    run_layout(run, corpus_data, 1, *DP, *SPIKES, "train.max_steps=8")
    flags = skipped(run)
    assert any(flags.values()) and not all(flags.values()), flags
    assert main(["data", "audit", str(run)]) == 0  # skipped steps' data: consumed once
    return run


def test_a_resumed_run_skips_the_steps_an_uninterrupted_one_skips(tmp_path, corpus_data,
                                                                  one_worker):
    """Resumed at step 4: without the manifest's window, steps 5 and 6 would be compared with
    fewer than 3 values, so not at all."""
    assert any(skipped(one_worker)[s] for s in (5, 6)), skipped(one_worker)
    run = tmp_path / "resumed"
    for steps in (4, 8):
        run_layout(run, corpus_data, 1, *DP, *SPIKES, f"train.max_steps={steps}")
    window = open_checkpoint(str(run))[0]["skip_window"]  # step 8's: steps 3 .. 8
    assert window["first_step"] == 3 and window["losses"] == [
        step_records(run)[s]["ce_loss"] for s in range(3, 9)]
    assert skipped(run) == skipped(one_worker)
    assert curve(run) == curve(one_worker)
    assert same_tensors(final_state(run), final_state(one_worker))


@pytest.mark.parametrize(("dp", "fsdp"), [pytest.param(2, 1, marks=pytest.mark.soak), (1, 2)])
def test_exact_mode_skips_the_same_steps_to_the_bit_at_dp_2_and_fsdp_2(
        tmp_path, corpus_data, ray_cluster, one_worker, dp, fsdp):
    run = tmp_path / "run"
    run_layout(run, corpus_data, dp, *DP, *SPIKES, "train.max_steps=8", fsdp=fsdp)
    assert skipped(run) == skipped(one_worker)
    assert curve(run) == curve(one_worker)
    assert same_tensors(final_state(run), final_state(one_worker))


@pytest.mark.parametrize(("schedule", "dp"), [pytest.param("gpipe", 1, marks=pytest.mark.soak),
                                             pytest.param("1f1b", 1, marks=pytest.mark.soak),
                                             ("1f1b", 2)])
def test_exact_mode_skips_the_same_steps_to_the_bit_on_a_two_stage_pipeline(
        tmp_path, corpus_data, ray_cluster, one_worker, schedule, dp):
    """The losses live on the last stage: they reach the first through the pipeline group (and
    the other replicas through each stage's DP group), so every stage decides alike (a stage
    that updated where the other skipped ends on other weights)."""
    run = tmp_path / "run"
    run_layout(run, corpus_data, dp, *DP, *SPIKES, "train.max_steps=8",
               f"parallel.schedule={schedule}", pp=2)
    assert skipped(run) == skipped(one_worker)
    assert curve(run) == curve(one_worker)
    assert same_tensors(final_state(run), final_state(one_worker))


def test_a_recovered_run_skips_the_steps_an_uninterrupted_one_skips(tmp_path, corpus_data,
                                                                    ray_cluster, one_worker):
    """A worker killed at step 6: the survivors restore step 5 from memory, and the window the
    controller passes with step 6 again is the one it had."""
    run = tmp_path / "recovered"
    run_layout(run, corpus_data, 2, *DP, *SPIKES, "train.max_steps=8", "faults.kill_at=[6]",
               "faults.kill_rank=1", "runtime.call_timeout=120",
               "runtime.collective_timeout=120", "elastic.replace_timeout=120",
               "elastic.min_workers=2")  # replaced, not shrunk: it ends on its 2 workers
    assert [r["failed_step"] for r in records(run, "recovery")] == [6]
    assert skipped(run) == skipped(one_worker)
    assert curve(run) == curve(one_worker)
    assert same_tensors(final_state(run), final_state(one_worker))
