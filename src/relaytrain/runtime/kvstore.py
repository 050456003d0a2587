"""A generation's rendezvous store: the key-value server the controller runs, and the
`torch.distributed.Store` its workers form their process groups with, over connections that
must first prove they hold the generation's secret.

torch's TCPStore has no authentication: whoever reaches its port reads and writes the keys a
generation forms from, i.e. joins it or breaks it. Here every connection starts with a mutual
challenge-response (HMAC-SHA256 over a fresh nonce from each side) on a random per-generation
secret, which reaches the workers over the engine's own channel (an argument of their setup
call). A peer that fails it is told so and dropped before anything it sent is read as a request;
a server that cannot prove the secret is refused by the client. Requests are pickled only
between peers that passed it. Nothing is encrypted: see the README's security section.

torch drives the store from C++ (gloo's and NCCL's rendezvous) through its trampoline for Python
stores, which calls set, get, add, compare_set, check, wait (with and without a timeout),
delete_key and num_keys; `Client` gives each the semantics of torch's own stores: get and wait
block until their keys exist or the timeout (zero: none) passes, add keeps a decimal integer.
The server answers each connection on its own daemon thread. `Server.close` ends the
generation: it shuts every connection down, so a worker blocked on the store fails at once
(DistNetworkError) instead of waiting out its timeout, and returns once every thread is gone.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, BinaryIO

import torch.distributed as dist

NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT_S = 30.0  # a peer that has not answered the challenge by then is dropped
ACCEPTED, REJECTED = b"+", b"-"
FRAME = struct.Struct("!I")  # a request's or reply's length, then its pickle


@dataclass(frozen=True)
class StoreAccess:
    """Where a generation's store listens, and the secret it admits (kept out of reprs)."""

    host: str
    port: int
    secret: bytes = field(repr=False)


def _proof(secret: bytes, role: bytes, nonce: bytes, other: bytes) -> bytes:
    """Each side signs its own role and the peer's challenge: no answer can be replayed, nor
    reflected back to the side that asked."""
    return hmac.new(secret, role + nonce + other, hashlib.sha256).digest()


def _read(reader: BinaryIO, n: int) -> bytes:
    data = reader.read(n)
    if len(data) < n:
        raise EOFError("the connection closed")
    return data


def _send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message)
    sock.sendall(FRAME.pack(len(data)) + data)


def _receive(reader: BinaryIO) -> Any:
    (size,) = FRAME.unpack(_read(reader, FRAME.size))
    return pickle.loads(_read(reader, size))


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed or never connected
        pass


