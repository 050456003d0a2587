"""`relaytrain compare`: hold a run's curves against a reference run, point by point.

Reproducing a published run means showing that the loss stays within a tolerance of the
reference team's logged curve everywhere, not eyeballing two lines in a notebook. The
reference is another run directory or a CSV/JSON-lines export of a logged run (e.g. a W&B
history export), whose step/token/metric columns are recognised by their common names.

Both curves are compared on the union of their logged x values inside the range both cover,
each side interpolated linearly where it has no point of its own, and optionally smoothed
there with the same trailing moving average. The held-out loss is compared the same
way whenever both sides have it, since only held-out validation catches a model that memorises.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relaytrain.errors import UserError
from relaytrain.runlog import RunLog, read_jsonl, read_metrics, series

HELDOUT = "heldout_loss"
N_LANDMARKS = 8
MARKED_EVENTS = ("restart", "recovery")

# Common column names of logged-run exports, in order of preference (matched ignoring case).
STEP_COLUMNS = ("step", "_step", "global_step", "train/step", "trainer/global_step")
TOKEN_COLUMNS = (
    "tokens", "train/tokens", "throughput/total_tokens", "total_tokens", "tokens_seen",
)
METRIC_COLUMNS = {
    "loss": ("loss", "train/loss", "train/CELoss", "train/CE loss", "train_loss", "learning/loss"),
    "ce_loss": ("ce_loss", "train/CELoss", "train/CE loss", "train/ce_loss"),
    HELDOUT: (
        HELDOUT, "eval/loss", "eval/heldout_loss", "val/loss", "val_loss", "eval_loss",
        "validation/loss",
    ),
}


def metric_columns(metric: str) -> tuple[str, ...]:
    """Export column names that hold `metric`, most likely first."""
    return METRIC_COLUMNS.get(metric, (metric, f"train/{metric}", f"eval/{metric}"))


@dataclass(frozen=True)
class Curve:
    """One side's series of a metric: x strictly increasing, `source` the key or column."""

    x: np.ndarray
    y: np.ndarray
    source: str


@dataclass(frozen=True)
class Point:
    """Both sides' values at one x (a landmark, or the first point out of band)."""

    x: float
    run: float
    reference: float

    @property
    def diff(self) -> float:
        return self.run - self.reference

    def to_json(self) -> dict[str, Any]:
        return {k: _json_num(v) for k, v in
                (("x", self.x), ("run", self.run), ("reference", self.reference),
                 ("diff", self.diff))}


@dataclass(frozen=True)
class CurveComparison:
    """A metric of both sides on a common grid over their overlap (smoothed values)."""

    metric: str
    run_source: str
    reference_source: str
    tolerance: float
    x: np.ndarray
    run: np.ndarray
    reference: np.ndarray
    landmarks: list[Point]
    first_out: Point | None

    @property
    def diff(self) -> np.ndarray:
        return self.run - self.reference

    @property
    def within(self) -> bool:
        return self.first_out is None

    @property
    def max_abs_diff(self) -> tuple[float, float]:
        """(largest |diff|, its x); NaN counts as largest, since it is never within a band."""
        d = np.abs(self.diff)
        i = int(np.argmax(np.where(np.isnan(d), np.inf, d)))
        return float(d[i]), float(self.x[i])

    @property
    def mean_abs_diff(self) -> float:
        return float(np.mean(np.abs(self.diff)))

    def to_json(self) -> dict[str, Any]:
        max_abs, max_at = self.max_abs_diff
        return {
            "metric": self.metric,
            "run_source": self.run_source,
            "reference_source": self.reference_source,
            "overlap": [float(self.x[0]), float(self.x[-1])],
            "points": int(self.x.size),
            "max_abs_diff": _json_num(max_abs),
            "max_abs_diff_at": max_at,
            "mean_abs_diff": _json_num(self.mean_abs_diff),
            "within": self.within,
            "first_out": self.first_out.to_json() if self.first_out else None,
            "landmarks": [p.to_json() for p in self.landmarks],
        }


