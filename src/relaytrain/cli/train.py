"""`relaytrain train CONFIG.yaml [key=value ...]`: train (or resume) a run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    train = sub.add_parser("train", help="train (or resume) a run")
    train.add_argument("config", metavar="CONFIG.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value")
    train.add_argument("--json", action="store_true")
    train.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> int:
    """Exit 1 when the run stops itself (divergence, too many recoveries, its lease taken over),
    2 when another controller holds the run (runtime/lease.py), 3 when trained steps are left
    unsaved (the final checkpoint failed, checkpoint.max_unsaved_steps), 0 when it is done and
    its final state is committed; after SIGTERM/SIGINT, PREEMPTED (75) with its state saved (a
    second signal, or the grace running out, ends the process at once with 128 + the signal:
    runtime/preemption.py). docs/CONTRACTS.md "Exit codes"."""
    from relaytrain.config import load_config
    from relaytrain.runtime.catalogue import prove_writable
    from relaytrain.runtime.controller import Controller, WorkNotSaved
    from relaytrain.runtime.failures import RecoveryLimitExceeded
    from relaytrain.runtime.lease import RunLease, lease_places
    from relaytrain.runtime.preemption import PREEMPTED, Notice, Preempted
    from relaytrain.runtime.reporter import TrainingStopped

    cfg = load_config(args.config, args.overrides)
    if cfg.run_dir:  # before the lease is written there: an unwritable place is bad input
        prove_writable(cfg.run_dir, "run_dir")
        prove_writable(cfg.checkpoint_url, "checkpoint.url")
    places = lease_places(cfg.run_dir, cfg.checkpoint_url) if cfg.run_dir else []
    try:
        with Notice(cfg.checkpoint.preempt_grace) as notice, \
                RunLease(places, on_lost=lambda why: notice.stop_at_once(why, 1)):
            summary = Controller(cfg, quiet=args.json, notice=notice).run()
    except (TrainingStopped, RecoveryLimitExceeded) as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return 1
    except WorkNotSaved as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return WorkNotSaved.EXIT_CODE
    except Preempted as e:
        print(f"relaytrain: {e}", file=sys.stderr)
        return PREEMPTED
    if args.json:
        print(json.dumps(summary.to_dict()))
    else:
        print(f"done: {summary.steps} steps, final loss {summary.final_loss:.4f}, "
              f"held-out loss {summary.final_heldout_loss:.4f}")
        print(f"  metrics:     {summary.metrics}")
        print(f"  checkpoints: {summary.checkpoints} (step {summary.checkpoint_step})")
        print(f"  plot:        relaytrain plot {cfg.run_dir}")
    return 0