class Server:
    """Serves one generation's keys from `sock` (bound and listening) to the clients that hold
    `secret`, until `close`."""

    def __init__(self, sock: socket.socket, secret: bytes) -> None:
        host, port = sock.getsockname()[:2]
        self.access = StoreAccess(host, port, secret)
        self._sock = sock
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()  # guards all of the state; a set wakes waiters
        self._closed = False
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._ops: dict[str, Callable[..., Any]] = {
            "set": self._set, "get": self._get, "add": self._add,
            "compare_set": self._compare_set, "check": self._check, "wait": self._wait,
            "delete_key": self._delete_key, "num_keys": self._num_keys}
        self._acceptor = threading.Thread(target=self._accept, daemon=True,
                                          name=f"rendezvous-store:{port}")
        self._acceptor.start()

    def close(self) -> None:
        """End the generation: no more connections, every open one shut down (a client blocked
        on the store fails at once); returns when all of the server's threads have ended."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            connections = dict(self._connections)
        _shut(self._sock)  # wakes the acceptor
        self._acceptor.join()
        self._sock.close()
        for conn, thread in connections.items():
            _shut(conn)
            thread.join()

    # ---- connections -----------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with self._changed:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                          name=f"rendezvous-store:{self.access.port}")
                self._connections[conn] = thread
                thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            reader = conn.makefile("rb")
            if not self._admit(conn, reader):
                return
            while True:
                op, args = _receive(reader)
                try:
                    reply = (True, self._ops[op](*args))
                except TimeoutError as e:
                    reply = (False, str(e))
                _send(conn, reply)
        except (OSError, EOFError):  # the client left, or close() shut the connection
            pass
        finally:
            conn.close()
            with self._changed:
                self._connections.pop(conn, None)

    def _admit(self, conn: socket.socket, reader: BinaryIO) -> bool:
        """The challenge-response: does the peer hold the secret? (It learns the answer.)"""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        nonce = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(nonce)
        answer = _read(reader, NONCE_BYTES + PROOF_BYTES)
        theirs, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _proof(self.access.secret, b"client", nonce, theirs)):
            conn.sendall(REJECTED)
            return False
        conn.sendall(ACCEPTED + _proof(self.access.secret, b"server", theirs, nonce))
        conn.settimeout(None)
        return True

    # ---- operations (torch's Store semantics) ----------------------------------------------
    def _until_set(self, keys: list[str], timeout_s: float | None) -> None:
        """Called holding the lock; returns with `keys` set, else raises."""
        if not self._changed.wait_for(lambda: self._closed or all(k in self._data for k in keys),
                                      timeout_s):
            raise TimeoutError(f"keys {keys} not set within {timeout_s:g} s")
        if self._closed:
            raise EOFError("the store closed")

    def _set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def _get(self, key: str, timeout_s: float | None) -> bytes:
        with self._changed:
            self._until_set([key], timeout_s)
            return self._data[key]

    def _add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set `desired` if the value is `expected` (a missing key counts as b""); the value
        after, except for a missing key and another expectation: that expectation, as torch's
        stores answer."""
        with self._changed:
            current = self._data.get(key)
            if current == expected or (current is None and expected == b""):
                self._data[key] = desired
                self._changed.notify_all()
                return desired
            return expected if current is None else current

    def _check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def _wait(self, keys: list[str], timeout_s: float | None) -> None:
        with self._changed:
            self._until_set(keys, timeout_s)

    def _delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def _num_keys(self) -> int:
        with self._changed:
            return len(self._data)


class Client(dist.Store):
    """A worker's connection to its generation's store, admitted with the generation's secret.

    Keep it referenced while the process groups formed from it live: torch keeps only the C++
    half of a Python store, and calls into it fail once the Python object is gone."""

    def __init__(self, access: StoreAccess, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._where = f"{access.host}:{access.port}"
        self._lock = threading.Lock()  # one request at a time (torch calls from many threads)
        self._sock = socket.create_connection((access.host, access.port),
                                              timeout=HANDSHAKE_TIMEOUT_S)
        self._reader = self._sock.makefile("rb")
        try:
            self._handshake(access.secret)
        except BaseException:
            self.close()
            raise
        self._sock.settimeout(None)  # the server answers within each request's own timeout

    def _handshake(self, secret: bytes) -> None:
        challenge = _read(self._reader, NONCE_BYTES)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._sock.sendall(nonce + _proof(secret, b"client", challenge, nonce))
        if _read(self._reader, 1) != ACCEPTED:
            raise PermissionError(f"the rendezvous store at {self._where} rejected this "
                                  "process's secret")
        if not hmac.compare_digest(_read(self._reader, PROOF_BYTES),
                                   _proof(secret, b"server", nonce, challenge)):
            raise PermissionError(f"the rendezvous store at {self._where} does not hold the "
                                  "generation's secret")

    def close(self) -> None:
        self._reader.close()
        self._sock.close()

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            try:
                _send(self._sock, (op, args))
                ok, value = _receive(self._reader)
            except (OSError, EOFError, ValueError) as e:  # ValueError: closed here already
                raise dist.DistNetworkError(
                    f"lost the rendezvous store at {self._where} ({e}): its generation has "
                    "ended") from None
        if not ok:
            raise dist.DistStoreError(f"rendezvous store at {self._where}: {value}")
        return value

    def _seconds(self, timeout: timedelta | None) -> float | None:
        """A request's timeout for the server: the store's own if none is given; zero means
        no timeout (torch's convention)."""
        return (timeout if timeout is not None else self.timeout).total_seconds() or None

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, self._seconds(None))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", key, bytes(expected), bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", list(keys), self._seconds(timeout))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")