@dataclass(frozen=True)
class Side:
    """What one side contributes: its metric, its held-out curve if any, and the restarts and
    recoveries (kind, x) to mark on the plot."""

    label: str
    is_run: bool
    metric: Curve
    heldout: Curve | None
    events: list[tuple[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Report:
    run: Side
    reference: Side
    align: str
    window: int
    tolerance: float
    curves: list[CurveComparison]
    notes: list[str]

    @property
    def within(self) -> bool:
        return all(c.within for c in self.curves)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run.label,
            "reference": self.reference.label,
            "align": self.align,
            "window": self.window,
            "tolerance": self.tolerance,
            "within": self.within,
            "curves": [c.to_json() for c in self.curves],
            "events": {name: [{"kind": k, "x": x} for k, x in side.events]
                       for name, side in (("run", self.run), ("reference", self.reference))},
            "notes": self.notes,
        }


def _json_num(v: float) -> float | None:
    """Strict JSON has no NaN/Infinity; a non-finite value is reported as null."""
    return float(v) if math.isfinite(v) else None


# ---------------------------------------------------------------------------- loading sides


def _clean(x: np.ndarray, y: np.ndarray, source: str) -> Curve:
    """Sort by x and keep the last value logged at each x (as the run log does per step)."""
    keep = np.isfinite(x)
    x, y = x[keep], y[keep]
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    last = np.append(x[1:] != x[:-1], True)
    return Curve(x[last], y[last], source)


def _log_curve(log: RunLog, key: str, xkey: str, required: bool) -> Curve | None:
    """`key` from the step records, else from the eval records, against `xkey`."""
    for kind, records in (("step", log.steps), ("eval", log.evals)):
        if not any(key in r for r in records):
            continue
        if not any(xkey in r for r in records):
            raise UserError(f"{log.path}: the {kind} records have no {xkey!r}; "
                            f"use --align step")
        x, y = series(records, key, xkey)
        if not x.size:
            raise UserError(f"{log.path}: no numeric {key!r} values in the {kind} records")
        return _clean(x, y, key)
    if not required:
        return None
    known = sorted({k for r in log.steps for k in r} - {"kind", "step"})
    raise UserError(f"{log.path}: no {key!r} in the step or eval records "
                    f"(step records have: {', '.join(known) or 'none'})")


def _side_from_log(log: RunLog, label: str, metric: str, xkey: str) -> Side:
    events = [(e["kind"], float(e["step"])) for e in log.events
              if e.get("kind") in MARKED_EVENTS and isinstance(e.get("step"), (int, float))]
    if xkey != "step":
        steps, xs = series(log.steps, xkey)
        events = [(k, float(np.interp(s, steps, xs))) for k, s in events] if steps.size else []
    heldout = None if metric == HELDOUT else _log_curve(log, HELDOUT, xkey, required=False)
    return Side(label, True, _log_curve(log, metric, xkey, required=True), heldout, events)


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            return list(reader.fieldnames or []), list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path}: cannot read as CSV ({e})") from None


def _find_column(columns: list[str], wanted: str | None, candidates: Sequence[str], flag: str,
                 path: Path) -> str | None:
    """The column to use: `wanted` exactly if given, else the first candidate present,
    ignoring case or as a W&B chart export names it ("<run name> - <metric>")."""
    if wanted is not None:
        if wanted not in columns:
            raise UserError(f"{path}: no column {wanted!r} ({flag}); columns: {', '.join(columns)}")
        return wanted
    lower = {c.lower(): c for c in columns}
    for cand in candidates:
        if cand.lower() in lower:
            return lower[cand.lower()]
    for cand in candidates:
        for c in columns:
            if c.lower().endswith(" - " + cand.lower()):
                return c
    return None


def _table_curve(path: Path, rows: list[dict[str, Any]], xcol: str, ycol: str) -> Curve | None:
    """`ycol` against `xcol` over the rows that have both (None if none do: a sparse export
    holds, e.g., eval columns only on the rows of evaluation steps)."""
    xs, ys = [], []
    for n, row in enumerate(rows, 1):
        x, y = _cell(row.get(xcol), path, n, xcol), _cell(row.get(ycol), path, n, ycol)
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return _clean(np.array(xs), np.array(ys), ycol) if xs else None


def _cell(v: Any, path: Path, row: int, col: str) -> float | None:
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    if isinstance(v, (int, float, str)) and not isinstance(v, bool):
        try:
            return float(v)
        except ValueError:
            pass
    raise UserError(f"{path}: row {row}, column {col!r}: {v!r} is not a number")


