"""Against a real multi-node Ray cluster started by the test on 127.0.0.1: preparing data on its
nodes, then a run joining it by address, worker logs reaching the controller, and losing a node
mid-run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.conftest import step_records

pytestmark = pytest.mark.timeout(300)

def _train(env, run, data, address, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "relaytrain.cli", "train", "configs/tiny.yaml", f"run_dir={run}",
         f"data.path={data}", "runtime.engine=ray", f"runtime.address={address}",
         "train.global_batch=12", "train.micro_batch=1", "log.progress=false", "--json",
         *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _prepare_on(env, address, data, out, workers: int = 4) -> subprocess.CompletedProcess:
    """`data prepare --address` of the corpus `data` was prepared from, with its tokenizer."""
    return subprocess.run(
        [sys.executable, "-m", "relaytrain.cli", "data", "prepare", "--source",
         os.path.join(os.path.dirname(data), "corpus", "*.txt"), "--tokenizer",
         os.path.join(data, "tokenizer.json"), "--heldout-frac", "0.1", "--out", str(out),
         "--address", address, "--workers", str(workers)],
        env=env, capture_output=True, text=True, timeout=120)


def test_data_is_prepared_on_a_clusters_nodes_then_a_run_joins_it_forwards_worker_logs_and_survives_losing_a_node(  # noqa: E501
        tmp_path, corpus_data, cluster_env):
    """Two Ray nodes on this machine (Ray's own multi-node test cluster: `ray start` refuses a
    second node on one host), two CPUs each. `data prepare --address` encodes on both nodes
    and writes the bytes one process writes; then a `relaytrain train` process joins by
    address with four workers, two on each node, and the second node is removed mid-run: its
    raylet and its workers die together."""
    from ray.cluster_utils import Cluster

    from relaytrain.cli import main

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        second = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        data = tmp_path / "data"
        too_many = _prepare_on(cluster_env, cluster.address, corpus_data, data, workers=5)
        assert too_many.returncode == 2 and not data.exists(), too_many.stderr
        assert "--workers 5: the Ray cluster at" in too_many.stderr.splitlines()[-1]
        done = _prepare_on(cluster_env, cluster.address, corpus_data, data)
        assert done.returncode == 0, done.stderr
        log = done.stderr
        assert re.search(r"encoding with 4 Ray workers on 2 nodes \(PIDs \d+, \d+, \d+, \d+\)",
                         log), log
        ours, theirs = (json.loads((Path(d) / "index.json").read_text())
                        for d in (data, corpus_data))
        assert ours["fingerprint"] == theirs["fingerprint"]  # the hash of every file written
        assert all((data / f).read_bytes() == (Path(corpus_data) / f).read_bytes()
                   for f in ours["files"])
        run = tmp_path / "run"
        proc = _train(cluster_env, run, str(data), cluster.address, "parallel.dp=4",
                      "train.max_steps=14", "determinism=exact", "elastic.replace_timeout=2",
                      "runtime.call_timeout=20", "checkpoint.every=0", "eval.every=0")
        deadline = time.monotonic() + 200
        while not ((run / "metrics.jsonl").exists() and max(step_records(run), default=0) >= 4):
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.05)
        cluster.remove_node(second)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        # A worker's stdout, with its rank (Ray folds the other ranks' like lines into one).
        assert re.search(r"\[rank \d\] joined generation 0: dp rank \d/4", out), out
        summary = json.loads(out.strip().splitlines()[-1])
        # Ray says the node died, and a recovery records that (not only "died", a lost process
        # on a node still there; the second worker's may read either way, depending on which
        # Ray notices first).
        causes = {r["cause"] for r in summary["recoveries"]}
        assert "lost its node" in causes and causes <= {"lost its node", "died"}, \
            summary["recoveries"]
        assert summary["dp"] == 2  # the lost node's two workers had nowhere to go
        assert sorted(step_records(run)) == list(range(1, 15))
        assert main(["data", "audit", str(run)]) == 0
    finally:
        cluster.shutdown()
