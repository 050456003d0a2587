"""Aborting a generation's collectives in a living worker, so that no survivor of a failure
waits for `runtime.collective_timeout`.

A survivor blocked in a collective on a failed peer, or on a survivor that has already given up,
would otherwise wait out the collective timeout, which must stay long enough for a slow step,
a long all-gather or a checkpoint barrier on real hardware. The controller therefore asks every
survivor to abort the generation the moment it knows of a failure (Worker.abort, delivered on
the thread that answers pings), and the survivor's call in progress fails at once. Aborting is
two steps, both taken on every backend (each does nothing where it has nothing to act on), so
the path a CPU test covers with gloo is the one that runs with NCCL on CUDA:

1. It shuts down the TCP connections the groups opened. Gloo's `abort()` and `shutdown()`
   leave a pending operation waiting (measured with torch 2.13): a connection shut down is what
   gloo sees when a peer dies, so the pending operation fails at once, here and on each peer at
   the other end. The connections are the sockets that appeared while the groups were formed
   (`GroupSockets`), found again by inode (a number not reused while its socket is open, unlike
   a descriptor); listening sockets are left alone (gloo ends the process when its listener
   fails). Where /proc is missing (not Linux) there is nothing to shut down, and gloo falls
   back to the collective timeout.
2. `_abort_process_group()` aborts every group of the process: with NCCL it aborts the
   communicators (a pending kernel, and a thread waiting on it, returns with an error;
   stock ProcessGroupNCCL returns cleanly from it), and for every backend it drops the groups
   from torch's registry, so the next generation can be formed.

The collective timeout stays as the last resort for a hang nothing else sees. With NCCL, a
collective that errs or times out would by default end the whole process from torch's watchdog
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3); `keep_process_on_collective_errors` asks for 2 (abort the
communicator only), so a survivor keeps its process there as it does with gloo.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

_FD_DIR = "/proc/self/fd"
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def keep_process_on_collective_errors() -> None:
    """Before a group is created: an NCCL error or timeout aborts the communicator (the call
    fails) instead of ending the process. A value already set is kept; gloo ignores it."""
    os.environ.setdefault(NCCL_ERROR_HANDLING, "2")


def socket_inodes() -> dict[str, int]:
    """The process's open sockets: 'socket:[inode]' -> descriptor (empty without /proc)."""
    out: dict[str, int] = {}
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(os.path.join(_FD_DIR, fd))
        except OSError:  # closed since it was listed
            continue
        if link.startswith("socket:"):
            out[link] = int(fd)
    return out


class GroupSockets:
    """The sockets a generation's groups opened: those open after `formed()` that were not
    open when this object was made (create it right before forming the groups)."""

    def __init__(self) -> None:
        self._before = set(socket_inodes())
        self.opened: set[str] = set()

    def formed(self) -> None:
        self.opened = set(socket_inodes()) - self._before

    def shut_down(self) -> int:
        """Shut down every connection of theirs still open; how many."""
        return sum(shut_down(fd) for link, fd in socket_inodes().items() if link in self.opened)


def shut_down(fd: int) -> bool:
    """Shut down the connection on descriptor `fd` but leave the descriptor open for whoever
    holds it; False (nothing done) for a listening socket, one not connected (any more) and a
    descriptor closed since it was listed."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


def abort_groups(sockets: GroupSockets) -> None:
    """Make every collective of the current groups, pending or future, fail at once.

    Connections first: a gloo group freed by the abort while one of its operations is pending
    would wait for that operation in its destructor."""
    sockets.shut_down()
    if dist.is_initialized():
        _abort_process_group()