def _side_from_table(path: Path, columns: list[str], rows: list[dict[str, Any]], metric: str,
                     align: str, given: dict[str, str | None]) -> Side:
    if not columns:
        raise UserError(f"{path}: empty file (expected a header or JSON objects)")
    xflag = "--ref-step-column" if align == "step" else "--ref-tokens-column"
    looked = STEP_COLUMNS if align == "step" else TOKEN_COLUMNS
    xcol = _find_column(columns, given[align], looked, xflag, path)
    if xcol is None:
        raise UserError(f"{path}: no {align} column (looked for {', '.join(looked)}; "
                        f"columns: {', '.join(columns)}); name it with {xflag}")
    ycol = _find_column(columns, given["metric"], metric_columns(metric),
                        "--ref-metric-column", path)
    if ycol is None:
        raise UserError(f"{path}: no column for metric {metric!r} (looked for "
                        f"{', '.join(metric_columns(metric))}; columns: {', '.join(columns)}); "
                        f"name it with --ref-metric-column")
    curve = _table_curve(path, rows, xcol, ycol)
    if curve is None:
        raise UserError(f"{path}: no rows with both {xcol!r} and {ycol!r}")
    heldout = None
    if metric != HELDOUT:
        hcol = _find_column(columns, given["heldout"], METRIC_COLUMNS[HELDOUT],
                            "--ref-heldout-column", path)
        heldout = _table_curve(path, rows, xcol, hcol) if hcol else None
        if heldout is None and given["heldout"]:
            raise UserError(f"{path}: no rows with both {xcol!r} and {hcol!r}")
    return Side(str(path), False, curve, heldout)


def load_reference(reference: str | os.PathLike[str], metric: str, align: str,
                   columns: dict[str, str | None]) -> Side:
    """A run directory, a relaytrain metrics.jsonl, or a CSV/JSON-lines export of a run.

    `columns` names export columns explicitly: keys "step", "tokens", "metric", "heldout"
    (None: recognise by common names). For a run log, "metric" renames the record key.
    """
    p = Path(reference)
    if p.is_dir():
        return _side_from_log(read_metrics(p), str(p), columns["metric"] or metric, align)
    if not p.is_file():
        raise UserError(f"reference not found: {p} (expected a run directory or a CSV/JSONL "
                        f"export of a logged run)")
    if p.suffix.lower() not in (".jsonl", ".json", ".ndjson"):
        return _side_from_table(p, *_read_csv(p), metric, align, columns)
    rows = read_jsonl(p)
    if rows and "kind" in rows[0]:  # relaytrain's own metrics.jsonl
        return _side_from_log(RunLog.from_records(rows, p), str(p), columns["metric"] or metric,
                              align)
    return _side_from_table(p, list(dict.fromkeys(k for r in rows for k in r)), rows, metric,
                            align, columns)


