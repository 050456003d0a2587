"""The rendezvous store admits only the holders of its generation's secret, answers as torch's own
stores do, and ends with its generation: a call blocked on it then fails at once."""

from __future__ import annotations

import dataclasses
import pickle
import secrets
import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from relaytrain.runtime import rendezvous
from relaytrain.runtime.kvstore import (
    ACCEPTED,
    FRAME,
    NONCE_BYTES,
    PROOF_BYTES,
    REJECTED,
    Client,
    StoreAccess,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    served = rendezvous.serve("127.0.0.1")
    yield served
    served.close()


def _client(access: StoreAccess, timeout_s: float = 10) -> Client:
    return Client(access, timedelta(seconds=timeout_s))


def test_the_store_answers_as_torchs_own_store_does(server):
    script = [("set", "k", b"v"), ("get", "k"), ("add", "n", 3), ("add", "n", -1), ("get", "n"),
              ("compare_set", "k", b"v", b"w"), ("compare_set", "k", b"x", b"y"),
              ("compare_set", "new", b"", b"z"), ("compare_set", "absent", b"e", b"f"),
              ("check", ["k", "n"]), ("check", ["k", "absent"]), ("wait", ["k", "new"]),
              ("wait", ["n"], timedelta(seconds=1)), ("num_keys",), ("delete_key", "k"),
              ("delete_key", "k"), ("num_keys",)]
    ours, theirs = _client(server.access), dist.HashStore()
    answers = [getattr(ours, op)(*args) for op, *args in script]
    assert answers == [getattr(theirs, op)(*args) for op, *args in script]
    assert answers[1:5] == [b"v", 3, 2, b"2"]


def test_keys_never_set_end_a_wait_or_get_in_a_store_error_at_its_timeout(server):
    client = _client(server.access, timeout_s=0.2)
    with pytest.raises(dist.DistStoreError, match=r"keys \['never'\] not set within 0.1 s$"):
        client.wait(["never"], timedelta(seconds=0.1))
    with pytest.raises(dist.DistStoreError, match=r"keys \['never'\] not set within 0.2 s$"):
        client.get("never")
    client.set("later", b"1")  # the connection still serves
    assert client.get("later") == b"1"


def test_a_client_with_the_wrong_secret_is_rejected_before_any_request(server):
    owner = _client(server.access)
    owner.set("rank0", b"10.0.0.1:5000")
    port = server.access.port
    with pytest.raises(PermissionError, match=f"^the rendezvous store at 127.0.0.1:{port} "
                                              "rejected this process's secret$"):
        _client(dataclasses.replace(server.access, secret=secrets.token_bytes(32)))
    assert owner.get("rank0") == b"10.0.0.1:5000" and owner.num_keys() == 1


@pytest.mark.parametrize("request_", [("set", ("rank0", b"theirs")), ("get", ("rank0", 1.0))])
def test_a_connection_without_the_secret_is_dropped_before_its_bytes_are_a_request(
        server, request_):
    """A peer that sends a well-formed request in place of the proof gets the rejection and
    nothing else: the key is neither written nor read."""
    owner = _client(server.access)
    owner.set("rank0", b"mine")
    body = pickle.dumps(request_)
    attempt = (FRAME.pack(len(body)) + body).ljust(NONCE_BYTES + PROOF_BYTES, b"\0")
    assert len(attempt) == NONCE_BYTES + PROOF_BYTES  # read whole: the server answers it
    with socket.create_connection((server.access.host, server.access.port)) as raw:
        reader = raw.makefile("rb")
        assert len(reader.read(NONCE_BYTES)) == NONCE_BYTES  # the challenge
        raw.sendall(attempt)
        assert reader.read(len(REJECTED)) == REJECTED
        assert reader.read() == b""  # the server closed the connection
    assert owner.get("rank0") == b"mine" and owner.num_keys() == 1


def test_a_client_refuses_a_server_that_cannot_prove_the_secret():
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        def admit_anyone() -> None:
            conn, _ = impostor.accept()
            with conn, conn.makefile("rb") as reader:
                conn.sendall(secrets.token_bytes(NONCE_BYTES))
                reader.read(NONCE_BYTES + PROOF_BYTES)
                conn.sendall(ACCEPTED + bytes(PROOF_BYTES))

        threading.Thread(target=admit_anyone, daemon=True).start()
        port = impostor.getsockname()[1]
        with pytest.raises(PermissionError, match=f"^the rendezvous store at 127.0.0.1:{port} "
                                                  "does not hold the generation's secret$"):
            _client(StoreAccess("127.0.0.1", port, secrets.token_bytes(32)))


def test_closing_the_store_fails_a_blocked_wait_at_once_and_ends_its_threads():
    server = rendezvous.serve("127.0.0.1")
    access = server.access
    waiter = _client(access)
    failures: list[BaseException] = []
    added = threading.Event()

    def wait_forever() -> None:
        waiter.add("waiting", 1)
        added.set()  # its answer read: the store may close now (before, the add could fail)
        try:
            waiter.wait(["never"], timedelta(seconds=600))  # past this test's deadline
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=wait_forever)
    thread.start()
    assert added.wait(30)
    server.close()
    thread.join()
    assert [type(e) for e in failures] == [dist.DistNetworkError]
    assert str(failures[0]).startswith(f"lost the rendezvous store at 127.0.0.1:{access.port} ")
    assert str(failures[0]).endswith("its generation has ended")
    assert not [t for t in threading.enumerate() if t.name == f"rendezvous-store:{access.port}"]
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect((access.host, access.port))
