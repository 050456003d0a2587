"""Joining a cluster that a plain `ray start` made (token authentication on, the token in
`~/.ray/auth_token` on the head): the token is found as Ray's own CLI finds it, and where there
is none (or the wrong one) `train` and `data prepare` say in one line what to set, exit 2,
within seconds, instead of Ray's twenty seconds of retries and a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.conftest import step_records
from tests.runtime.test_ray_cluster import _prepare_on, _train

pytestmark = pytest.mark.timeout(240)

TOKEN_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _as_a_new_user(cluster_env: dict, home: Path, **extra: str) -> dict:
    """The cluster's environment less everything about its token; `home` holds no token
    unless the test puts one there."""
    env = {k: v for k, v in cluster_env.items() if k not in TOKEN_VARS}
    home.mkdir(exist_ok=True)
    return dict(env, HOME=str(home), **extra)


@pytest.fixture(scope="module")
def start_up_s() -> float:
    """Seconds a process takes here to import the CLI and Ray before it can do anything (most of
    a refusal's time on a loaded host)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import relaytrain.cli.train, ray"], check=True,
                   timeout=120)
    return time.monotonic() - started


def _refused(proc: subprocess.CompletedProcess | subprocess.Popen, started: float,
             start_up_s: float) -> str:
    if isinstance(proc, subprocess.Popen):
        out = proc.communicate(timeout=60)[0]
    else:
        out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    took = time.monotonic() - started - start_up_s
    assert took < 15, f"{took:.1f} s after start-up: Ray's own retries take about 20 s"
    lines = out.strip().splitlines()
    assert all(line.startswith("relaytrain: ") for line in lines), out  # no retries, no trace
    assert sum("error" in line for line in lines) == 1, out
    return lines[-1]


def test_a_token_cluster_is_joined_with_the_token_ray_start_wrote_or_refused_in_one_line(
        tmp_path, corpus_data, cluster_env, start_up_s):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        address = cluster.address
        no_token = _as_a_new_user(cluster_env, tmp_path / "home")
        run = tmp_path / "run"
        started = time.monotonic()
        line = _refused(_train(no_token, run, corpus_data, address, "train.max_steps=2"),
                        started, start_up_s)
        assert line.startswith(f"relaytrain: error: runtime.address={address}: the cluster "
                               "requires token authentication"), line
        assert "RAY_AUTH_MODE=token" in line and "RAY_AUTH_TOKEN" in line, line
        assert not run.exists()

        started = time.monotonic()
        wrong = dict(no_token, RAY_AUTH_TOKEN="0" * 64)
        prepared = tmp_path / "prepared"
        line = _refused(_prepare_on(wrong, address, corpus_data, prepared), started,
                        start_up_s)
        assert line.startswith(f"relaytrain: error: --address {address}: the token this "
                               "process found was refused"), line
        assert not prepared.exists()

        # What `ray start --head` leaves on the head: the token in ~/.ray/auth_token.
        (tmp_path / "home" / ".ray").mkdir()
        (tmp_path / "home" / ".ray" / "auth_token").write_text(cluster_env["RAY_AUTH_TOKEN"])
        proc = _train(no_token, run, corpus_data, address, "train.max_steps=2",
                      "checkpoint.every=0", "eval.every=0")
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        assert sorted(step_records(run)) == [1, 2]
    finally:
        cluster.shutdown()


def test_an_address_where_no_cluster_answers_is_one_line_at_once(tmp_path, corpus_data,
                                                                  start_up_s):
    env = dict(os.environ, HOME=str(tmp_path))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "relaytrain.cli", "train", "configs/tiny.yaml",
         f"run_dir={tmp_path / 'run'}", f"data.path={corpus_data}", "runtime.engine=ray",
         "runtime.address=127.0.0.1:1"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started - start_up_s < 15
    assert all(line.startswith("relaytrain: ") for line in proc.stderr.splitlines()), proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "relaytrain: error: runtime.address=127.0.0.1:1: no Ray cluster answers there"), proc.stderr
    assert not (tmp_path / "run").exists()
