import json

import numpy as np
import pytest

from relaytrain.errors import UserError
from relaytrain.runlog import read_jsonl, read_metrics, series


def write_lines(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_last_record_per_step_wins_and_steps_are_sorted(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [
        {"kind": "step", "step": 1, "loss": 5.0},
        {"kind": "step", "step": 2, "loss": 4.0},
        {"kind": "step", "step": 3, "loss": 3.9},  # rolled back by the recovery below
        {"kind": "eval", "step": 2, "heldout_loss": 4.5},
        {"kind": "recovery", "step": 2, "failed_step": 3, "cause": "killed"},
        {"kind": "eval", "step": 2, "heldout_loss": 4.4},
        {"kind": "step", "step": 3, "loss": 3.5},
        {"kind": "alarm", "step": 3, "message": "slow"},
        {"kind": "restart", "step": 3},
        {"kind": "future_kind", "step": 3},
    ])
    log = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in log.steps] == [(1, 5.0), (2, 4.0), (3, 3.5)]
    assert [(r["step"], r["heldout_loss"]) for r in log.evals] == [(2, 4.4)]
    assert [e["kind"] for e in log.events] == ["recovery", "alarm", "restart"]
    assert log.path == tmp_path / "metrics.jsonl"


def test_records_without_kind_are_steps_and_a_file_path_is_accepted(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [{"step": 2, "loss": 2.0}, {"step": 1, "loss": 1.0}])
    log = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in log.steps] == [1, 2]


def test_truncated_last_line_is_ignored(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [{"kind": "step", "step": 1, "loss": 2.0}],
                tail='{"kind": "step", "step": 2, "lo')
    assert [r["step"] for r in read_metrics(tmp_path).steps] == [1]


def test_bad_line_before_the_end_is_an_error_naming_the_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n{oops\n\n{"step": 2}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("[1, 2]\n{}\n")
    with pytest.raises(UserError, match="expected a JSON object"):
        read_jsonl(tmp_path / "metrics.jsonl")


def test_step_record_without_integer_step_is_an_error(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [{"kind": "eval", "step": "7", "heldout_loss": 1}])
    with pytest.raises(UserError, match="without an integer 'step'"):
        read_metrics(tmp_path)


def test_missing_file_or_directory_names_the_path(tmp_path):
    with pytest.raises(UserError, match=f"{tmp_path}/metrics.jsonl: no such file"):
        read_metrics(tmp_path)
    with pytest.raises(UserError, match=f"run directory not found: {tmp_path}/nope"):
        read_metrics(tmp_path / "nope")


def test_series_skips_records_without_the_key_and_takes_any_x():
    records = [
        {"step": 1, "tokens": 100, "loss": 3.0},
        {"step": 2, "tokens": 200},
        {"step": 3, "tokens": 300, "loss": None},
        {"step": 4, "tokens": 400, "loss": 2.5},
        {"step": 5, "loss": 2.0},
    ]
    x, y = series(records, "loss")
    np.testing.assert_array_equal(x, [1, 4, 5])
    np.testing.assert_array_equal(y, [3.0, 2.5, 2.0])
    x, y = series(records, "loss", x="tokens")
    np.testing.assert_array_equal(x, [100, 400])
    assert x.dtype == y.dtype == np.float64
    x, y = series([], "loss")
    assert x.shape == y.shape == (0,)
