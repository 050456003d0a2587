"""Sharded data parallelism (parallel.fsdp, FSDP2 over gloo) on real Ray actors: in exact mode
every layout gives the unsharded run's bits, across resumes that change the layout and across
recoveries; in fast mode it agrees within float noise."""

from __future__ import annotations

import pytest

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.runtime.controller import Controller
from tests.runtime.conftest import (
    DP,
    assert_bit_identical,
    assert_only_failed_ranks_replaced,
    assert_survivors_kept_their_processes,
    assert_went_on_at_once,
    final_state,
    records,
    run_layout,
    step_records,
    tiny_config,
)

pytestmark = pytest.mark.timeout(240)


def test_resume_at_another_sharding_continues_to_the_same_bits(tmp_path, corpus_data,
                                                               ray_cluster, exact_reference):
    """Written at fsdp 2, resumed at fsdp 4: checkpoints hold whole tensors, so any layout
    restores any other (sharded onto unsharded: the pipeline test below and
    tests/runtime/test_init_from.py)."""
    run = tmp_path / "resharded"
    for dp, fsdp, steps in ((1, 2, 2), (1, 4, 6)):
        run_layout(run, corpus_data, dp, *DP, "determinism=exact", f"train.max_steps={steps}",
                   "checkpoint.every=2", fsdp=fsdp)
    assert [r["step"] for r in records(run, "generation")] == [0, 2]
    assert_bit_identical(run, exact_reference, steps=range(1, 7))


# 1f1b's sharded stages run the same executor as zb-h1's, and interleaved-1f1b's (two chunks
# a stage, so four layers and a reference of its own; its bits against pp 1 are tests/train/
# test_pipeline_stage.py's, in seconds): on demand (`-m soak`)
DEEPER = {"interleaved-1f1b": ("model.n_layers=4",)}


@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.soak), "zb-h1",
                                      pytest.param("interleaved-1f1b", marks=pytest.mark.soak)])
def test_sharded_pipeline_stages_give_the_unsharded_bits_across_a_kill_and_a_resume(
        tmp_path, corpus_data, ray_cluster, exact_reference, schedule):
    """pp 2 x fsdp 2: each stage's weights, gradients and moments sharded over its two
    workers. A worker killed at step 3 is replaced alone (its rows are held by no peer: the
    checkpoint); the checkpoint, written shard by shard per stage, then resumes unsharded on
    two workers, and the six steps are the single worker's to the bit."""
    model = DEEPER.get(schedule, ())
    if model:
        exact_reference = tmp_path / "reference"
        run_layout(exact_reference, corpus_data, 1, *DP, "determinism=exact",
                   "train.max_steps=6", *model)
    chunks = ("parallel.virtual_stages=2",) if schedule == "interleaved-1f1b" else ()
    run = tmp_path / "pipelined"
    run_layout(run, corpus_data, 1, *DP, "determinism=exact", "train.max_steps=4",
               "checkpoint.every=2", "faults.kill_at=[3]", "runtime.call_timeout=120",
               "runtime.collective_timeout=120", f"parallel.schedule={schedule}", *model,
               *chunks, fsdp=2, pp=2)
    [rec] = records(run, "recovery")
    # Step 2's checkpoint was saved just before the kill, and no write had been reported yet:
    # the survivors' writes are waited for, and if the dead worker had finished its part, its
    # record commits step 2 (1 step lost); under load it may still have been writing (step 0
    # then). Which one is timing; tests/runtime/test_catalogue.py and test_recovery.py pin the
    # rules.
    assert rec["cause"] == "died" and rec["source"] == "checkpoint", rec
    assert (rec["restored_step"], rec["lost_steps"]) in ((2, 1), (0, 3)), rec
    assert_only_failed_ranks_replaced(run)
    manifest = CheckpointStore(str(run / "checkpoints")).read_manifest(4)
    assert sorted(manifest["files"]) == [f"stage{s}-shard{k}.safetensors" for s in (0, 1)
                                         for k in (0, 1)]
    assert manifest["topology"]["fsdp_param_dtype"] == "fp32"  # exact mode's `auto`
    run_layout(run, corpus_data, 2, *DP, "determinism=exact", "train.max_steps=6", *model)
    assert_bit_identical(run, exact_reference, steps=range(1, 7))


