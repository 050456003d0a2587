"""The pipeline benchmark's analysis: steps to a target loss, the pooled per-op costs, and
which runs need the whole length."""

import pytest

from relaytrain.bench.pipeline import (
    FULL,
    _runs_for_real,
    heldout_curves,
    pooled_costs,
    run_steps,
    scaled_costs,
    steps_to_target,
)
from relaytrain.parallel.pipeline.schedules import SCHEDULES


def test_steps_to_target_interpolates_between_evaluations():
    curve = [[4, 6.0, 1.0], [8, 5.0, 2.0], [12, 4.0, 3.0]]
    assert steps_to_target(curve, 4.5) == pytest.approx(10.0)
    assert steps_to_target(curve, 6.5) == 4.0  # already reached at the first evaluation
    assert steps_to_target(curve, 3.0) is None


def test_pooled_costs_are_per_stage_medians_over_runs():
    runs = {name: {"costs": {"forward": [f, 2 * f], "backward": [3.0, 3.0], "update": [1.0, u]}}
            for name, f, u in (("a", 1.0, 1.0), ("b", 2.0, 5.0), ("c", 9.0, 2.0))}
    assert pooled_costs(runs) == {"forward": [2.0, 4.0], "backward": [3.0, 3.0],
                                  "update": [1.0, 2.0]}


def test_split_runs_pool_their_own_f_b_and_w_and_whole_backwards_the_others():
    def run(b: float, w: float, f: float = 1.0) -> dict:
        return {"costs": {"forward": [f], "backward": [b], "update": [0.5], "weight": [w]}}

    runs = {"1f1b": run(3.0, 0.0), "gpipe": run(5.0, 0.0), "pipedream": run(4.0, 0.0),
            "zb-h1": run(2.0, 1.5, 1.25)}
    pooled = pooled_costs(runs)
    assert pooled == {"forward": [1.0], "backward": [4.0], "update": [0.5],
                      "split_forward": [1.25], "split_backward": [2.0], "weight": [1.5]}
    whole, split = (scaled_costs(pooled, 2, 0.0, split_lists=s) for s in (False, True))
    assert (whole.forward, whole.backward, whole.weight) == ((1.0, 1.0), (4.0, 4.0), None)
    assert split.forward == (1.25, 1.25)  # what recording the deferred layers costs
    assert (split.backward, split.weight) == ((3.5, 3.5), (1.5, 1.5))  # B + W, and W


def test_deeper_pipelines_keep_the_measured_stage_and_the_same_model_thins_it():
    measured = {"forward": [1.0, 3.0], "backward": [2.0, 6.0], "update": [0.5, 1.5]}
    deeper = scaled_costs(measured, 8, 0.25)
    assert (deeper.forward, deeper.backward, deeper.update) == ((2.0,) * 8, (4.0,) * 8, (1.0,) * 8)
    thin = scaled_costs(measured, 8, 0.25, deeper=False)
    assert (thin.forward, thin.backward, thin.update) == ((0.5,) * 8, (1.0,) * 8, (0.25,) * 8)
    assert deeper.transfer == thin.transfer == 0.25  # the measured hop, whatever the stage size


def test_only_the_runs_whose_curves_are_used_run_the_whole_length():
    """Every flush schedule's curve is 1f1b's at S = 2; the asynchronous ones' change with S."""
    plan = {(S, n): run_steps(FULL, S, n) for S in FULL.stages for n in SCHEDULES
            if _runs_for_real(n, S)}
    whole = sorted(k for k, steps in plan.items() if steps == FULL.steps)
    assert whole == [(2, "1f1b"), (2, "paci"), (2, "pipedream"), (4, "paci"), (4, "pipedream")]
    assert all(steps == FULL.probe_steps for k, steps in plan.items() if k not in whole)
    assert len(plan) == 11  # interleaved-1f1b (V 2) runs for real at S = 2 only

    def run(loss: float) -> dict:
        return {"heldout": [[8, loss, 1.0]]}

    real = {2: {n: run(2.0 + i) for i, n in enumerate(SCHEDULES)},
            4: {n: run(10.0 + i) for i, n in enumerate(SCHEDULES)}}
    curves = heldout_curves(real, FULL)
    assert {n: c[0][1] for n, c in curves.items()} == {
        "gpipe": 3.0, "1f1b": 3.0, "zb-h1": 3.0, "interleaved-1f1b": 3.0,
        "pipedream": 10.0 + SCHEDULES.index("pipedream"), "paci": 10.0 + SCHEDULES.index("paci")}
