"""`relaytrain eval RUN_DIR|CHECKPOINT`: a checkpoint's held-out loss, as the run measured it."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    ev = sub.add_parser("eval", help="evaluate a checkpoint on the held-out split")
    ev.add_argument("target", metavar="RUN_DIR|CHECKPOINT")
    ev.add_argument("--data", default=None, help="prepared data dir (default: the run's)")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from relaytrain.data.eval_sets import OWN_EVAL_SET
    from relaytrain.train.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(args.target, args.data)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, r in result["sets"].items():
        what = "held-out" if name == OWN_EVAL_SET else f"eval set '{name}'"
        print(f"step {result['checkpoint_step']}: {what} loss {r['loss']:.4f}, perplexity "
              f"{r['ppl']:.2f} ({r['instances']} instances of {result['seq_len']} tokens)")
    return 0