@pytest.mark.soak  # eight Ray workers, ~50 s alone; the choice of holders is tests/runtime/
# test_recovery.py's, in milliseconds
def test_hybrid_sharded_stages_replace_a_killed_worker_from_a_replicas_snapshot(
        tmp_path, corpus_data, ray_cluster, exact_reference):
    """dp 2 x fsdp 2 x pp 2 (eight workers, gpipe): a stage-1 worker killed at step 3 gets its
    rows from the snapshot of the same shard of its stage's other replica, not from storage
    and not from another stage's, to the single worker's bits."""
    run = tmp_path / "hybrid"
    run_layout(run, corpus_data, 2, *DP, "determinism=exact", "train.max_steps=6",
               "parallel.schedule=gpipe", "faults.kill_at=[3]", "faults.kill_rank=6",
               "runtime.cpus_per_worker=0.5",  # the session cluster has 4 CPUs
               "runtime.call_timeout=120", "runtime.collective_timeout=120", fsdp=2, pp=2)
    [rec] = records(run, "recovery")
    assert (rec["rank"], rec["source"], rec["lost_steps"]) == (6, "memory", 1), rec
    assert_only_failed_ranks_replaced(run)
    assert_bit_identical(run, exact_reference)


@pytest.fixture(scope="module")
def fast_unsharded(tmp_path_factory, corpus_data):
    run = tmp_path_factory.mktemp("fast") / "one"
    run_layout(run, corpus_data, 1, "train.max_steps=20")
    return run


@pytest.mark.parametrize("fsdp", [2, pytest.param(4, marks=pytest.mark.soak)])
def test_fast_mode_agrees_with_the_unsharded_run_within_float_noise(tmp_path, corpus_data,
                                                                   ray_cluster, fast_unsharded,
                                                                   fsdp):
    """20 steps of FSDP2's float32 reduce-scatter against one worker's sums."""
    sharded = tmp_path / f"fsdp{fsdp}"
    run_layout(sharded, corpus_data, 1, "train.max_steps=20", fsdp=fsdp)
    a, b = step_records(fast_unsharded), step_records(sharded)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert max(abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in a) <= 1e-5
    wa, wb = final_state(fast_unsharded), final_state(sharded)
    weights = [k for k in wa if k.startswith("model.")]
    diff = sum(float((wa[k].double() - wb[k].double()).square().sum()) for k in weights)
    norm = sum(float(wa[k].double().square().sum()) for k in weights)
    assert 0 < (diff / norm) ** 0.5 <= 1e-5  # not the same bits (float sums), but close
    # Each worker holds its 1/fsdp of the parameters, gradients and moments (as measured from
    # its tensors: chunks are not all equal, and AdamW's step counters are not sharded).
    whole, part = a[20]["state_bytes"], b[20]["state_bytes"]
    assert whole / fsdp <= part <= 1.1 * whole / fsdp, (whole, part)
    assert b[20]["peak_rss"] > part


def test_a_sharded_run_replaces_killed_and_hung_workers_alone_to_the_same_bits(
        tmp_path, corpus_data, ray_cluster, exact_reference):
    """dp 2 x fsdp 2 (hybrid) with two kills and a hang at random steps (from the seed): a
    failed worker's shards come back from a peer's in-memory snapshot while another replica
    holds them. A failure that finds no standby warm yet goes on at once with the other
    replica alone, so a failure before the run is back at two replicas restores the
    checkpoint: no copy of the lost shard is left."""
    run = tmp_path / "faulty"
    Controller(tiny_config(run, corpus_data, *DP, "runtime.engine=ray", "parallel.dp=2",
                           "parallel.fsdp=2", "determinism=exact", "train.max_steps=6",
                           "faults.random_kills=2", "faults.random_hangs=1",
                           "runtime.call_timeout=120", "runtime.collective_timeout=120")).run()
    recoveries = records(run, "recovery")
    assert sorted(r["cause"] for r in recoveries) == ["died", "died", "hung"], recoveries
    one_replica = [False] + [r["continued_on"] < 4 for r in recoveries[:-1]]  # or one worker
    assert all((r["source"] == "memory" and r["lost_steps"] <= 1) or (alone and
                                                                     r["source"] == "checkpoint")
               for r, alone in zip(recoveries, one_replica, strict=True)), \
        [(r["source"], r["lost_steps"], r["continued_on"]) for r in recoveries]
    # each failed worker replaced at once by the standby, or the run went on without it
    assert_survivors_kept_their_processes(run)
    assert_bit_identical(run, exact_reference)  # and the audit passes


