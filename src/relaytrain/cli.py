"""The `relaytrain` command line (README.md "Command line").

Each subcommand's handler lives in the module that owns the concern and is imported lazily, so
`relaytrain --help` stays fast and a subcommand only loads what it uses.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from relaytrain.errors import UserError

# subcommand -> "module:function"; the function takes the parsed args and returns an exit code.
HANDLERS = {
    "data.prepare": "relaytrain.cli:cli_prepare",
    "data.index": "relaytrain.data.mix_index:cli_index",
    "data.audit": "relaytrain.data.audit:cli_audit",
    "train": "relaytrain.runtime.controller:cli_train",
    "eval": "relaytrain.train.evaluate:cli_eval",
    "parity.hf": "relaytrain.parity.hf:cli_parity_hf",
    "convert": "relaytrain.model.hf:cli_convert",
    "plot": "relaytrain.train.plot:cli_plot",
    "bench": "relaytrain.bench:cli_bench",
    "compare": "relaytrain.compare:cli_compare",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relaytrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_data, _add_train, _add_eval, _add_parity, _add_convert, _add_plot,
                _add_bench, _add_compare):
        add(sub)
    return p


def _add_data(sub: Any) -> None:
    data = sub.add_parser("data", help="prepare or index token files; audit a run's data use")
    dsub = data.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="tokenize text into token files and a JSON index")
    src = prep.add_mutually_exclusive_group(required=True)
    src.add_argument("--source", nargs="+", metavar="PATH|URL",
                     help="text, JSONL or Parquet files (paths, globs or fsspec URLs)")
    src.add_argument("--demo", action="store_true",
                     help="the running Python's standard-library source (offline)")
    prep.add_argument("--tokenizer", required=True, metavar="FILE|DIR|bpe:VOCAB",
                      help="a HF tokenizer.json or directory, or bpe:VOCAB to train one")
    prep.add_argument("--out", required=True, metavar="DIR")
    prep.add_argument("--text-field", default="text", help="JSONL/Parquet text field")
    prep.add_argument("--heldout-frac", type=float, default=0.05)
    prep.add_argument("--workers", type=int, default=0,
                      help="encoding processes (0: one per core); the output does not depend "
                           "on it")
    prep.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                      help="encode on the nodes of this Ray cluster ('auto': the one this node "
                           "is in); --workers 0 then means one per CPU of the cluster")
    prep.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    prep.add_argument("--eos-token", default=None,
                      help="the tokenizer's end-of-text token (default: a common name)")
    prep.add_argument("--json", action="store_true")
    prep.set_defaults(handler="data.prepare")
    index = dsub.add_parser("index", help="index OLMo-core token arrays in place (no copy)")
    mix = index.add_mutually_exclusive_group()  # none: an evaluation set (--heldout alone)
    mix.add_argument("--mix", metavar="MANIFEST", help="OLMo-core mix: 'label,path' lines, "
                     "paths relative to --base with {TOKENIZER} for --tokenizer-id")
    mix.add_argument("--files", nargs="+", metavar="PATH|URL", help="token files, in order")
    mix.add_argument("--sources", metavar="MIX.yaml", help="a weighted mixture: 'sources:' of "
                     "OLMo-core's source_name, target_ratio, paths, max_repetition_ratio, "
                     "max_source_fraction; needs --requested-tokens, --seq-len, --global-batch")
    index.add_argument("--requested-tokens", type=int, default=None, help="with --sources")
    index.add_argument("--seq-len", type=int, default=None, help="with --sources")
    index.add_argument("--global-batch", type=int, default=None,
                       help="with --sources: instances per global batch")
    held = index.add_mutually_exclusive_group()
    held.add_argument("--heldout-mix", metavar="MANIFEST", help="held-out files, as --mix")
    held.add_argument("--heldout", nargs="+", metavar="PATH|URL", help="held-out token files")
    index.add_argument("--base", default="", metavar="DIR|URL", help="where the mix's paths are")
    index.add_argument("--tokenizer-id", default="", help="what {TOKENIZER} stands for")
    index.add_argument("--tokenizer", default=None, metavar="FILE|DIR",
                       help="the HF tokenizer.json the data was tokenized with")
    index.add_argument("--eos-token", default=None, help="the tokenizer's EOS token name")
    index.add_argument("--vocab-size", type=int, default=None, help="without --tokenizer")
    index.add_argument("--eos-id", type=int, default=None, help="without --tokenizer")
    index.add_argument("--pad-id", type=int, default=None, help="without --tokenizer")
    index.add_argument("--dtype", choices=["uint16", "uint32"], default=None,
                       help="token id width (default: uint16 up to 65,536 ids, else uint32)")
    index.add_argument("--out", required=True, metavar="DIR")
    index.add_argument("--workers", type=int, default=0, help="files scanned at once (0: cores)")
    index.add_argument("--json", action="store_true")
    index.set_defaults(handler="data.index")
    audit = dsub.add_parser("audit", help="prove exactly-once data use of a run")
    audit.add_argument("run_dir", metavar="RUN_DIR")
    audit.add_argument("--data", default=None, metavar="DIR",
                       help="the prepared data dir (default: the ledger header's data_path)")
    audit.add_argument("--max-overlap", type=float, default=None,
                       help="tolerated fraction of sampled held-out 32-grams found in training")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(handler="data.audit")


def _add_train(sub: Any) -> None:
    train = sub.add_parser("train", help="train (or resume) a run")
    train.add_argument("config", metavar="CONFIG.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value")
    train.add_argument("--json", action="store_true")
    train.set_defaults(handler="train")


def _add_eval(sub: Any) -> None:
    ev = sub.add_parser("eval", help="evaluate a checkpoint on the held-out split")
    ev.add_argument("target", metavar="RUN_DIR|CHECKPOINT")
    ev.add_argument("--data", default=None, help="prepared data dir (default: the run's)")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(handler="eval")


def _add_parity(sub: Any) -> None:
    par = sub.add_parser("parity", help="numerical parity with reference implementations")
    psub = par.add_subparsers(dest="parity_command", required=True)
    phf = psub.add_parser("hf", help="against HF transformers' Olmo3ForCausalLM")
    phf.add_argument("--model", default="tiny", help="preset name (default: tiny)")
    phf.add_argument("--steps", type=int, default=20)
    phf.add_argument("--seq-len", type=int, default=None)
    phf.add_argument("--matmul", choices=["aten", "onednn", "auto"], default="aten",
                     help="our model's GEMMs (model.matmul): aten, HF's own, compares bit for "
                          "bit; onednn is what CPU training runs where it measures faster "
                          "(default: aten)")
    phf.add_argument("--kernels", choices=["torch", "fused", "auto"], default="torch",
                     help="our model's RMSNorm, SwiGLU, RoPE and softmax (model.kernels): "
                          "torch, HF's ops; fused, what CPU training runs by default "
                          "(default: torch)")
    phf.add_argument("--json", action="store_true")
    phf.set_defaults(handler="parity.hf")


def _add_convert(sub: Any) -> None:
    conv = sub.add_parser("convert", help="HF Olmo 3 <-> relaytrain checkpoint")
    conv.add_argument("direction", choices=["hf-to-relay", "relay-to-hf"])
    conv.add_argument("src", metavar="SRC")
    conv.add_argument("dst", metavar="DST")
    conv.set_defaults(handler="convert")


def _add_plot(sub: Any) -> None:
    plot = sub.add_parser("plot", help="plot a run's curves to a PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("--out", default=None, metavar="FILE.png")
    plot.set_defaults(handler="plot")


def _add_bench(sub: Any) -> None:
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
    bench.set_defaults(handler="bench")


def _add_compare(sub: Any) -> None:
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
    cmp_.set_defaults(handler="compare")


def cli_prepare(args: argparse.Namespace) -> int:
    """`data prepare`, on this machine's cores or (--address) a Ray cluster's: the data layer
    knows nothing of Ray, so the two are joined here."""
    from relaytrain.data.prepare import cli_prepare as prepare

    if args.address is None:
        return prepare(args)
    from relaytrain.runtime.engines.ray_pool import ray_map

    return prepare(args, ray_map(args.address))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides may come before or after flags: `train C.yaml --json a=1 b=2`.
    if getattr(args, "overrides", None) is not None and all("=" in x for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    module, func = HANDLERS[args.handler].split(":")
    try:
        handler = getattr(importlib.import_module(module), func)
        return int(handler(args) or 0)
    except UserError as e:
        print(f"relaytrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("relaytrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
