"""Fixtures for training runs: a small prepared corpus and config helpers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from relaytrain.cli import main
from relaytrain.config import RunConfig, load_config

WORDS = ("alpha beta gamma delta train model token layer norm rope window cache stage "
         "batch epoch seed ledger audit shard replica").split()


def make_corpus(root: Path) -> str:
    """Prepare ~40k tokens of word salad with a little structure under `root`; its path."""
    src = root / "corpus"
    src.mkdir()
    for i in range(80):
        r = random.Random(i)
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


def tiny_config(run_dir: Path | str, data: str, *overrides: str) -> RunConfig:
    """The tiny preset with small batches, quiet, checkpointing every few steps."""
    return load_config("configs/tiny.yaml", [f"run_dir={run_dir}", f"data.path={data}",
                                             "log.progress=false", *overrides])


def step_records(run_dir: Path | str) -> dict[int, dict]:
    """The last record of every step (a step redone after a restore overrides the old one)."""
    out: dict[int, dict] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "step":
            out[rec["step"]] = rec
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    """One private Ray cluster per test module, 4 CPUs (one per worker), token-authenticated
    and on loopback, as the engine would start it.

    The Ray engine uses an initialised Ray as it finds it, so runs in the module skip the
    cluster start-up."""
    from relaytrain.runtime.engines.ray import _import_ray

    _import_ray(private_cluster=True)
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def final_state(run_dir: Path | str):
    """The tensors of the run's newest checkpoint."""
    from relaytrain.checkpoint.store import open_checkpoint

    return open_checkpoint(str(run_dir))[1]


def same_tensors(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