# steps: time for a new worker to start and join (the growth came at step 23, 8 s after the
# kill, on a quiet host; on 2 busy cores 10-20 s)
LONG = 40


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory, corpus_data):
    """`exact_reference`, LONG steps."""
    run = tmp_path_factory.mktemp("reference") / "long"
    run_layout(run, corpus_data, 1, *DP, "determinism=exact", f"train.max_steps={LONG}")
    return run


@pytest.mark.timeout(240, func_only=True)
def test_a_sharded_run_without_a_replacement_goes_on_at_once_on_one_replica_then_grows_back(
        tmp_path, corpus_data, ray_cluster, long_reference):
    """dp 2 x fsdp 2 loses a worker with no capacity to replace it (and no standby). Three
    survivors would cut the tiny model's 64-value norm weights into 22-value chunks, whose bits
    differ (see parallel/fsdp.py), so exact mode goes on at once with two: the failed
    worker's replica drops out, the other continues, and the run grows back to 2 x 2 once
    capacity returns and a new worker is up, the dropped replica's survivor (kept, warm)
    rejoining: to the same bits."""
    run = tmp_path / "elastic"
    summary = Controller(tiny_config(run, corpus_data, *DP, "runtime.engine=ray",
                                     "parallel.dp=2", "parallel.fsdp=2", "determinism=exact",
                                     f"train.max_steps={LONG}", "faults.kill_at=[3]",
                                     "faults.kill_rank=3", "faults.hold_capacity_s=2",
                                     "elastic.standby=false", "runtime.call_timeout=120",
                                     "runtime.collective_timeout=120")).run()
    [rec] = assert_went_on_at_once(run, workers=4)
    assert (rec["dp"], rec["continued_on"], rec["source"]) == (2, 2, "memory"), rec
    # the survivors that went on: replica 0 (ranks 0 and 1), its shards unchanged
    gens = records(run, "generation")
    assert gens[1]["workers"] == {r: gens[0]["workers"][r] for r in ("0", "1")}, gens[:2]
    assert [g["dp"] for g in records(run, "resize")][-1] == 4 and summary.dp == 4
    # the survivor the shrink left out (rank 2, of the dropped replica) rejoined as it was
    assert gens[0]["workers"]["2"] in gens[-1]["workers"].values(), gens
    assert_bit_identical(run, long_reference)


# The tiny model at d_model 192: every row and norm is whole 16-value vectors over 3 and over 4
# shards (parallel/shards.py `misaligned`), so exact mode may shard it 3 ways.
WIDE = ("model.overrides.d_model=192", "model.overrides.head_dim=48",
        "model.overrides.mlp_hidden=384")


@pytest.mark.soak  # ~90 s; a shrink and growth of a sharded run in CI: the dp 2 x fsdp 2 one
def test_a_sharded_run_reshards_onto_three_workers_then_grows_back_to_four(
        tmp_path, corpus_data, ray_cluster):
    """fsdp 4 loses a worker with no capacity to replace it: the killed worker's rows are held
    by no one else, so the run restores the checkpoint onto the three left (each reading only
    its rows; the vocabulary's rows split unevenly 3 ways), then grows back to 4, the rows
    pulled from the three snapshots into the 4-way layout: bit-identical to one worker."""
    reference = tmp_path / "one"
    # 24 steps: the capacity held for 1 s comes back, and the standby (warm by then) takes it,
    # while steps remain (the run goes on at once on three; the growth happens at a step
    # boundary once the standby is placed)
    run_layout(reference, corpus_data, 1, *DP, *WIDE, "determinism=exact", "train.max_steps=24")
    run = tmp_path / "elastic"
    summary = Controller(tiny_config(run, corpus_data, *DP, *WIDE, "runtime.engine=ray",
                                     "parallel.fsdp=4", "determinism=exact", "train.max_steps=24",
                                     "faults.kill_at=[5]", "faults.hold_capacity_s=1",
                                     "runtime.call_timeout=120",
                                     "runtime.collective_timeout=120")).run()
    [rec] = records(run, "recovery")
    assert (rec["dp"], rec["source"], rec["restored_step"]) == (3, "checkpoint", 3), rec
    [grow] = records(run, "resize")
    assert grow["dp"] == 4 and summary.dp == 4
    assert_bit_identical(run, reference)
