"""The Ray engine on real actors: a stopped worker is named hung by a ping instead of being
waited for, a replacement can be started before it is asked for, and a private cluster's run
listens on loopback only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types

import pytest

from relaytrain.data.dataset import TokenDataset
from relaytrain.parallel.groups import Placement
from relaytrain.runtime import rendezvous
from relaytrain.runtime.engines import ray as ray_engine
from relaytrain.runtime.engines.ray import RayEngine
from relaytrain.runtime.failures import WorkerHung, carry_snapshot
from tests.runtime.conftest import records, step_records, tiny_config
from tests.runtime.listening import listening_sockets

pytestmark = pytest.mark.timeout(120)


def test_a_stopped_worker_is_named_hung_at_once_while_a_peer_failure_settles(
        tmp_path, corpus_data, ray_cluster):
    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray", "parallel.dp=2")
    engine = RayEngine(cfg)
    args = (cfg, TokenDataset.open(corpus_data).vocab_size)
    alive, stopped = engine.spawn_many(2, args, wait=60)
    os.kill(engine.pid(stopped), signal.SIGSTOP)
    try:
        with pytest.raises(WorkerHung) as hung:
            engine.call({alive: lambda w: w.ping(), stopped: lambda w: w.ping()}, timeout=1.0)
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [
    "parallel.dp=2",
    pytest.param("parallel.pp=2", marks=pytest.mark.soak),  # the same bindings; ~40 s more
])
def test_every_socket_of_a_private_cluster_run_listens_on_loopback_only(tmp_path, corpus_data,
                                                                         layout):
    """The whole process tree of `relaytrain train` (controller, Ray's GCS, raylet and agents,
    the workers with their gloo groups, the rendezvous store), read while a generation is
    formed: once step 1 is recorded, a slow step 2 holds the generation open and the controller
    is stopped while the test reads."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "GLOO_", "NCCL_"))}  # as a user's shell would have it
    run = tmp_path / "run"
    with open(tmp_path / "out.txt", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relaytrain.cli", "train", "configs/tiny.yaml",
             f"run_dir={run}", f"data.path={corpus_data}", "runtime.engine=ray", layout,
             "train.max_steps=3", "checkpoint.every=0", "eval.every=0", "faults.slow_at=[2]",
             "faults.slow_seconds=3", "log.progress=false"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None and not (
                    (run / "metrics.jsonl").exists() and step_records(run)):
                time.sleep(0.05)
            log.seek(0)
            assert proc.poll() is None, f"the run ended before step 2:\n{log.read()}"
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                sockets = listening_sockets(proc.pid)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
        log.seek(0)
        assert proc.returncode == 0, log.read()
    processes = {s.process for s in sockets}
    assert {"gcs_server", "raylet"} <= processes, sockets
    # the first generation's two workers (as they report themselves) were read, and the
    # standby if it had started (it replaces the worker whose 3 s stop reads as a hang)
    workers = {w["pid"] for w in records(run, "generation")[0]["workers"].values()}
    actors = {s.pid for s in sockets if s.process.startswith("ray::_RankedWor")}
    assert len(workers) == 2 and workers <= actors and len(actors - workers) <= 1, sockets
    assert [s for s in sockets if not s.loopback] == []


def test_an_overdue_worker_whose_cpu_time_grows_is_starved_not_hung(monkeypatch):
    """Its ping overdue, a worker on this host that is not stopped and keeps using CPU is
    granted up to STARVED_GRACE more (a busy host, not a hang); one whose CPU time stops growing
    is hung at the next look, a stopped one (or one elsewhere: no CPU time known) at once."""
    ticks = {"starved": 10, "deadlocked": 10}  # "stopped": none
    monkeypatch.setattr(ray_engine, "cpu_ticks", lambda identity: ticks.get(identity))
    starved = ray_engine._Starved({0: "starved", 1: "deadlocked", 2: "stopped"})
    sent, late, look = 100.0, ray_engine.PING_TIMEOUT, ray_engine.HEARTBEAT_S
    now = sent + late
    assert starved(0, now, sent) and starved(1, now, sent)  # the first look
    assert not starved(2, now, sent)
    assert starved(1, now + look / 2, sent)  # looked at too recently to judge
    now += look
    ticks["starved"] += 1
    assert starved(0, now, sent) and not starved(1, now, sent)
    while now + look < sent + late + ray_engine.STARVED_GRACE:
        now += look
        ticks["starved"] += 1
        assert starved(0, now, sent)
    assert not starved(0, sent + late + ray_engine.STARVED_GRACE, sent)


def test_a_survivor_starved_past_the_ping_deadline_is_waited_for_not_named_hung(
        ray_cluster, monkeypatch):
    """After a failure the survivors are pinged (`settle`): one on this host whose CPU time
    grows answers late and is not named hung (it has up to STARVED_GRACE more); one whose CPU
    time does not grow, or that is stopped, is named hung."""
    @ray_cluster.remote
    def answer(after: float) -> dict:
        time.sleep(after)
        return {}

    ray_cluster.get([answer.remote(0) for _ in range(3)])  # the task workers started

    class Late:  # a worker whose ping is answered `after` seconds from now
        def __init__(self, after: float):
            self.ping = types.SimpleNamespace(remote=lambda: answer.remote(after))
            self.ping.options = lambda **_: self.ping  # on the control thread, as actors do

    looks = {"starved": 0}

    def cpu_ticks(identity):
        if identity == "starved":
            looks["starved"] += 1  # its CPU time grows between any two looks
        return {"deadlocked": 7}.get(identity, looks.get(identity))  # "stopped": none

    monkeypatch.setattr(ray_engine, "cpu_ticks", cpu_ticks)
    engine = object.__new__(RayEngine)  # only its actors and their identities are asked
    after = ray_engine.PING_TIMEOUT + 1.5
    engine.actors = {w: Late(after) for w in range(3)}
    engine._ids = {0: "starved", 1: "deadlocked", 2: "stopped"}
    answers = engine._ping([0, 1, 2])
    assert answers[0] is None and looks["starved"] > 1
    assert isinstance(answers[1], WorkerHung) and isinstance(answers[2], WorkerHung)


@pytest.mark.soak  # a hang named by the heartbeat mid-step: tests/runtime/test_elastic.py
def test_a_worker_stopped_during_a_long_call_is_named_hung_by_the_heartbeat(
        tmp_path, corpus_data, ray_cluster, monkeypatch):
    # Steps are watched (tests/runtime/test_elastic.py stops a worker mid-step); a rendezvous
    # waiting on its stopped peer is the cheapest call to watch the same way.
    monkeypatch.setattr(ray_engine, "WATCHED", frozenset({"setup"}))
    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray", "parallel.dp=2")
    engine = RayEngine(cfg)
    args = (cfg, TokenDataset.open(corpus_data).vocab_size)
    waiting, stopped = engine.spawn_many(2, args, wait=60)
    store = rendezvous.serve("127.0.0.1")
    os.kill(engine.pid(stopped), signal.SIGSTOP)
    try:
        # `waiting` waits in the rendezvous for its stopped peer: with a 600 s deadline (past
        # this test's), only the pings it answers and its peer does not can end the call.
        with pytest.raises(WorkerHung, match="no answer to a ping") as hung:
            engine.call({waiting: lambda w: w.setup(0, Placement(0, 2, 0, 2), store.access,
                                                    600.0),
                         stopped: lambda w: w.ping()}, timeout=600)
        assert hung.value.wid == stopped
        # Its late ping started a replacement while the ping deadline ran.
        assert len(engine.actors) == 3
        assert engine.spawn(args, wait=60) not in (waiting, stopped)
    finally:
        engine.shutdown()
        store.close()


def test_a_prestarted_worker_is_the_next_one_spawned(tmp_path, corpus_data, ray_cluster):
    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray", "elastic.standby=false")
    engine = RayEngine(cfg)
    args = (cfg, TokenDataset.open(corpus_data).vocab_size)
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


def test_a_worker_ready_now_is_only_one_up_already_and_taking_it_starts_nothing(
        tmp_path, corpus_data, ray_cluster):
    """`spawn_ready` never waits for a process to start: None while the prestarted worker is
    starting, that worker once it is up."""
    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray", "elastic.standby=false")
    engine = RayEngine(cfg)
    args = (cfg, TokenDataset.open(corpus_data).vocab_size)
    [first] = engine.spawn_many(1, args, wait=60)
    try:
        assert engine.spawn_ready(args) is None and set(engine.actors) == {first}
        engine.prestart()
        [starting] = set(engine.actors) - {first}
        assert engine.spawn_ready(args) is None  # a process takes seconds to start
        deadline = time.monotonic() + 60
        while (ready := engine.spawn_ready(args)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready == starting and set(engine.actors) == {first, starting}
    finally:
        engine.shutdown()


def test_a_replacement_is_the_standby_process_started_ahead_which_reserved_nothing(
        tmp_path, corpus_data, ray_cluster):
    import ray

    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray", "elastic.standby=true")
    engine = RayEngine(cfg)
    args = (cfg, TokenDataset.open(corpus_data).vocab_size)
    [first] = engine.spawn_many(1, args, wait=60)
    try:
        [standby] = set(engine.actors) - {first}
        standby_pid = ray.get(engine.actors[standby].ping.remote(), timeout=60).pid  # its word
        assert standby_pid not in (engine.pid(first), os.getpid())
        free = 4 - cfg.runtime.cpus_per_worker  # the standby reserved none
        assert _available_cpus(ray, free) == free
        engine.prestart()  # the standby is the next replacement: nothing more starts
        assert set(engine.actors) == {first, standby}
        engine.kill(first)
        second = engine.spawn(args, wait=60)
        assert second == standby and engine.pid(second) == standby_pid
        assert set(engine.actors) == {second}  # the next standby waits for refill()
        engine.refill()
        [new_standby] = set(engine.actors) - {second}
        assert ray.get(engine.actors[new_standby].ping.remote(), timeout=60).pid != standby_pid
    finally:
        engine.shutdown()


def _available_cpus(ray, expected: float) -> float:
    """Ray's count once it is `expected` or 10 s have passed (a change takes a moment to
    show)."""
    deadline = time.monotonic() + 10
    while True:
        cpus = ray.available_resources().get("CPU", 0.0)
        if cpus == expected or time.monotonic() > deadline:
            return cpus
        time.sleep(0.1)


def test_a_failed_worker_s_slot_is_kept_for_the_standby_or_held_from_everyone(
        tmp_path, corpus_data, ray_cluster):
    """The cluster is full (4 workers, 4 CPUs): the standby, which reserved nothing, becomes
    the replacement in the very slot the retired worker held, with nothing to free and place
    again. A slot held (`faults.hold_capacity_s`: a lost node) is that same placement group,
    kept from everyone for its seconds: holding it waits for nothing."""
    import ray

    cfg = tiny_config(tmp_path / "run", corpus_data, "runtime.engine=ray", "parallel.dp=4",
                      "elastic.standby=true")
    engine = RayEngine(cfg)
    args = (cfg, TokenDataset.open(corpus_data).vocab_size)
    workers = engine.spawn_many(4, args, wait=60)
    try:
        [standby] = set(engine.actors) - set(workers)
        slot = engine.groups[workers[1]]
        engine.retire(workers[1])
        assert workers[1] not in engine.actors
        new = engine.spawn(args, wait=60)
        assert new == standby and engine.groups[new] is slot
        engine.refill()  # a new standby, which the held slot must not go to
        held = engine.groups[workers[2]]
        engine.hold_capacity(workers[2], 2.0)
        engine.retire(workers[2])
        assert engine._reserved is None  # not the standby's
        assert ray.util.placement_group_table(held)["state"] == "CREATED"
        deadline = time.monotonic() + 30  # then given up, by a timer
        while ray.util.placement_group_table(held)["state"] != "REMOVED":
            assert time.monotonic() < deadline, "the held slot was never given up"
            time.sleep(0.1)
    finally:
        engine.shutdown()


def test_a_failed_step_call_s_snapshot_step_crosses_inside_ray_s_error():
    """The snapshot step a survivor's failed step call carries (`carry_snapshot`) is read off
    the `RayTaskError` it crossed in, pickled as Ray sends it; any other error carries none."""
    import pickle

    from ray import cloudpickle
    from ray.exceptions import RayTaskError

    def crossed(cause: Exception) -> Exception:
        err = RayTaskError("run_steps", "traceback", cause, proctitle="w", pid=1, ip="127.0.0.1")
        return pickle.loads(cloudpickle.dumps(err)).as_instanceof_cause()

    aborted = RuntimeError("the collective was aborted")
    carry_snapshot(aborted, 12)
    assert ray_engine._carried(crossed(aborted)) == (12,)
    none = RuntimeError("refused")
    carry_snapshot(none, None)
    assert ray_engine._carried(crossed(none)) == (None,)
    assert ray_engine._carried(crossed(RuntimeError("setup failed"))) == ()
