"""`relaytrain plot RUN_DIR`: one PNG with the curves a person checks first."""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_parser(sub: Any) -> None:
    plot = sub.add_parser("plot", help="plot a run's curves to a PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("--out", default=None, metavar="FILE.png")
    plot.set_defaults(handler=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    """Prints the PNG's path (default RUN_DIR/loss.png)."""
    from relaytrain.runlog import read_metrics
    from relaytrain.train.plot import plot_run

    log = read_metrics(args.run_dir)
    out = args.out or os.path.join(args.run_dir, "loss.png")
    plot_run(log, out, title=os.path.basename(os.path.normpath(args.run_dir)))
    print(out)
    return 0
