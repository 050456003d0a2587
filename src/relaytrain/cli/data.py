"""`relaytrain data prepare | index | audit`: token files in, a run's data use proven."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from relaytrain.errors import warn


def add_parser(sub: Any) -> None:
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
    prep.set_defaults(handler=run_prepare)
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
                       help="token id width (default: uint16 up to 65,536 ids, else uint32; "
                       "a file that reads as uint32 ids under the guess is refused)")
    index.add_argument("--out", required=True, metavar="DIR")
    index.add_argument("--workers", type=int, default=0, help="files scanned at once (0: cores)")
    index.add_argument("--json", action="store_true")
    index.set_defaults(handler=run_index)
    audit = dsub.add_parser("audit", help="prove exactly-once data use of a run")
    audit.add_argument("run_dir", metavar="RUN_DIR")
    audit.add_argument("--data", default=None, metavar="DIR",
                       help="the prepared data dir (default: the ledger header's data_path)")
    audit.add_argument("--max-overlap", type=float, default=None,
                       help="tolerated fraction of sampled held-out 32-grams found in training")
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(handler=run_audit)


def run_prepare(args: argparse.Namespace) -> int:
    """On this machine's cores or (--address) a Ray cluster's: the data layer knows nothing of
    Ray, so the two are joined here."""
    from relaytrain.data.prepare import ChunkMap, prepare, process_map

    mapper: ChunkMap = process_map
    if args.address is not None:
        from relaytrain.runtime.engines.ray_pool import ray_map

        mapper = ray_map(args.address)
    result = prepare(None if args.demo else args.source, args.out, args.tokenizer,
                     text_field=args.text_field, heldout_frac=args.heldout_frac,
                     max_docs=args.max_docs, eos_token=args.eos_token, workers=args.workers,
                     mapper=mapper, progress=True)
    if result.skipped_files:
        shown = ", ".join(result.skipped_files[:3])
        more = f" and {len(result.skipped_files) - 3} more" if len(result.skipped_files) > 3 else ""
        warn(f"skipped {len(result.skipped_files)} files that are not UTF-8 text: {shown}{more}")
    if result.documents["heldout"] == 0:
        warn("the held-out split is empty; held-out evaluation will fail (raise --heldout-frac)")
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    d, t = result.documents, result.tokens
    print(f"prepared {result.out}: train {d['train']:,} documents / {t['train']:,} tokens, "
          f"held-out {d['heldout']:,} documents / {t['heldout']:,} tokens "
          f"({result.dtype}, vocabulary {result.vocab_size:,})")
    print(f"dropped {result.duplicates:,} duplicate documents, skipped {result.skipped_empty:,} "
          f"empty documents and {len(result.skipped_files):,} unreadable files")
    trained = f", BPE training {result.tokenizer_seconds:.1f} s" if result.tokenizer_seconds else ""
    print(f"{result.seconds:.1f} s{trained}, {result.tokens_per_s:,.0f} tokens/s")
    return 0


def run_index(args: argparse.Namespace) -> int:
    from relaytrain.data.mix_index import index_mix, mix_files, read_plan, tokenizer_ids

    t0 = time.perf_counter()
    vocab, eos, pad = tokenizer_ids(args.tokenizer, args.eos_token, args.vocab_size, args.eos_id,
                                    args.pad_id)
    plan = read_plan(args.sources, args.base, args.requested_tokens, args.seq_len,
                     args.global_batch) if args.sources else None
    # Held-out files alone index an evaluation set (eval.sets).
    splits = {"train": mix_files(args.mix, args.files, args.base, args.tokenizer_id, "train")}
    if args.heldout_mix or args.heldout:
        splits["heldout"] = mix_files(args.heldout_mix, args.heldout, args.base,
                                      args.tokenizer_id, "heldout")
    index = index_mix(splits, args.out, vocab_size=vocab, eos_id=eos, pad_id=pad,
                      dtype=args.dtype, tokenizer_id=args.tokenizer_id, workers=args.workers,
                      mixture=plan)
    summary = {"out": str(args.out), "fingerprint": index["fingerprint"],
               "dtype": index["dtype"], "seconds": time.perf_counter() - t0,
               **{f"{n}_{k}": s[k] for n, s in index["splits"].items()
                  for k in ("tokens", "documents")}}
    summary.update({f"{n}_files": len(s["files"]) for n, s in index["splits"].items()})
    if args.json:
        print(json.dumps(summary))
    else:
        parts = ", ".join(f"{n} {len(s['files'])} files / {s['tokens']:,} tokens / "
                          f"{s['documents']:,} documents" for n, s in index["splits"].items())
        print(f"indexed {args.out}: {parts} ({index['dtype']}, fingerprint "
              f"{index['fingerprint'][:12]}) in {summary['seconds']:.1f} s")
    return 0


def run_audit(args: argparse.Namespace) -> int:
    """Exit 0 when every check passes, 1 naming the first that fails."""
    from relaytrain.data.audit import MAX_OVERLAP, audit

    max_overlap = MAX_OVERLAP if args.max_overlap is None else args.max_overlap
    report = audit(args.run_dir, data_path=args.data, max_overlap=max_overlap)
    first = report.first_failure
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        for c in report.checks:
            print(f"{'PASS' if c.ok else 'FAIL'}  {c.name:<18} {c.detail}")
        print(f"{report.steps} steps, {report.instances} instances, {report.epochs} epochs "
              f"({report.complete_epochs} complete), {report.rollbacks} rollbacks, "
              f"{report.resumes} resumes, {report.resizes} resizes"
              + ("; the ledger's torn last line was ignored" if report.torn_tail else ""))
    if first is not None:
        where = f"step {first.step}: " if first.step is not None else ""
        print(f"relaytrain: audit failed: {first.check}: {where}{first.message}",
              file=sys.stderr)
        return 1
    return 0