# ------------------------------------------------------------------------------ comparing


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average of `window` points (fewer at the start, where fewer exist).

    A convolution rather than a cumulative sum, so a NaN spoils only the windows holding it.
    """
    if window <= 1:
        return y
    sums = np.convolve(y, np.ones(window))[: y.size]
    return sums / np.minimum(np.arange(1, y.size + 1), window)


def overlap(a: Curve, b: Curve) -> tuple[float, float] | None:
    lo, hi = max(a.x[0], b.x[0]), min(a.x[-1], b.x[-1])
    return (float(lo), float(hi)) if lo <= hi else None


def default_landmarks(grid: np.ndarray, n: int = N_LANDMARKS) -> np.ndarray:
    """About `n` grid points spaced evenly in log x: early training changes fastest."""
    pos = grid[grid > 0]
    if not pos.size:
        return grid[:1]
    targets = np.log(np.geomspace(pos[0], pos[-1], n))
    nearest = np.abs(np.log(pos)[None, :] - targets[:, None]).argmin(axis=1)
    return pos[np.unique(nearest)]


def compare_curves(run: Curve, reference: Curve, *, metric: str, tolerance: float,
                   window: int = 1, landmarks: Sequence[float] | None = None,
                   x_name: str = "step") -> CurveComparison:
    """Compare two curves point by point over their overlap; explicit `landmarks` must lie
    inside it.

    Smoothing happens after alignment, on the common grid, so that "N points" spans the same
    x range on both sides even when they were logged at different intervals.
    """
    span = overlap(run, reference)
    if span is None:
        a, b = run.x, reference.x
        raise UserError(f"no overlap between the {metric} curves: the run covers {x_name} "
                        f"{_fmt_x(a[0], x_name)}..{_fmt_x(a[-1], x_name)}, the reference "
                        f"{_fmt_x(b[0], x_name)}..{_fmt_x(b[-1], x_name)}")
    lo, hi = span
    grid = np.union1d(*(c.x[(c.x >= lo) & (c.x <= hi)] for c in (run, reference)))
    ya = smooth(np.interp(grid, run.x, run.y), window)
    yb = smooth(np.interp(grid, reference.x, reference.y), window)
    # A few ulps of slack so that a difference of exactly the tolerance in decimal (3.21 vs
    # 3.20 at 0.01) is not pushed out of the band by binary rounding.
    slack = 4 * np.spacing(np.maximum(np.abs(ya), np.abs(yb)))
    out = np.flatnonzero(~(np.abs(ya - yb) <= tolerance + slack))
    first = Point(float(grid[out[0]]), float(ya[out[0]]), float(yb[out[0]])) if out.size else None
    if landmarks is None:
        marks = default_landmarks(grid)
    else:
        bad = [x for x in landmarks if not lo <= x <= hi]
        if bad:
            raise UserError(f"landmark {_fmt_x(bad[0], x_name)} is outside the overlap of the "
                            f"{metric} curves ({x_name} {_fmt_x(lo, x_name)}.."
                            f"{_fmt_x(hi, x_name)})")
        marks = np.asarray(landmarks, dtype=np.float64)
    points = [Point(float(x), float(np.interp(x, grid, ya)), float(np.interp(x, grid, yb)))
              for x in marks]
    return CurveComparison(metric, run.source, reference.source, tolerance, grid, ya, yb,
                           points, first)


def compare(run_dir: str | os.PathLike[str], reference: str | os.PathLike[str], *,
            metric: str = "loss", align: str = "step", tolerance: float = 0.01,
            window: int = 1, landmarks: Sequence[float] | None = None,
            ref_step_column: str | None = None, ref_tokens_column: str | None = None,
            ref_metric_column: str | None = None, ref_heldout_column: str | None = None
            ) -> Report:
    """Compare a run with a reference: `metric`, and the held-out loss when both have it."""
    if align not in ("step", "tokens"):
        raise UserError(f"--align {align!r}: expected step or tokens")
    if not tolerance >= 0:
        raise UserError(f"--tolerance {tolerance}: expected a number >= 0")
    if window < 1:
        raise UserError(f"--window {window}: expected a number of points >= 1")
    run = _side_from_log(read_metrics(run_dir), str(run_dir), metric, align)
    ref = load_reference(reference, metric, align, {
        "step": ref_step_column, "tokens": ref_tokens_column, "metric": ref_metric_column,
        "heldout": ref_heldout_column})
    curves = [compare_curves(run.metric, ref.metric, metric=metric, tolerance=tolerance,
                             window=window, landmarks=landmarks, x_name=align)]
    notes = []
    if metric != HELDOUT:
        if run.heldout is None or ref.heldout is None:
            missing = run if run.heldout is None else ref
            hint = "" if missing.is_run else "; name the column with --ref-heldout-column"
            notes.append(f"held-out loss not compared: {missing.label} has no held-out "
                         f"records{hint}")
        elif (span := overlap(run.heldout, ref.heldout)) is None:
            notes.append("held-out loss not compared: the two held-out curves do not overlap")
        else:
            # Held-out values are already means over the held-out set: not smoothed further.
            inside = None if landmarks is None else [
                x for x in landmarks if span[0] <= x <= span[1]]
            curves.append(compare_curves(run.heldout, ref.heldout, metric=HELDOUT,
                                         tolerance=tolerance, landmarks=inside, x_name=align))
    return Report(run, ref, align, window, tolerance, curves, notes)


# ------------------------------------------------------------------------------ reporting


def _fmt_x(x: float, x_name: str) -> str:
    if x_name == "tokens" and abs(x) >= 1e3:
        for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if abs(x) >= scale:
                return f"{x / scale:.4g}{unit}"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.6g}"


def format_report(report: Report) -> str:
    """The human-readable summary: per metric the differences, landmarks and first exit."""
    xn, tol = report.align, report.tolerance
    digits = 4 if tol >= 1e-3 else 8 if tol == 0 else min(10, 2 - math.floor(math.log10(tol)))
    smoothing = f", trailing mean of {report.window} points" if report.window > 1 else ""
    lines = [f"run:       {report.run.label}", f"reference: {report.reference.label}",
             f"aligned by {xn}{smoothing}, tolerance ±{tol:g}"]
    for c in report.curves:
        max_abs, max_at = c.max_abs_diff
        lines += [
            "",
            f"{c.metric} (run: {c.run_source}, reference: {c.reference_source}) over {xn} "
            f"{_fmt_x(c.x[0], xn)}..{_fmt_x(c.x[-1], xn)}, {c.x.size} points",
            f"  max |diff| {max_abs:.{digits}f} at {xn} {_fmt_x(max_at, xn)}, "
            f"mean |diff| {c.mean_abs_diff:.{digits}f}",
            f"  {xn:>10}  {'run':>{digits + 4}}  {'reference':>{digits + 4}}  "
            f"{'diff':>{digits + 4}}",
        ]
        lines += [f"  {_fmt_x(p.x, xn):>10}  {p.run:>{digits + 4}.{digits}f}  "
                  f"{p.reference:>{digits + 4}.{digits}f}  {p.diff:>+{digits + 4}.{digits}f}"
                  for p in c.landmarks]
        if c.first_out:
            p = c.first_out
            lines.append(f"  first out of band at {xn} {_fmt_x(p.x, xn)}: run "
                         f"{p.run:.{digits}f}, reference {p.reference:.{digits}f}, "
                         f"diff {p.diff:+.{digits + 2}f}")
        else:
            lines.append(f"  within ±{tol:g} at every point")
    lines += ([""] + report.notes) if report.notes else []
    if report.within:
        verdict = f"WITHIN ±{tol:g}: {', '.join(c.metric for c in report.curves)}"
    else:
        verdict = f"OUTSIDE ±{tol:g}: " + ", ".join(
            f"{c.metric} leaves the band at {xn} {_fmt_x(c.first_out.x, xn)}"
            for c in report.curves if c.first_out)
    return "\n".join([*lines, "", verdict])


def plot_report(report: Report, out: str | os.PathLike[str]) -> Path:
    """Both curves with the tolerance band around the reference, the difference below, and
    the sides' restarts and recoveries as vertical lines. Written atomically."""
    from matplotlib.figure import Figure  # Agg canvas, no pyplot state; only when plotting

    out = Path(out)
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: directory {out.parent} does not exist")
    n = len(report.curves)
    fig = Figure(figsize=(6.5 * n, 6.5), layout="constrained")
    axes = fig.subplots(2, n, sharex="col", squeeze=False, height_ratios=[2, 1])
    tol, xn = report.tolerance, report.align
    for col, c in enumerate(report.curves):
        top, bottom = axes[0, col], axes[1, col]
        top.fill_between(c.x, c.reference - tol, c.reference + tol, color="tab:orange",
                         alpha=0.25, lw=0, label=f"reference ±{tol:g}")
        top.plot(c.x, c.reference, color="tab:orange", lw=2.6,  # wide: visible under the run
                 label=f"reference ({c.reference_source})")
        top.plot(c.x, c.run, color="tab:blue", lw=1.0, label=f"run ({c.run_source})")
        top.set_ylabel(c.metric)
        top.set_title(f"{c.metric}: " + ("within" if c.within else "OUTSIDE") + f" ±{tol:g}")
        bottom.axhspan(-tol, tol, color="tab:orange", alpha=0.25, lw=0)
        bottom.axhline(0, color="0.4", lw=0.8)
        bottom.plot(c.x, c.diff, color="tab:blue", lw=1.0)
        if c.first_out:
            bottom.plot([c.first_out.x], [c.first_out.diff], "x", color="red", ms=8,
                        label=f"first out: {xn} {_fmt_x(c.first_out.x, xn)}")
            bottom.legend(loc="best", fontsize=8)
        bottom.set_ylabel("run − reference")
        bottom.set_xlabel(xn)
        for side, name, style in ((report.run, "run", "-"), (report.reference, "reference", ":")):
            labelled = set()
            for kind, x in side.events:
                if not c.x[0] <= x <= c.x[-1]:
                    continue
                label = None if kind in labelled else f"{name} {kind}"
                labelled.add(kind)
                for ax in (top, bottom):
                    ax.axvline(x, color="tab:red" if kind == "recovery" else "tab:green",
                               ls=style, lw=0.9, alpha=0.8, label=label if ax is top else None)
        top.legend(loc="best", fontsize=8)
    fig.suptitle(f"{report.run.label}  vs  {report.reference.label}", fontsize=10)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"--out {out}: cannot write ({e.strerror})") from None
    return out


def parse_landmarks(text: str) -> list[float]:
    """"1000,5e9,2B" -> floats; K/M/B/T suffixes for token counts."""
    scales = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
    values = []
    for item in text.split(","):
        item = item.strip()
        scale = scales.get(item[-1:].lower(), 1.0)
        try:
            values.append(float(item[:-1] if scale != 1.0 else item) * scale)
        except ValueError:
            raise UserError(f"--landmarks {text!r}: {item!r} is not a number; expected e.g. "
                            f"100,1000,1e4 or 1B,10B for tokens") from None
    return values

