"""`relaytrain bench NAME`: benchmarks that measure against a baseline run side by side in the
same process or run, and print ratios (never thresholds in unit tests)."""

from __future__ import annotations

import importlib
import json
from typing import Any

from relaytrain.errors import UserError

# name -> (module, function); the module may define a formatter, format_report(result) -> str.
BENCHES = {
    "train-throughput": ("relaytrain.bench.train_throughput", "bench_train_throughput"),
    "dp-scaling": ("relaytrain.bench.dp_scaling", "bench_dp_scaling"),
    "memory": ("relaytrain.bench.memory", "bench_memory"),
    "recovery": ("relaytrain.bench.recovery", "bench_recovery"),
    "pipeline": ("relaytrain.bench.pipeline", "bench_pipeline"),
    "checkpoint": ("relaytrain.bench.checkpoint", "bench_checkpoint"),
    "prepare": ("relaytrain.bench.prepare", "bench_prepare"),
    "loader": ("relaytrain.bench.loader_vs_training", "bench_loader_vs_training"),
    "gpu": ("relaytrain.bench.gpu", "bench_gpu"),
}

def cli_bench(args: Any) -> int:
    if args.name not in BENCHES:
        raise UserError(f"unknown benchmark {args.name!r}; available: {', '.join(BENCHES)}")
    module_name, func = BENCHES[args.name]
    module = importlib.import_module(module_name)
    kwargs: dict[str, Any] = {"quick": args.quick}
    if args.name in ("train-throughput", "gpu"):
        kwargs["device"] = args.device
    if args.name == "recovery":
        kwargs["overrides"] = args.overrides
    elif args.overrides:
        raise UserError(f"bench {args.name} takes no key=value settings (got "
                        f"{' '.join(args.overrides)}); only bench recovery does")
    if args.name == "gpu":
        kwargs["out"] = args.out
        kwargs["only"] = args.only.split(",") if args.only else None
    if args.name == "checkpoint":
        kwargs["urls"] = getattr(args, "url", [])
        kwargs["presets"] = args.only.split(",") if args.only else None
    elif getattr(args, "url", None):
        raise UserError(f"bench {args.name}: --url is an option of bench checkpoint only")
    result = getattr(module, func)(**kwargs)
    if args.json:
        print(json.dumps(result, default=str))
    elif hasattr(module, "format_report"):
        print(module.format_report(result))
    else:
        print(json.dumps(result, indent=2, default=str))
    return 0
