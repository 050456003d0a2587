"""A worker's evaluator: its eval sets are opened once, at the first evaluation, and every set's
share of instances goes through the forward it is given."""

from __future__ import annotations

from relaytrain.train import evaluate
from relaytrain.train.evaluate import Evaluator


def test_the_eval_sets_open_at_the_first_evaluation_and_each_set_goes_through_the_forward(
        monkeypatch):
    opened = []

    def open_eval_sets(dataset, sets):
        opened.append((dataset, sets))
        return {name: f"split of {name}" for name in sets}

    monkeypatch.setattr(evaluate, "open_eval_sets", open_eval_sets)
    evaluator = Evaluator("the dataset", {"heldout": {}, "other": {"path": "x"}})
    assert opened == []

    def forward(split, ids, part, parts):
        return {i: float(len(split) + part * 10 + parts * 100) for i in ids}

    for _ in range(2):
        got = evaluator.losses({"heldout": [1, 2], "other": [3]}, forward, 1, 2)
        assert got == {"heldout": {1: 226.0, 2: 226.0}, "other": {3: 224.0}}
    assert opened == [("the dataset", {"heldout": {}, "other": {"path": "x"}})]
