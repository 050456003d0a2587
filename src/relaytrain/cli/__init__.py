"""The `relaytrain` command line (README.md "Command line").

One module per command or group of commands holds its arguments and its handlers; a handler
imports the library module it runs in its own body, so `relaytrain --help` stays fast and a
command only loads what it uses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from relaytrain.cli import bench, compare, convert, data, evaluate, parity, plot, train
from relaytrain.errors import UserError

COMMANDS = (data, train, evaluate, parity, convert, plot, bench, compare)  # in --help's order


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relaytrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides may come before or after flags: `train C.yaml --json a=1 b=2`.
    if getattr(args, "overrides", None) is not None and all("=" in x for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.handler(args) or 0)
    except UserError as e:
        print(f"relaytrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("relaytrain: interrupted", file=sys.stderr)
        return 130
