"""Where a generation's own sockets listen: the controller's rendezvous store and the workers'
collective transports (gloo, NCCL), each bound to one interface, never to all.

The controller names the store's host: loopback for a private cluster, the node's address on an
existing one. Left to themselves, torch's TCPStore server listens on every interface whatever
host it is given, and gloo on whatever the machine's hostname resolves to; so the store is
served from a socket bound here, and a worker points gloo and NCCL at the interface on its
route to the store (loopback for a private cluster; on a cluster, the network it shares with
the controller). The store has no authentication: see the README's security section for what
that leaves open and what to firewall.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
LISTEN_BACKLOG = 1024  # workers connect all at once at a generation's start
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # read by torch's gloo, by NCCL


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET


def serve(host: str) -> dist.TCPStore:
    """A new store listening on `host` only, at a free port (its `.port`)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(LISTEN_BACKLOG)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store's server takes the bound socket over (and closes it when the store goes).
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


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


def join(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """Connect to the generation's store; this process's collectives will listen on the
    interface that reaches it (read when a process group is created). Off loopback, an
    interface the user named (e.g. a faster network) is kept: it is one interface too."""
    local = local_address(host)
    iface = interface_of(local)
    for var in IFNAME_VARS:
        if ipaddress.ip_address(local).is_loopback or var not in os.environ:
            os.environ[var] = iface
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
