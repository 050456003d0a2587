"""Data parallelism on real Ray actors with gloo: the global batch, and in exact mode the
result to the bit, do not depend on the number of workers."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from relaytrain.runtime.summary import RunSummary
from tests.runtime.conftest import (
    DP,
    assert_bit_identical,
    final_state,
    run_layout,
    step_records,
)

pytestmark = pytest.mark.timeout(240)

def _run(run_dir, data, dp: int, *extra: str) -> RunSummary:
    return run_layout(run_dir, data, dp, *DP, *extra)


def run_exact_reference(run_dir, data) -> None:
    """The recorded reference: dp 1, exact mode, torch's own GEMMs, elementwise ops and the
    sliding layers' dense mask, as at the recording (a backend choice made by measurement, or
    kernels added since, must not move the recorded bits)."""
    _run(run_dir, data, 1, "determinism=exact", "train.max_steps=6", "model.matmul=aten",
         "model.kernels=torch", "model.attention=sdpa")


def host_key() -> str:
    """What the bits of a float run depend on: the CPU's kernels and torch's version."""
    import torch

    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = Path("/proc/cpuinfo").read_text()
    return (f"{platform.machine()} {model} avx512={'avx512f' in flags} "
            f"torch={torch.__version__}")


def exact_curve(run_dir) -> dict:
    """Every step's loss and gradient norm as exact floats, and a digest of the final weights."""
    import hashlib

    import torch

    records = step_records(run_dir)
    digest = hashlib.sha256()
    state = final_state(run_dir)
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return {"loss": {str(s): records[s]["loss"].hex() for s in sorted(records)},
            "grad_norm": {str(s): records[s]["grad_norm"].hex() for s in sorted(records)},
            "weights_sha256": digest.hexdigest()}


def test_exact_mode_reproduces_the_curve_recorded_before_the_controller_split(
        tmp_path, corpus_data):
    """Recorded by fixtures/record_exact_curve.py at commit 48a75a1 (before issue 20's
    refactor); bits on the recording host, float noise elsewhere."""
    recorded = json.loads((Path(__file__).parent / "fixtures" / "exact_curve.json").read_text())
    run_exact_reference(tmp_path / "run", corpus_data)
    now = exact_curve(tmp_path / "run")
    if recorded["host"] == host_key():
        assert now == {k: v for k, v in recorded.items() if k != "host"}
        return
    for key in ("loss", "grad_norm"):
        a = {int(s): float.fromhex(v) for s, v in recorded[key].items()}
        b = {int(s): float.fromhex(v) for s, v in now[key].items()}
        assert sorted(a) == sorted(b)
        assert all(abs(a[s] - b[s]) <= 1e-4 * abs(a[s]) for s in a), (key, a, b)


def test_exact_mode_is_bit_identical_to_one_worker(tmp_path, corpus_data, ray_cluster,
                                                   exact_reference):
    """At dp 3 here; dp 4 and 2 in the resized run below, which must match the same reference."""
    run = tmp_path / "dp3"
    _run(run, corpus_data, 3, "determinism=exact", "train.max_steps=6")
    assert_bit_identical(run, exact_reference)


def test_fast_mode_agrees_within_float_noise(tmp_path, corpus_data, ray_cluster):
    """(A fast run resumed at the same size gives its own bits: tests/runtime/test_train.py.)"""
    one, two = tmp_path / "one", tmp_path / "two"
    _run(one, corpus_data, 1, "train.max_steps=6")
    _run(two, corpus_data, 2, "train.max_steps=6")
    a, b = step_records(one), step_records(two)
    diff = max(abs(a[s]["loss"] - b[s]["loss"]) for s in a)
    assert diff < 1e-5  # float32 summation order only: far below this (docs/MEASURED.md)


def test_resume_at_another_dp_size_continues_the_same_batches(tmp_path, corpus_data,
                                                              ray_cluster, exact_reference):
    """Written at dp=4, resumed at dp=2 (onto more workers: the fsdp 2 -> 4 resume,
    tests/runtime/test_sharded_data_parallel.py)."""
    run = tmp_path / "resized"
    for dp, steps in ((4, 2), (2, 6)):
        _run(run, corpus_data, dp, "determinism=exact", f"train.max_steps={steps}",
             "checkpoint.every=2")
    assert_bit_identical(run, exact_reference)
