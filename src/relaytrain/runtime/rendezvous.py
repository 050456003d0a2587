"""Where a generation's own sockets listen: the controller's rendezvous store and the workers'
collective transports (gloo, NCCL), each bound to one interface, never to all.

The controller names the store's host: loopback for a private cluster, the node's address on an
existing one. The store (runtime/kvstore.py, which admits only holders of the generation's
secret) is served from a socket bound to that host alone; gloo, left to itself, listens on
whatever the machine's hostname resolves to, so a worker points gloo and NCCL at the interface
on its route to the store (loopback for a private cluster; on a cluster, the network it shares
with the controller). Gloo and NCCL have no authentication: see the README's security section
for what that leaves open and what to firewall.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import secrets
import socket
import struct
from datetime import timedelta
from pathlib import Path

from relaytrain.runtime.kvstore import Client, Server, StoreAccess

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
LISTEN_BACKLOG = 1024  # workers connect all at once at a generation's start
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # read by torch's gloo, by NCCL
SECRET_BYTES = 32


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET


def serve(host: str) -> Server:
    """A new generation's store, listening on `host` only at a free port, admitting a fresh
    secret: its `.access` is what the generation's workers join with."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return Server(sock, secrets.token_bytes(SECRET_BYTES))


def local_address(host: str) -> str:
    """This machine's address on its route to `host` (a UDP connect sends nothing)."""
    with socket.socket(_family(host), socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of the network interface that holds `address`."""
    want = ipaddress.ip_address(address)
    for _, name in socket.if_nameindex():
        if want.version == 4:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR,
                                      struct.pack("256s", name.encode()[:15]))
                except OSError:  # an interface without an IPv4 address
                    continue
            if ipaddress.ip_address(raw[20:24]) == want:
                return name
    if want.version == 6:  # /proc/net/if_inet6: address (32 hex digits) ... name
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if ipaddress.ip_address(bytes.fromhex(fields[0])) == want:
                return fields[-1]
    raise RuntimeError(f"no network interface holds {address}")


def join(access: StoreAccess, timeout_s: float) -> Client:
    """Connect to the generation's store; this process's collectives will listen on the
    interface that reaches it (read when a process group is created). Off loopback, an
    interface the user named (e.g. a faster network) is kept: it is one interface too."""
    local = local_address(access.host)
    iface = interface_of(local)
    for var in IFNAME_VARS:
        if ipaddress.ip_address(local).is_loopback or var not in os.environ:
            os.environ[var] = iface
    return Client(access, timedelta(seconds=timeout_s))
