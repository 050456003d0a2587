"""Against a real multi-node Ray cluster started by the test on 127.0.0.1: joining it by
address, worker logs reaching the controller, and losing a node mid-run."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.runtime.conftest import step_records

pytestmark = pytest.mark.timeout(300)

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster_env():
    """Environment for every process of the test cluster: token auth, fast node-death checks,
    and every address on loopback (Ray otherwise swaps 127.0.0.1 for the host's IP)."""
    # Ray keeps the first token a process loaded: reuse the one this process may have.
    token = os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="4",
               RAY_TMPDIR=tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: socket paths
    yield env
    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def _start_node(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([RAY, "start", "--block", "--node-ip-address=127.0.0.1",
                             "--disable-usage-stats", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _stop_node(proc: subprocess.Popen) -> None:
    """Stop a node for real: its raylet, object store and workers (one process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _wait_for_cpus(env: dict, address: str, cpus: int) -> None:
    """Block until the cluster at `address` shows `cpus` CPUs (it is up)."""
    code = ("import ray, time, sys\n"
            f"ray.init(address='{address}', configure_logging=False, log_to_driver=False)\n"
            "t = time.time()\n"
            f"while ray.cluster_resources().get('CPU', 0) < {cpus}:\n"
            "    assert time.time() - t < 60, ray.cluster_resources(); time.sleep(0.5)\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=90)


def _train(env, run, data, address, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "relaytrain.cli", "train", "configs/tiny.yaml", f"run_dir={run}",
         f"data.path={data}", "runtime.engine=ray", f"runtime.address={address}",
         "train.global_batch=12", "train.micro_batch=1", "log.progress=false", "--json",
         *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_run_joins_a_cluster_by_address_and_forwards_worker_logs(tmp_path, corpus_data,
                                                                   cluster_env):
    port = _free_port()
    head = _start_node(cluster_env, "--head", f"--port={port}", "--num-cpus=2",
                       "--include-dashboard=false")
    try:
        address = f"127.0.0.1:{port}"
        _wait_for_cpus(cluster_env, address, 2)
        proc = _train(cluster_env, tmp_path / "run", corpus_data, address, "parallel.dp=2",
                      "train.max_steps=4")
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        assert "[rank 1] joined generation 0" in out  # a worker's stdout, with its rank
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["steps"] == 4 and summary["dp"] == 2
    finally:
        _stop_node(head)


def test_losing_a_node_shrinks_the_run_which_still_completes(tmp_path, corpus_data,
                                                             cluster_env, monkeypatch):
    """Two Ray nodes on this machine (Ray's own multi-node test cluster), two workers on each;
    the second node is removed mid-run: its raylet and its workers die together."""
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                "RAY_health_check_period_ms", "RAY_health_check_failure_threshold"):
        monkeypatch.setenv(key, cluster_env[key])
    import ray
    from ray.cluster_utils import Cluster

    from relaytrain.cli import main
    from relaytrain.runtime.controller import Controller
    from tests.runtime.conftest import tiny_config

    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    second = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    run = tmp_path / "run"
    try:
        def remove_second_node_after_step_4() -> None:
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline:
                if (run / "metrics.jsonl").exists() and max(step_records(run), default=0) >= 4:
                    cluster.remove_node(second)
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=remove_second_node_after_step_4, daemon=True)
        killer.start()
        summary = Controller(tiny_config(
            run, corpus_data, "runtime.engine=ray", "parallel.dp=4", "train.global_batch=12",
            "train.micro_batch=1", "train.max_steps=14", "determinism=exact",
            "elastic.replace_timeout=2", "runtime.call_timeout=20",
            "runtime.collective_timeout=3", "checkpoint.every=0", "eval.every=0")).run()
        killer.join(timeout=5)
        # Ray says the node died, and a recovery records that (not only "died", a lost process
        # on a node still there; a second worker's may read either way, depending on which
        # Ray notices first).
        causes = {r["cause"] for r in summary["recoveries"]}
        assert "lost its node" in causes and causes <= {"lost its node", "died"}, \
            summary["recoveries"]
        assert summary["dp"] == 2  # the lost node's two workers had nowhere to go
        assert sorted(step_records(run)) == list(range(1, 15))
        assert main(["data", "audit", str(run)]) == 0
    finally:
        ray.shutdown()
        cluster.shutdown()
