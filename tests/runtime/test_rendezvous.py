"""The rendezvous store listens on the one address it is given, and a worker points its
collectives at the interface that reaches the store; the socket listing the cluster tests rely on
sees a socket bound to every interface."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from relaytrain.runtime import rendezvous
from tests.runtime.listening import listening_sockets

pytestmark = pytest.mark.timeout(60)


def _mine(port: int) -> list:
    return [s for s in listening_sockets(os.getpid()) if s.port == port]


def _external_address() -> str:
    """This machine's address on its default route (skips where it has none)."""
    try:
        address = rendezvous.local_address("192.0.2.123")  # TEST-NET-1: routed, never reached
    except OSError:
        pytest.skip("no route off this machine")
    if address.startswith("127."):
        pytest.skip("no address beyond loopback")
    return address


def test_a_private_store_listens_on_loopback_only_and_serves_its_clients(monkeypatch):
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(var, "eth0")  # a user's setting cannot take a private run off lo
    server = rendezvous.serve("127.0.0.1")
    assert [(s.address, s.port) for s in _mine(server.port)] == [("127.0.0.1", server.port)]
    client = rendezvous.join("127.0.0.1", server.port, timeout_s=10)
    client.set("gen0/rank0", b"here")
    assert server.get("gen0/rank0") == b"here"
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"


def test_a_store_on_a_node_address_listens_there_and_nowhere_else(monkeypatch):
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    address = _external_address()
    server = rendezvous.serve(address)
    assert [(s.address, s.port) for s in _mine(server.port)] == [(address, server.port)]
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", server.port))
    rendezvous.join(address, server.port, timeout_s=10).set("k", b"v")
    assert server.get("k") == b"v"
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    assert iface != "lo" and rendezvous.interface_of(address) == iface
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # a network the user chose is kept
    rendezvous.join(address, server.port, timeout_s=10)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"


RANK = """
import sys, torch.distributed as dist
from relaytrain.runtime import rendezvous
host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", store=rendezvous.join(host, port, 30), rank=rank, world_size=2)
print("ready", flush=True)
sys.stdin.read()
dist.destroy_process_group()
"""


def test_gloo_listens_on_the_interface_that_reaches_the_store():
    """A store on this machine's network address (as on an existing cluster): both ranks' gloo
    listen on that address, not on loopback (where this host's name resolves) nor everywhere."""
    address = _external_address()
    server = rendezvous.serve(address)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, address, str(server.port), str(r)],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        assert [p.stdout.readline() for p in ranks] == ["ready\n"] * 2
        found = {(s.address, s.process) for p in ranks for s in listening_sockets(p.pid)}
    finally:
        for p in ranks:
            p.communicate("", timeout=30)
    assert found == {(address, "python")}, found
    assert [p.returncode for p in ranks] == [0, 0]


def test_an_address_no_interface_holds_is_an_error():
    with pytest.raises(RuntimeError, match="no network interface holds 192.0.2.77"):
        rendezvous.interface_of("192.0.2.77")


def test_the_listing_names_a_socket_bound_to_every_interface():
    with socket.socket(socket.AF_INET6) as wild, socket.socket() as local:
        wild.bind(("::", 0))
        wild.listen()
        local.bind(("127.0.0.1", 0))
        local.listen()
        found = {s.port: s for s in listening_sockets(os.getpid())}
        assert not found[wild.getsockname()[1]].loopback
        assert found[local.getsockname()[1]].loopback
