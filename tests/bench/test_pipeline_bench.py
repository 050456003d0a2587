"""The pipeline benchmark's analysis: steps to a target loss and the pooled per-op costs."""

import pytest

from relaytrain.bench.pipeline import pooled_costs, scaled_costs, steps_to_target


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


def test_split_runs_pool_their_own_b_and_w_and_whole_backwards_the_others():
    def run(b: float, w: float) -> dict:
        return {"costs": {"forward": [1.0], "backward": [b], "update": [0.5], "weight": [w]}}

    runs = {"1f1b": run(3.0, 0.0), "gpipe": run(5.0, 0.0), "paci": run(4.0, 0.0),
            "zb-h1": run(2.0, 1.5)}
    pooled = pooled_costs(runs)
    assert pooled == {"forward": [1.0], "backward": [4.0], "update": [0.5],
                      "split_backward": [2.0], "weight": [1.5]}
    whole, split = (scaled_costs(pooled, 2, 0.0, split_lists=s) for s in (False, True))
    assert (whole.backward, whole.weight) == ((4.0, 4.0), None)
    assert (split.backward, split.weight) == ((3.5, 3.5), (1.5, 1.5))  # B + W, and W


def test_deeper_pipelines_keep_the_measured_stage_and_the_same_model_thins_it():
    measured = {"forward": [1.0, 3.0], "backward": [2.0, 6.0], "update": [0.5, 1.5]}
    deeper = scaled_costs(measured, 8, 0.25)
    assert (deeper.forward, deeper.backward, deeper.update) == ((2.0,) * 8, (4.0,) * 8, (1.0,) * 8)
    thin = scaled_costs(measured, 8, 0.25, deeper=False)
    assert (thin.forward, thin.backward, thin.update) == ((0.5,) * 8, (1.0,) * 8, (0.25,) * 8)
    assert deeper.transfer == thin.transfer == 0.25  # the measured hop, whatever the stage size
