"""The Ray engine's view of failures, on real actors: a stopped worker is named hung by a ping
instead of being waited for, and a replacement can be started before it is asked for."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from relaytrain.data.dataset import TokenDataset
from relaytrain.runtime.engines import ray as ray_engine
from relaytrain.runtime.engines.ray import RayEngine
from relaytrain.runtime.failures import WorkerHung
from relaytrain.runtime.worker import Placement
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


def test_a_worker_stopped_during_a_long_call_is_named_hung_by_the_heartbeat(
        tmp_path, corpus_data, ray_cluster, monkeypatch):
    # Steps are watched (tests/runtime/test_elastic.py stops a worker mid-step); a rendezvous
    # waiting on its stopped peer is the cheapest call to watch the same way.
    monkeypatch.setattr(ray_engine, "WATCHED", frozenset({"setup"}))
    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray", "parallel.dp=2")
    engine = RayEngine(cfg)
    args = (cfg.to_dict(), TokenDataset.open(corpus_data).vocab_size)
    waiting, stopped = engine.spawn_many(2, args, wait=60)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.kill(engine.pid(stopped), signal.SIGSTOP)
    try:
        # `waiting` waits in the rendezvous for its stopped peer: with a 600 s deadline (past
        # this test's), only the pings it answers and its peer does not can end the call.
        with pytest.raises(WorkerHung, match="no answer to a ping") as hung:
            engine.call({waiting: ("setup", (0, Placement(0, 2, 0, 2), "127.0.0.1", store.port,
                                             600.0)),
                         stopped: ("ping", ())}, timeout=600)
        assert hung.value.wid == stopped
        # Its late ping started a replacement while the ping deadline ran.
        assert len(engine.actors) == 3
        assert engine.spawn(args, wait=60) not in (waiting, stopped)
    finally:
        engine.shutdown()


def test_a_prestarted_worker_is_the_next_one_spawned(tmp_path, corpus_data, ray_cluster):
    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray")
    engine = RayEngine(cfg)
    args = (cfg.to_dict(), TokenDataset.open(corpus_data).vocab_size)
    [first] = engine.spawn_many(1, args, wait=60)
    engine.prestart()
    engine.prestart()  # one is starting already: nothing more
    try:
        assert len(engine.actors) == 2
        second = engine.spawn(args, wait=60)
        assert second != first and set(engine.actors) == {first, second}
        assert engine.pid(second) not in (engine.pid(first), os.getpid())
    finally:
        engine.shutdown()
