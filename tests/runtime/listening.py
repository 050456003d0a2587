"""The listening sockets of a process tree, read from /proc (TCP in LISTEN, bound UDP): each
process's socket inodes (/proc/PID/fd) matched against its network namespace's tables."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

# /proc/net table -> the state that means "accepts traffic": TCP LISTEN, UDP unconnected
TABLES = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    table: str
    address: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
        return (mapped or ip).is_loopback


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(field: str) -> tuple[str, int]:
    """/proc/net's "HEX_IP:HEX_PORT": the IP in host-order 32-bit words."""
    ip, port = field.split(":")
    words = [bytes.fromhex(ip[i:i + 8])[::-1] for i in range(0, len(ip), 8)]
    return str(ipaddress.ip_address(b"".join(words))), int(port, 16)


def listening_sockets(root: int) -> list[Listener]:
    """Every socket accepting connections or datagrams in `root`'s process tree."""
    out = []
    for pid in process_tree(root):
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        for table, state in TABLES.items():
            try:
                rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                f = row.split()
                if f[3] == state and int(f[9]) in inodes:
                    out.append(Listener(pid, process, table, *_address(f[1])))
    return out
