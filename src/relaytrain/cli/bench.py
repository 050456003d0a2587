"""`relaytrain bench NAME`: run one benchmark of `relaytrain.bench` and print its report."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from relaytrain.errors import UserError

# A benchmark run from the parsed arguments: its result, and how to print it (None: as JSON).
Run = Callable[[argparse.Namespace], tuple[Any, Callable[[Any], str] | None]]


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print ratios against a baseline")
    bench.add_argument("name", metavar="NAME")
    bench.add_argument("overrides", nargs="*", metavar="key=value",
                       help="recovery: settings instead of the run's defaults")
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--quick", action="store_true", help="a shorter run")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--out", default=None, metavar="DIR",
                       help="gpu: where gpu.json goes (default runs/bench-gpu)")
    bench.add_argument("--only", default=None, metavar="SECTION,…",
                       help="gpu: run only these sections; checkpoint: these model presets' "
                       "states (default small; comma-separated)")
    bench.add_argument("--url", action="append", default=[], metavar="URL",
                       help="checkpoint: also measure the object store at URL, e.g. "
                       "s3://bucket/prefix (repeatable; endpoints from the environment)")
    bench.set_defaults(handler=run_bench)


def _train_throughput(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.train_throughput import bench_train_throughput, format_report

    return bench_train_throughput(quick=args.quick, device=args.device), format_report


def _dp_scaling(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.dp_scaling import bench_dp_scaling, format_report

    return bench_dp_scaling(quick=args.quick), format_report


def _memory(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.memory import bench_memory, format_report

    return bench_memory(quick=args.quick), format_report


def _recovery(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.recovery import bench_recovery, format_report

    return bench_recovery(quick=args.quick, overrides=args.overrides), format_report


def _pipeline(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.pipeline import bench_pipeline

    return bench_pipeline(quick=args.quick), None


def _checkpoint(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.checkpoint import bench_checkpoint, format_report

    presets = args.only.split(",") if args.only else None
    return bench_checkpoint(quick=args.quick, urls=args.url, presets=presets), format_report


def _prepare(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.prepare import bench_prepare, format_report

    return bench_prepare(quick=args.quick), format_report


def _loader(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.loader_vs_training import bench_loader_vs_training, format_report

    return bench_loader_vs_training(quick=args.quick), format_report


def _long_context(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.long_context import bench_long_context, format_report

    return bench_long_context(quick=args.quick), format_report


def _control_plane(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.control_plane import bench_control_plane, format_report

    return bench_control_plane(quick=args.quick), format_report


def _gpu(args: argparse.Namespace) -> tuple[Any, Callable[[Any], str] | None]:
    from relaytrain.bench.gpu import bench_gpu, format_report

    only = args.only.split(",") if args.only else None
    return bench_gpu(quick=args.quick, device=args.device, out=args.out, only=only), format_report


BENCHES: dict[str, Run] = {
    "train-throughput": _train_throughput,
    "dp-scaling": _dp_scaling,
    "memory": _memory,
    "recovery": _recovery,
    "pipeline": _pipeline,
    "checkpoint": _checkpoint,
    "prepare": _prepare,
    "loader": _loader,
    "gpu": _gpu,
    "long-context": _long_context,
    "control-plane": _control_plane,
}


def run_bench(args: argparse.Namespace) -> int:
    if args.name not in BENCHES:
        raise UserError(f"unknown benchmark {args.name!r}; available: {', '.join(BENCHES)}")
    if args.overrides and args.name != "recovery":
        raise UserError(f"bench {args.name} takes no key=value settings (got "
                        f"{' '.join(args.overrides)}); only bench recovery does")
    if args.url and args.name != "checkpoint":
        raise UserError(f"bench {args.name}: --url is an option of bench checkpoint only")
    result, report = BENCHES[args.name](args)
    if args.json:
        print(json.dumps(result, default=str))
    elif report is not None:
        print(report(result))
    else:
        print(json.dumps(result, indent=2, default=str))
    return 0
