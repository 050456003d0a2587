"""`relaytrain compare RUN_DIR REFERENCE`: hold a run's curves against a reference run."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    cmp_ = sub.add_parser("compare", help="hold a run's curve against a reference",
                          description="Compare a run's curve with a reference run point by "
                          "point; exit 0 within the tolerance, 1 outside, 2 on bad input.")
    cmp_.add_argument("run_dir", metavar="RUN_DIR")
    cmp_.add_argument("reference", metavar="REFERENCE",
                      help="a run directory or a CSV/JSONL export of a logged run")
    cmp_.add_argument("--metric", default="loss",
                      help="step- or eval-record key (default: loss); the held-out loss is "
                      "also compared when both sides have it")
    cmp_.add_argument("--align", choices=["step", "tokens"], default="step")
    cmp_.add_argument("--tolerance", type=float, default=0.01, help="max |run - reference|")
    cmp_.add_argument("--window", type=int, default=1,
                      help="smooth both curves, once aligned, with a trailing mean of N points")
    cmp_.add_argument("--landmarks", default=None,
                      help="comma-separated steps/tokens, e.g. 100,1000 or 1B,10B "
                      "(default: ~8 log-spaced over the overlap)")
    cmp_.add_argument("--ref-step-column", default=None, help="reference export column")
    cmp_.add_argument("--ref-tokens-column", default=None, help="reference export column")
    cmp_.add_argument("--ref-metric-column", default=None, help="reference column or key")
    cmp_.add_argument("--ref-heldout-column", default=None, help="reference export column")
    cmp_.add_argument("--out", default=None, metavar="FILE.png",
                      help="also draw both curves and their difference")
    cmp_.add_argument("--json", action="store_true")
    cmp_.set_defaults(handler=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    """Exit 0 when every compared curve stays within the tolerance, 1 when one leaves it."""
    from relaytrain.compare import compare, format_report, parse_landmarks, plot_report

    report = compare(
        args.run_dir, args.reference, metric=args.metric, align=args.align,
        tolerance=args.tolerance, window=args.window,
        landmarks=parse_landmarks(args.landmarks) if args.landmarks else None,
        ref_step_column=args.ref_step_column, ref_tokens_column=args.ref_tokens_column,
        ref_metric_column=args.ref_metric_column, ref_heldout_column=args.ref_heldout_column)
    if args.out:
        plot_report(report, args.out)
    if args.json:
        print(json.dumps({**report.to_json(), "plot": args.out}))
    else:
        print(format_report(report) + (f"\nplot: {args.out}" if args.out else ""))
    return 0 if report.within else 1
