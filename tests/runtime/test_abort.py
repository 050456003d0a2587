"""Aborting a generation's collectives (runtime/abort.py) on real gloo groups in real processes:
ranks blocked in a collective on a peer that never joins it fail at once, long before the
group's timeout, and the same processes form the next generation. No step depends on the
backend, so this is the path NCCL takes too."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from relaytrain.runtime import abort, rendezvous
from relaytrain.runtime.abort import (
    NCCL_ERROR_HANDLING,
    GroupSockets,
    abort_groups,
    keep_process_on_collective_errors,
    shut_down,
    socket_inodes,
)
from relaytrain.runtime.kvstore import StoreAccess

WORLD = 3
GROUP_TIMEOUT = timedelta(seconds=600)  # far past the test's deadline: only an abort frees it


def _rank(rank: int, access: StoreAccess, orders: mp.Queue, reports: mp.Queue) -> None:
    """One rank: joins generation 0, all but the last block in an all-reduce that the last one
    (alive, like a worker that raised) never enters, until the controller's abort; then all
    form generation 1 in the same process."""
    base = rendezvous.join(access, GROUP_TIMEOUT.total_seconds())
    sockets = GroupSockets()
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0", base), rank=rank,
                            world_size=WORLD, timeout=GROUP_TIMEOUT)
    group = dist.new_group(list(range(WORLD)), timeout=GROUP_TIMEOUT)  # a second group
    sockets.formed()
    aborted = threading.Event()

    def abort_on_order() -> None:  # the worker's second thread, free while the first waits
        assert orders.get() == "abort"
        abort_groups(sockets)
        aborted.set()

    threading.Thread(target=abort_on_order, daemon=True).start()
    reports.put((rank, "formed"))
    if rank < WORLD - 1:
        try:
            dist.all_reduce(torch.ones(1 << 16), group=group if rank == 0 else None)
            reports.put((rank, "returned"))
        except Exception as e:
            reports.put((rank, f"{type(e).__name__}: {e}"))
    else:
        reports.put((rank, "idle"))
    aborted.wait()
    assert orders.get() == "next"
    reports.put((rank, "still initialised" if dist.is_initialized() else "aborted"))
    dist.init_process_group("gloo", store=dist.PrefixStore("gen1", base), rank=rank,
                            world_size=WORLD, timeout=GROUP_TIMEOUT)
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    reports.put((rank, t.tolist(), os.getpid()))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_an_abort_frees_ranks_blocked_in_a_collective_and_the_processes_form_the_next_group():
    store = rendezvous.serve("127.0.0.1")
    ctx = mp.get_context("spawn")
    orders = [ctx.Queue() for _ in range(WORLD)]
    reports = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.access, orders[r], reports), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        first = [reports.get(timeout=100) for _ in range(WORLD + 1)]
        assert sorted(first) == sorted([(r, "formed") for r in range(WORLD)]
                                       + [(WORLD - 1, "idle")])
        time.sleep(0.5)  # into the all-reduces (no matter if not: they fail all the same)
        # Nothing but the abort can end the two blocked all-reduces: they would wait 600 s.
        for q in orders:
            q.put("abort")
        blocked = dict(reports.get(timeout=60) for _ in range(WORLD - 1))
        for rank, outcome in blocked.items():
            assert "Connection closed" in outcome, (rank, outcome)
        for q in orders:
            q.put("next")
        states = [reports.get(timeout=60) for _ in range(WORLD)]
        assert [s for _, s in sorted(states)] == ["aborted"] * WORLD
        results = sorted(reports.get(timeout=60) for _ in range(WORLD))
        assert [r[1] for r in results] == [[0.0 + 1.0 + 2.0] * 4] * WORLD
        assert [r[2] for r in results] == [p.pid for p in procs]  # the same processes
    finally:
        for p in procs:
            p.kill()
        store.close()


def test_the_sockets_opened_while_groups_form_are_found_again():
    before = socket.socket()
    sockets = GroupSockets()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    sockets.formed()
    try:
        assert sockets.opened == {f"socket:[{os.fstat(s.fileno()).st_ino}]"
                                  for s in (listener, client, server)}
        assert sockets.shut_down() == 2  # both ends of the connection; the listener listens on
        assert server.recv(1) == b"" and client.recv(1) == b""
    finally:
        for s in (before, listener, client, server):
            s.close()


def test_a_connection_is_shut_down_and_nothing_else_is_touched():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    unconnected = socket.socket()
    gone = socket.socket()
    gone_fd = gone.fileno()
    gone.close()
    try:
        assert shut_down(client.fileno())
        assert server.recv(1) == b""  # the peer sees the connection closed
        assert client.fileno() >= 0  # the descriptor stays its owner's to close
        assert not shut_down(listener.fileno())
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):  # still listening
            listener.accept()
        assert not shut_down(unconnected.fileno())
        assert not shut_down(gone_fd)
    finally:
        for s in (listener, client, server, unconnected):
            s.close()


def test_without_proc_there_is_nothing_to_shut_down(monkeypatch):
    monkeypatch.setattr(abort, "_FD_DIR", "/nonexistent/fd")
    assert socket_inodes() == {}
    sockets = GroupSockets()
    sockets.formed()
    assert sockets.opened == set() and sockets.shut_down() == 0


def test_nccl_errors_abort_the_communicator_not_the_process(monkeypatch):
    monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    keep_process_on_collective_errors()
    assert os.environ[NCCL_ERROR_HANDLING] == "2"
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "1")  # an operator's choice stands
    keep_process_on_collective_errors()
    assert os.environ[NCCL_ERROR_HANDLING] == "1"
