"""`relaytrain convert hf-to-relay|relay-to-hf SRC DST` (DST: a new local directory)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    conv = sub.add_parser("convert", help="HF Olmo 3 <-> relaytrain checkpoint")
    conv.add_argument("direction", choices=["hf-to-relay", "relay-to-hf"])
    conv.add_argument("src", metavar="SRC")
    conv.add_argument("dst", metavar="DST")
    conv.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from relaytrain.model.hf import convert

    tensors = convert(args.direction, args.src, args.dst)
    n = sum(t.numel() for t in tensors.values())
    print(f"converted {args.direction}: {args.src} -> {Path(args.dst)} ({len(tensors)} tensors, "
          f"{n:,} parameters)")
    return 0
