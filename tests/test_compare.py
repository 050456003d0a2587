import csv
import json

import numpy as np
import pytest

from relaytrain.cli import main
from relaytrain.compare import Curve, compare, compare_curves, default_landmarks, parse_landmarks
from relaytrain.errors import UserError


def loss_curve(steps):
    return 3.0 + 8.0 * np.exp(-np.asarray(steps, dtype=float) / 150.0)


def write_run(path, steps, loss, tokens_per_step=1024, evals=(), events=()):
    """A run directory as the trainer writes it (docs/CONTRACTS.md "Run directory")."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s, v in zip(steps, loss, strict=True):
            f.write(json.dumps({"kind": "step", "step": int(s), "loss": float(v),
                                "tokens": int(s) * tokens_per_step}) + "\n")
        for s, v in evals:
            f.write(json.dumps({"kind": "eval", "step": s, "tokens": s * tokens_per_step,
                                "heldout_loss": v}) + "\n")
        for e in events:
            f.write(json.dumps(e) + "\n")
    return path


def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def run_cli(capsys, *argv):
    code = main(["compare", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out):
    return json.loads(out.strip().splitlines()[-1])


STEPS = np.arange(1, 201)


def test_identical_runs_differ_by_exactly_zero(tmp_path, capsys):
    evals = [(s, float(loss_curve(s)) + 0.2) for s in range(20, 201, 20)]
    a = write_run(tmp_path / "a", STEPS, loss_curve(STEPS), evals=evals)
    b = write_run(tmp_path / "b", STEPS, loss_curve(STEPS), evals=evals)
    code, out, err = run_cli(capsys, a, b, "--tolerance", 0, "--json")
    assert code == 0 and err == ""
    summary = last_json(out)
    assert summary["within"] is True
    assert [c["metric"] for c in summary["curves"]] == ["loss", "heldout_loss"]
    for c in summary["curves"]:
        assert c["max_abs_diff"] == 0.0 and c["mean_abs_diff"] == 0.0
        assert c["first_out"] is None
    assert summary["curves"][0]["points"] == 200
    assert summary["curves"][0]["overlap"] == [1.0, 200.0]


def test_resumed_run_with_a_redone_step_matches_the_uninterrupted_one(tmp_path, capsys):
    ref = write_run(tmp_path / "ref", STEPS, loss_curve(STEPS))
    run = tmp_path / "run"
    write_run(run, STEPS[:120], loss_curve(STEPS[:120]))
    with open(run / "metrics.jsonl", "a") as f:  # step 120 rolled back, then redone
        f.write(json.dumps({"kind": "step", "step": 120, "loss": 99.0}) + "\n")
        f.write(json.dumps({"kind": "recovery", "step": 119, "failed_step": 121}) + "\n")
        for s in STEPS[118:]:
            f.write(json.dumps({"kind": "step", "step": int(s), "loss": float(loss_curve(s)),
                                "tokens": int(s) * 1024}) + "\n")
    report = compare(run, ref, tolerance=0.0, window=3)
    assert report.within
    assert report.curves[0].max_abs_diff == (0.0, 1.0)
    assert report.run.events == [("recovery", 119.0)]


def test_shifted_segment_fails_naming_the_first_point_out_of_band(tmp_path, capsys):
    loss = loss_curve(STEPS)
    loss[99:130] += 0.05  # steps 100..130
    run = write_run(tmp_path / "run", STEPS, loss,
                    events=[{"kind": "restart", "step": 99, "wall": 0}])
    ref = write_run(tmp_path / "ref", STEPS, loss_curve(STEPS))
    code, out, err = run_cli(capsys, run, ref, "--landmarks", "50,115")
    assert code == 1 and err == ""
    assert "first out of band at step 100: run" in out
    assert "OUTSIDE ±0.01: loss leaves the band at step 100" in out
    assert "held-out loss not compared" in out
    code, out, _ = run_cli(capsys, run, ref, "--json", "--landmarks", "50,115")
    summary = last_json(out)
    loss_cmp = summary["curves"][0]
    assert code == 1 and summary["within"] is False
    assert loss_cmp["first_out"]["x"] == 100.0
    assert loss_cmp["first_out"]["diff"] == pytest.approx(0.05)
    assert loss_cmp["max_abs_diff"] == pytest.approx(0.05)
    assert [p["x"] for p in loss_cmp["landmarks"]] == [50.0, 115.0]
    assert [p["diff"] for p in loss_cmp["landmarks"]] == pytest.approx([0.0, 0.05])
    assert summary["events"]["run"] == [{"kind": "restart", "x": 99.0}]


def test_different_seed_lands_outside_a_tight_tolerance(tmp_path):
    noise = [np.random.default_rng(seed).normal(0, 0.02, STEPS.size) for seed in (1, 2)]
    a = write_run(tmp_path / "a", STEPS, loss_curve(STEPS) + noise[0])
    b = write_run(tmp_path / "b", STEPS, loss_curve(STEPS) + noise[1])
    assert not compare(a, b, tolerance=0.001).within


def test_different_logging_intervals_are_interpolated(tmp_path):
    linear = 10.0 - 0.01 * STEPS  # linear in step: interpolation is exact
    run = write_run(tmp_path / "run", STEPS, linear)
    ref = write_run(tmp_path / "ref", STEPS[::10], linear[::10])  # steps 1, 11, ..., 191
    c = compare(run, ref, tolerance=1e-9).curves[0]
    assert c.within
    assert (c.x[0], c.x[-1], c.x.size) == (1.0, 191.0, 191)  # only the overlap
    assert c.max_abs_diff[0] < 1e-12
    # a kink between the reference's points shows up at the run's own steps
    kinked = linear.copy()
    kinked[55] += 0.5  # step 56
    write_run(tmp_path / "run", STEPS, kinked)
    c = compare(run, ref, tolerance=0.1).curves[0]
    assert c.first_out.x == 56.0 and c.first_out.diff == pytest.approx(0.5)


def test_token_alignment(tmp_path, capsys):
    # The reference used twice the batch: by tokens the curves agree, by step they do not.
    run = write_run(tmp_path / "run", STEPS, loss_curve(STEPS * 1024 / 2048), 1024)
    ref = write_run(tmp_path / "ref", STEPS, loss_curve(STEPS), 2048)
    code, out, _ = run_cli(capsys, run, ref, "--align", "tokens", "--tolerance", "1e-4",
                           "--json")  # interpolating the curvature between reference points
    c = last_json(out)["curves"][0]
    assert code == 0 and c["overlap"] == [2048.0, 204800.0]
    code, out, _ = run_cli(capsys, run, ref, "--align", "tokens", "--landmarks", "4K,0.1M")
    assert code == 0 and "aligned by tokens" in out and "  4K  " in out and "100K" in out
    assert run_cli(capsys, run, ref, "--align", "step")[0] == 1


def test_smoothing_window_applies_to_both_curves(tmp_path):
    noise = np.zeros(STEPS.size)
    noise[1::2], noise[2::2] = 0.02, -0.02  # a trailing mean of 2 leaves 0.01 at step 2, else 0
    run = write_run(tmp_path / "run", STEPS, loss_curve(STEPS) + noise)
    ref = write_run(tmp_path / "ref", STEPS, loss_curve(STEPS))
    assert not compare(run, ref, tolerance=0.011).within
    c = compare(run, ref, tolerance=0.011, window=2).curves[0]
    assert c.within
    assert c.max_abs_diff == pytest.approx((0.01, 2.0))
    assert np.abs(c.diff[2:]).max() < 1e-12


def test_wandb_history_csv_with_heldout_column(tmp_path, capsys):
    evals = [(s, float(loss_curve(s)) + 0.3) for s in range(50, 201, 50)]
    run = write_run(tmp_path / "run", STEPS, loss_curve(STEPS), evals=evals)
    rows = []
    for s in range(0, 201, 5):
        heldout = float(loss_curve(s)) + 0.3 + (0.05 if s == 150 else 0.0) if s in (
            50, 100, 150, 200) else ""
        rows.append([s, float(loss_curve(s)), heldout, "x"])
    ref = write_csv(tmp_path / "history.csv", ["_step", "train/loss", "eval/loss", "note"], rows)
    code, out, _ = run_cli(capsys, run, ref, "--json", "--tolerance", "0.01")
    summary = last_json(out)
    loss_cmp, heldout = summary["curves"]
    assert code == 1
    assert loss_cmp["reference_source"] == "train/loss" and loss_cmp["within"] is True
    assert heldout["reference_source"] == "eval/loss" and heldout["points"] == 4
    assert heldout["first_out"]["x"] == 150.0
    # naming the columns explicitly, here only the training loss (no held-out comparison)
    ref2 = write_csv(tmp_path / "custom.csv", ["it", "my loss"],
                     [[s, float(loss_curve(s))] for s in range(1, 201)])
    code, out, _ = run_cli(capsys, run, ref2, "--ref-step-column", "it",
                           "--ref-metric-column", "my loss")
    assert code == 0 and "reference: my loss" in out and "--ref-heldout-column" in out


def test_wandb_chart_export_and_olmo_column_names(tmp_path, capsys):
    run = write_run(tmp_path / "run", STEPS, loss_curve(STEPS))
    chart = write_csv(tmp_path / "chart.csv",
                      ["Step", "olmo3-7b - train/CELoss", "olmo3-7b - train/CELoss__MIN"],
                      [[s, float(loss_curve(s)), 0.0] for s in range(1, 201, 4)])
    code, out, _ = run_cli(capsys, run, chart, "--json")
    assert code == 0
    assert last_json(out)["curves"][0]["reference_source"] == "olmo3-7b - train/CELoss"
    hist = tmp_path / "history.jsonl"
    hist.write_text("".join(json.dumps({"trainer/global_step": s, "train/CELoss":
                                        float(loss_curve(s)), "throughput/total_tokens": s * 1024})
                            + "\n" for s in range(1, 201)))
    assert run_cli(capsys, run, hist, "--tolerance", "0")[0] == 0
    assert run_cli(capsys, run, hist, "--align", "tokens", "--tolerance", "0")[0] == 0


def test_png_is_written_only_with_out(tmp_path, capsys):
    run = write_run(tmp_path / "run", STEPS, loss_curve(STEPS) + 0.02,
                    evals=[(100, 4.0), (200, 3.5)],
                    events=[{"kind": "restart", "step": 50}, {"kind": "recovery", "step": 150}])
    ref = write_run(tmp_path / "ref", STEPS, loss_curve(STEPS), evals=[(100, 4.0), (200, 3.5)])
    assert run_cli(capsys, run, ref)[0] == 1
    assert not list(tmp_path.rglob("*.png"))
    out_png = tmp_path / "cmp.png"
    code, out, _ = run_cli(capsys, run, ref, "--out", out_png, "--json")
    assert code == 1 and last_json(out)["plot"] == str(out_png)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ""] == ["cmp.png"]


def test_default_landmarks_are_log_spaced_grid_points():
    grid = np.arange(1.0, 10001.0)
    marks = default_landmarks(grid)
    assert marks[0] == 1.0 and marks[-1] == 10000.0 and len(marks) == 8
    np.testing.assert_allclose(marks, np.geomspace(1, 10000, 8), atol=0.5)
    assert list(default_landmarks(np.array([0.0, 5.0]))) == [5.0]
    assert list(default_landmarks(np.array([0.0]))) == [0.0]


def test_compare_curves_counts_nan_as_out_of_band():
    x = np.arange(1.0, 6.0)
    y = np.ones(5)
    c = compare_curves(Curve(x, np.array([1, 1, np.nan, 1, 1.0]), "loss"), Curve(x, y, "loss"),
                       metric="loss", tolerance=0.1)
    assert c.first_out.x == 3.0 and not c.within
    assert c.to_json()["max_abs_diff"] is None  # strict JSON: NaN becomes null


def test_parse_landmarks():
    assert parse_landmarks("100, 1e3,2B,1.5k") == [100.0, 1000.0, 2e9, 1500.0]
    with pytest.raises(UserError, match="not a number"):
        parse_landmarks("100,,200")


@pytest.mark.parametrize("setup, args, message", [
    (lambda p: None, [], "run directory not found"),
    (lambda p: (p / "run").mkdir(), [], "metrics.jsonl: no such file"),
    (lambda p: write_run(p / "run", [], []), [], "no 'loss' in the step or eval records"),
    (None, ["--metric", "mfu"], "no 'mfu' in the step or eval records (step records have: "
                                "loss, tokens)"),
    (None, ["--tolerance", "-1"], "--tolerance -1.0: expected a number >= 0"),
    (None, ["--window", "0"], "--window 0"),
    (None, ["--landmarks", "500"], "landmark 500 is outside the overlap"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, args, message):
    if setup is None:
        write_run(tmp_path / "run", STEPS, loss_curve(STEPS))
    else:
        setup(tmp_path)
    ref = write_run(tmp_path / "ref", STEPS, loss_curve(STEPS))
    code, out, err = run_cli(capsys, tmp_path / "run", ref, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize("name, text, message", [
    ("missing.csv", None, "reference not found"),
    ("cols.csv", "_step,accuracy\n1,0.5\n", "no column for metric 'loss' (looked for loss, "),
    ("nostep.csv", "when,loss\n1,0.5\n", "no step column (looked for step, _step"),
    ("bad.csv", "step,loss\n1,0.5\n2,abc\n", "row 2, column 'loss': 'abc' is not a number"),
    ("empty.csv", "", "empty file"),
    ("blank.csv", "step,loss\n1,\n", "no rows with both 'step' and 'loss'"),
    ("late.csv", "step,loss\n500,3\n600,2\n", "no overlap between the loss curves: the run "
                                              "covers step 1..200, the reference 500..600"),
    ("bad.jsonl", '{"step": 1}\nnot json\n{"step": 2}\n', "bad.jsonl:2: not valid JSON"),
])
def test_bad_reference_is_one_line_and_exit_2(tmp_path, capsys, name, text, message):
    run = write_run(tmp_path / "run", STEPS, loss_curve(STEPS))
    if text is not None:
        (tmp_path / name).write_text(text)
    code, out, err = run_cli(capsys, run, tmp_path / name)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_explicit_column_that_does_not_exist_is_exit_2(tmp_path, capsys):
    run = write_run(tmp_path / "run", STEPS, loss_curve(STEPS))
    ref = write_csv(tmp_path / "ref.csv", ["step", "loss"], [[1, 3.0]])
    code, _, err = run_cli(capsys, run, ref, "--ref-heldout-column", "val")
    assert code == 2 and "no column 'val' (--ref-heldout-column); columns: step, loss" in err
    code, _, err = run_cli(capsys, run, ref, "--align", "tokens")
    assert code == 2 and "no tokens column" in err and "--ref-tokens-column" in err
    # an empty recognised held-out column only skips the held-out comparison
    ref = write_csv(tmp_path / "ref.csv", ["step", "loss", "eval/loss"], [[1, 3.0, ""]])
    code, out, _ = run_cli(capsys, run, ref, "--tolerance", "100")
    assert code == 0 and "held-out loss not compared" in out
    code, _, err = run_cli(capsys, run, ref, "--ref-heldout-column", "eval/loss")
    assert code == 2 and "no rows with both 'step' and 'eval/loss'" in err
