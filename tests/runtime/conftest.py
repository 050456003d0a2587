"""Fixtures for training runs: a small prepared corpus and config helpers."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from relaytrain.cli import main
from relaytrain.config import load_config
from relaytrain.config.sections import RunConfig
from relaytrain.runtime.controller import Controller
from relaytrain.runtime.summary import RunSummary

WORDS = ("alpha beta gamma delta train model token layer norm rope window cache stage "
         "batch epoch seed ledger audit shard replica").split()


def make_corpus(root: Path, seed: int = 0) -> str:
    """Prepare ~40k tokens of word salad with a little structure under `root`; its path.
    Another `seed` gives other text (another run's data)."""
    src = root / "corpus"
    src.mkdir()
    for i in range(80):
        r = random.Random(seed * 1000 + i)
        lines = [" ".join(r.choice(WORDS[: 8 + i % 12]) for _ in range(12)) for _ in range(40)]
        (src / f"doc{i:03d}.txt").write_text("\n".join(lines) + "\n")
    out = root / "prepared"
    assert main(["data", "prepare", "--source", str(src / "*.txt"), "--tokenizer", "bpe:320",
                 "--out", str(out), "--heldout-frac", "0.1"]) == 0
    return str(out)


@pytest.fixture(scope="session")
def corpus_data(tmp_path_factory) -> str:
    """The prepared corpus every training test shares."""
    return make_corpus(tmp_path_factory.mktemp("data"))


def index_token_mix(root: Path, sizes: list[int], docs_per: int, vocab: int, eos: int,
                    pad: int | None = None) -> str:
    """Token files of `sizes` tokens (random ids, an EOS about every `docs_per`; the last file
    held out) indexed in `root`: a small multi-source mix for OLMo-core's loaders."""
    for i, n in enumerate(sizes):
        rng = np.random.default_rng(i)
        toks = rng.integers(0, eos, size=n)
        toks[rng.choice(n, size=n // docs_per, replace=False)] = eos
        toks[-1] = eos
        toks.astype("<u2").tofile(root / f"part-{i}.npy")
    out, parts = root / "index", [str(root / f"part-{i}.npy") for i in range(len(sizes))]
    assert main(["data", "index", "--files", *parts[:-1], "--heldout", parts[-1],
                 "--vocab-size", str(vocab), "--eos-id", str(eos), "--out", str(out),
                 *(["--pad-id", str(pad)] if pad is not None else [])]) == 0
    return str(out)


@pytest.fixture(scope="session")
def packed_mix(tmp_path_factory) -> str:
    """Four token files of documents from 1 to ~100 tokens (seq_len 32, window 16), indexed
    with a PAD id: what packed instances are packed from."""
    return index_token_mix(tmp_path_factory.mktemp("packed-mix"), [3000, 1701, 2500, 900, 900],
                           25, vocab=320, eos=318, pad=319)


def tiny_config(run_dir: Path | str, data: str, *overrides: str) -> RunConfig:
    """The tiny preset with small batches, quiet, checkpointing every few steps. A run with no
    fault injected never takes the standby (`elastic.standby`, a CPU run's default): it starts
    none unless the test names the key, each start a process's seconds of CPU on the 2 cores
    the suite shares."""
    quiet = [] if any(o.startswith(("faults.", "elastic.standby=")) for o in overrides) else [
        "elastic.standby=false"]
    return load_config("configs/tiny.yaml", [f"run_dir={run_dir}", f"data.path={data}",
                                             "log.progress=false", *quiet, *overrides])


# 12 micro-batches per global batch split evenly over 1, 2, 3 and 4 workers.
DP = ("train.global_batch=12", "train.micro_batch=1", "eval.every=3", "checkpoint.every=3")


def run_layout(run_dir: Path | str, data: str, dp: int, *extra: str, fsdp: int = 1,
               pp: int = 1) -> RunSummary:
    """A run of `dp` replicas each sharded over `fsdp` workers (per stage of `pp`), in this
    process when that is one worker; its summary."""
    workers = dp * fsdp * pp
    engine = "runtime.engine=inline" if workers == 1 else "runtime.engine=ray"
    summary = Controller(tiny_config(run_dir, data, engine, f"parallel.dp={dp}",
                                     f"parallel.fsdp={fsdp}", f"parallel.pp={pp}",
                                     *extra)).run()
    # It really ran on that many workers: that many processes (Ray actors, not this one)
    # reported themselves, and its last step's ledger record holds a shard of data for each.
    pids = {w["pid"] for w in generations(run_dir)[-1]["workers"].values()}
    assert len(pids) == workers and (pids == {os.getpid()}) == (workers == 1), pids
    ledger = [json.loads(x) for x in (Path(run_dir) / "ledger.jsonl").read_text().splitlines()]
    assert len([r for r in ledger if r["kind"] == "step"][-1]["parts"]) == dp * fsdp
    return summary


@pytest.fixture(scope="module")
def exact_reference(tmp_path_factory, corpus_data):
    """The single-worker exact-mode run every other layout must reproduce to the bit."""
    run = tmp_path_factory.mktemp("reference") / "dp1"
    run_layout(run, corpus_data, 1, *DP, "determinism=exact", "train.max_steps=6")
    return run


def step_records(run_dir: Path | str) -> dict[int, dict]:
    """The last record of every step (a step redone after a restore overrides the old one)."""
    out: dict[int, dict] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "step":
            out[rec["step"]] = rec
    return out


@pytest.fixture(scope="module")
def ray_cluster(ray_session_end):
    """A private Ray cluster, 4 CPUs (one per worker), token-authenticated and on loopback, as
    the engine would start it. The Ray engine uses an initialised Ray as it finds it, so runs
    skip the cluster start-up; one cluster serves every module of the session (started again
    if a test that needs another Ray shut it down)."""
    from relaytrain.runtime.engines.ray import _import_ray

    _import_ray(private_cluster=True)
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False,
                 _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    return ray


def final_state(run_dir: Path | str):
    """The tensors of the run's newest checkpoint."""
    from relaytrain.checkpoint.store import open_checkpoint

    return open_checkpoint(str(run_dir))[1]


def same_tensors(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def records(run_dir: Path | str, kind: str) -> list[dict]:
    """The run's metrics records of one kind, in the order they were written."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def resolved(gens: list[dict]) -> list[dict]:
    """Generation records (in the order written), each's `workers` completed with the ranks
    it kept from generation `same_as` (a survivor kept in its rank is not re-written)."""
    by_gen: dict[int, dict] = {}
    for g in gens:
        kept = by_gen[g["same_as"]]["workers"] if g.get("same_as") is not None else {}
        by_gen[g["generation"]] = {**g, "workers": {**kept, **g["workers"]}}
    return [by_gen[g["generation"]] for g in gens]


def generations(run_dir: Path | str) -> list[dict]:
    """The run's generation records, every rank's process in each (`resolved`)."""
    return resolved(records(run_dir, "generation"))


def os_start_time(pid: int) -> int | None:
    """Process `pid`'s start time as the OS gives it (field 22 of /proc/PID/stat); None if
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


@contextmanager
def watch_processes(run_dir: Path | str) -> Iterator[dict[tuple[int, str], tuple[int, int | None]]]:
    """While the run in the block is alive: for each rank of each generation record as it is
    written, (the start time the worker reported, the start time the OS gives its PID then)."""
    seen: dict[tuple[int, str], tuple[int, int | None]] = {}
    done = threading.Event()
    path = Path(run_dir) / "metrics.jsonl"

    def poll() -> None:
        offset, gens = 0, []
        while not done.wait(0.02):
            if not path.exists():
                continue
            with open(path) as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            for rec in map(json.loads, complete.splitlines()):
                if rec["kind"] == "generation":
                    gens.append(rec)
                    for rank, w in resolved(gens)[-1]["workers"].items():
                        seen[rec["generation"], rank] = (w["start"], os_start_time(w["pid"]))

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()


def assert_reported_as_the_os_sees_them(seen: dict[tuple[int, str], tuple[int, int | None]],
                                        generations: int) -> None:
    """What `watch_processes` saw: every generation had a rank found alive, and every rank
    found alive is the process its worker said it was (the OS gives its PID that start time)."""
    alive = {k: v for k, v in seen.items() if v[1] is not None}
    assert {g for g, _ in alive} == set(range(generations)), seen
    assert all(reported == os_start for reported, os_start in alive.values()), seen


def assert_only_failed_ranks_replaced(run_dir: Path | str) -> list[dict]:
    """Per recovery (generation g -> g + 1, in order): the failed rank is a new process and
    every other rank the very same one (its PID and the OS's start time of it, as each worker
    process reported itself). Returns the generation records."""
    gens, recoveries = generations(run_dir), records(run_dir, "recovery")
    assert [g["generation"] for g in gens] == list(range(len(recoveries) + 1)), gens
    for before, after, rec in zip(gens[:-1], gens[1:], recoveries, strict=True):
        assert after["workers"].keys() == before["workers"].keys()
        changed = {r for r, w in before["workers"].items() if after["workers"][r] != w}
        assert changed == {str(rec["rank"])}, (rec, before, after)
    return gens


def assert_survivors_kept_their_processes(run_dir: Path | str) -> list[dict]:
    """Per generation after the first: a growth (`resize`) kept every member's process and
    added new ones; a recovery's is formed by the survivors, each the very same process (its
    PID and the OS's start time of it, as each worker process reported itself), plus one
    process per failed worker it replaced (`replaced`): on fewer workers if it went on without
    some (`continued_on`). Returns the recovery records."""
    recoveries, gens = records(run_dir, "recovery"), generations(run_dir)
    resizes = {r["step"] for r in records(run_dir, "resize")}
    assert len(gens) == 1 + len(recoveries) + len(resizes), gens
    procs = [{(w["pid"], w["start"]) for w in g["workers"].values()} for g in gens]
    formed_by = iter(recoveries)
    for g, before, after in zip(gens[1:], procs[:-1], procs[1:], strict=True):
        if g["step"] in resizes and before < after:
            continue
        rec = next(formed_by)
        assert len(after - before) == rec["replaced"] and len(after) == rec["continued_on"], \
            (rec, before, after)
    return recoveries


def assert_went_on_at_once(run_dir: Path | str, workers: int) -> list[dict]:
    """No recovery of the run waited for a process to start (its record says so), the
    survivors kept their processes (`assert_survivors_kept_their_processes`), the steps after
    a recovery that went on with fewer workers ran at its size (the ledger's header and step
    records), and the run ended at `workers`. The recovery records."""
    recoveries = assert_survivors_kept_their_processes(run_dir)
    assert recoveries and len(generations(run_dir)[-1]["workers"]) == workers
    for rec in recoveries:
        assert rec["waited_for_replacement"] is None, rec
        assert rec["phases"]["wait_replacement"] == 0.0, rec
    ledger = [json.loads(x) for x in (Path(run_dir) / "ledger.jsonl").read_text().splitlines()]
    after_header = {(ledger[i]["dp"], ledger[i + 1]["step"], ledger[i + 1]["dp"])
                    for i in range(1, len(ledger) - 1)
                    if ledger[i]["kind"] == "header" and ledger[i + 1]["kind"] == "step"}
    for rec in recoveries:
        if rec["replaced"] == 0:
            assert (rec["dp"], rec["restored_step"] + 1, rec["dp"]) in after_header, \
                (rec, after_header)
    return recoveries


def assert_bit_identical(run: Path | str, reference: Path | str,
                         steps: range | None = None) -> None:
    """`run` recorded the same steps (`steps`, if given), losses, gradient norms and final
    weights as `reference`, to the bit, and passes the data audit."""
    a, b = step_records(reference), step_records(run)
    assert sorted(b) == sorted(a), (sorted(a), sorted(b))
    if steps is not None:
        assert sorted(a) == list(steps)
    assert [b[s]["loss"] for s in a] == [a[s]["loss"] for s in a]
    assert [b[s]["grad_norm"] for s in a] == [a[s]["grad_norm"] for s in a]
    assert same_tensors(final_state(run), final_state(reference))
    assert main(["data", "audit", str(run)]) == 0


@pytest.fixture
def cluster_env(monkeypatch):
    """Environment for every process of the test cluster (this one's too, which starts the
    cluster's nodes): token auth, fast node-death checks, and every address on loopback (Ray
    otherwise swaps 127.0.0.1 for the host's IP)."""
    # Ray keeps the first token a process loaded: reuse the one this process may have.
    token = os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="4",
               RAY_TMPDIR=tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: socket paths
    for key, value in env.items():
        if key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            # kept after the test: this process's Ray keeps the token it loaded first, so a
            # private cluster started later must be given the same one (engines/ray.py
            # `_import_ray` keeps a token already in the environment)
            os.environ[key] = value
        elif os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    yield env
    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
