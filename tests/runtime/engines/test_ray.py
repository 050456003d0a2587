"""The Ray engine's view of failures, on real actors: a stopped worker is named hung by a ping
instead of being waited for."""

from __future__ import annotations

import os
import signal

import pytest

from relaytrain.data.dataset import TokenDataset
from relaytrain.runtime.engines.ray import RayEngine
from relaytrain.runtime.failures import WorkerHung
from tests.runtime.conftest import tiny_config

pytestmark = pytest.mark.timeout(120)


def test_a_stopped_worker_is_named_hung_at_once_while_a_peer_failure_settles(
        tmp_path, corpus_data, ray_cluster):
    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray", "parallel.dp=2")
    engine = RayEngine(cfg)
    args = (cfg.to_dict(), TokenDataset.open(corpus_data).vocab_size)
    alive, stopped = engine.spawn_many(2, args, wait=60)
    os.kill(engine.pid(stopped), signal.SIGSTOP)
    try:
        with pytest.raises(WorkerHung) as hung:
            engine.call({alive: ("ping", ()), stopped: ("ping", ())}, timeout=1.0)
        assert hung.value.wid == stopped
        # Its call is still outstanding. Settling must not wait the whole timeout for it (the
        # suite's deadline is shorter than that): one unanswered ping names it.
        settled = engine.settle(timeout=600)
        assert list(settled) == [stopped]
        assert isinstance(settled[stopped], WorkerHung)
        assert "no answer to a ping" in str(settled[stopped]), settled
    finally:
        engine.kill(stopped)
        engine.kill(alive)
