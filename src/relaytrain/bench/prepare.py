"""`relaytrain bench prepare`: `data prepare` throughput at 1 and 2 worker processes side by
side on the demo corpus, with each run's peak memory, and whether their bytes are identical.

Each prepare runs as its own `relaytrain data prepare` process, so its peak resident memory
(`wait4`: the largest of the process and its workers) is its own. Runs on the first quarter and
half of the corpus show whether memory grows with the corpus; each states its largest document,
which is what the chunks in flight (and so the memory) follow. The BPE is trained once, first,
on a slice: the benchmark times tokenizing and writing, not tokenizer training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from relaytrain.bench import progress
from relaytrain.data.prepare import prepare

VOCAB = 4096
BPE_DOCS = 300


def _run(tokenizer: Path, out: Path, workers: int, max_docs: int | None) -> dict[str, Any]:
    """One `data prepare --demo` process: its --json summary and its peak RSS in MiB."""
    cmd = [sys.executable, "-m", "relaytrain.cli", "data", "prepare", "--demo", "--tokenizer",
           str(tokenizer), "--out", str(out), "--workers", str(workers), "--json"]
    if max_docs:
        cmd += ["--max-docs", str(max_docs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux reports KiB
    result["largest_doc_tokens"] = max(int(np.load(out / f"{s}.docs.npy")[:, 1].max(initial=0))
                                       for s in ("train", "heldout"))
    return result


def _same_bytes(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names if n != "index.json")


def bench_prepare(quick: bool = False) -> dict[str, Any]:
    max_docs = 400 if quick else None
    progress.start("prepare", f"the demo corpus ({max_docs or 'all'} documents) prepared once "
                   "at 1 and once at 2 workers, then its first quarter and half at 2")
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp:
        root = Path(tmp)
        progress.report("training the tokenizer")
        prepare(None, root / "bpe", f"bpe:{VOCAB}", max_docs=BPE_DOCS)
        tokenizer = root / "bpe" / "tokenizer.json"
        runs = {}
        for w in (1, 2):
            progress.report(f"{w} worker(s)")
            runs[w] = _run(tokenizer, root / f"w{w}", w, max_docs)
        docs = sum(runs[2]["documents"].values()) + runs[2]["duplicates"]
        parts = {}
        for name, frac in (("quarter", 4), ("half", 2)):
            progress.report(f"the first {name} of the corpus")
            parts[name] = _run(tokenizer, root / name, 2, max(1, docs // frac))
        identical = _same_bytes(root / "w1", root / "w2")
    one, two = runs[1], runs[2]
    return {"documents": sum(one["documents"].values()), "tokens": sum(one["tokens"].values()),
            "vocab": one["vocab_size"], "cores": os.cpu_count(),
            "tokens_per_s_1": one["tokens_per_s"], "tokens_per_s_2": two["tokens_per_s"],
            "speedup_2": two["tokens_per_s"] / one["tokens_per_s"],
            "peak_rss_mib_1": one["peak_rss_mib"], "peak_rss_mib_2": two["peak_rss_mib"],
            "largest_doc_tokens": two["largest_doc_tokens"],
            "parts": {name: {"tokens": sum(r["tokens"].values()), "peak_rss_mib":
                             r["peak_rss_mib"], "largest_doc_tokens": r["largest_doc_tokens"]}
                      for name, r in parts.items()},
            "identical_bytes": identical}


def format_report(r: dict[str, Any]) -> str:
    return "\n".join([
        f"data prepare, demo corpus: {r['documents']:,} documents, {r['tokens']:,} tokens "
        f"(BPE {r['vocab']:,}), {r['cores']} cores",
        f"{'workers':>8} {'tokens/s':>12} {'peak RSS':>10}",
        f"{1:>8} {r['tokens_per_s_1']:>12,.0f} {r['peak_rss_mib_1']:>7.0f} MiB",
        f"{2:>8} {r['tokens_per_s_2']:>12,.0f} {r['peak_rss_mib_2']:>7.0f} MiB",
        f"2 workers: {r['speedup_2']:.2f}x the tokens/s of 1 (target >= 1.7x on 2 cores); "
        f"bytes identical: {r['identical_bytes']}",
        "memory at 2 workers against corpus size (it follows the largest document):",
        *(f"{name:>8} {p['tokens']:>12,} tokens {p['peak_rss_mib']:>7.0f} MiB, largest document "
          f"{p['largest_doc_tokens']:,} tokens" for name, p in
          [*r["parts"].items(), ("whole", {"tokens": r["tokens"],
                                           "peak_rss_mib": r["peak_rss_mib_2"],
                                           "largest_doc_tokens": r["largest_doc_tokens"]})]),
    ])
