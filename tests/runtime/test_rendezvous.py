"""The rendezvous store listens on the one address it is given, a worker points its collectives
at the interface that reaches the store, and gloo groups form and all-reduce through it; the
socket listing the cluster tests rely on sees a socket bound to every interface."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from relaytrain.runtime import rendezvous
from relaytrain.runtime.kvstore import Server
from tests.runtime.listening import listening_sockets

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def serve():
    """Serve a store on a host; every store served is closed after the test."""
    served: list[Server] = []

    def start(host: str) -> Server:
        served.append(rendezvous.serve(host))
        return served[-1]

    yield start
    for server in served:
        server.close()


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


def test_a_private_store_listens_on_loopback_only_and_serves_its_clients(monkeypatch, serve):
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(var, "eth0")  # a user's setting cannot take a private run off lo
    server = serve("127.0.0.1")
    port = server.access.port
    assert [(s.address, s.port) for s in _mine(port)] == [("127.0.0.1", port)]
    rendezvous.join(server.access, timeout_s=10).set("gen0/rank0", b"here")
    assert rendezvous.join(server.access, timeout_s=10).get("gen0/rank0") == b"here"
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"


def test_a_store_on_a_node_address_listens_there_and_nowhere_else(monkeypatch, serve):
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    address = _external_address()
    server = serve(address)
    port = server.access.port
    assert [(s.address, s.port) for s in _mine(port)] == [(address, port)]
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))
    rendezvous.join(server.access, timeout_s=10).set("k", b"v")
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    assert iface != "lo" and rendezvous.interface_of(address) == iface
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # a network the user chose is kept
    assert rendezvous.join(server.access, timeout_s=10).get("k") == b"v"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "ib0"


RANK = """
import sys, torch, torch.distributed as dist
from relaytrain.runtime import rendezvous
from relaytrain.runtime.kvstore import StoreAccess
host, port, secret, rank = sys.argv[1:]
store = rendezvous.join(StoreAccess(host, int(port), bytes.fromhex(secret)), 30)
dist.init_process_group("gloo", store=dist.PrefixStore("gen0", store), rank=int(rank),
                        world_size=2)
total = torch.tensor([int(rank) + 1.0])
dist.all_reduce(total)
print(f"ready {total.item():g}", flush=True)
sys.stdin.read()
dist.destroy_process_group()
"""


def _ranks(server: Server) -> list[subprocess.Popen]:
    """Two processes in a gloo group formed through `server`; each prints its all-reduced sum
    and leaves when its stdin closes."""
    access = server.access
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    return [subprocess.Popen([sys.executable, "-c", RANK, access.host, str(access.port),
                              access.secret.hex(), str(r)],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for r in range(2)]


def _leave(ranks: list[subprocess.Popen]) -> list[int]:
    for p in ranks:
        p.communicate("", timeout=30)
    return [p.returncode for p in ranks]


def test_two_gloo_ranks_form_a_group_and_all_reduce_through_the_store(serve):
    ranks = _ranks(serve("127.0.0.1"))
    try:
        assert [p.stdout.readline() for p in ranks] == ["ready 3\n"] * 2
    finally:
        assert _leave(ranks) == [0, 0]


def test_gloo_listens_on_the_interface_that_reaches_the_store(serve):
    """A store on this machine's network address (as on an existing cluster): both ranks' gloo
    listen on that address, not on loopback (where this host's name resolves) nor everywhere."""
    address = _external_address()
    ranks = _ranks(serve(address))
    try:
        assert [p.stdout.readline() for p in ranks] == ["ready 3\n"] * 2
        found = {(s.address, s.process) for p in ranks for s in listening_sockets(p.pid)}
    finally:
        returncodes = _leave(ranks)
    assert found == {(address, "python")}, found
    assert returncodes == [0, 0]


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
