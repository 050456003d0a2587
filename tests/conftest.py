"""Fixtures shared across the suite: a private cache directory (XDG_CACHE_HOME: the measured
`model.matmul` choice is not read from or written to the user's; the fused CPU kernels' build
is the host's) and real object-storage servers on 127.0.0.1.

Each test gets its own freshly started server process with one empty bucket, and the
environment (`AWS_ENDPOINT_URL_S3` + test keys, or `STORAGE_EMULATOR_HOST`) pointing
`relaytrain.storage` at it; the server is stopped and its files deleted when the test ends.
The server object can be paused, killed and started again for fault injection.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from relaytrain.model import cpu_kernels
from tests.storage.servers import GCSServer, LocalServer, S3Server


def _serve(cls: type[LocalServer], monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    server = cls()
    try:
        try:
            server.start()
        except Exception as e:  # a missing package (UserError) or a server that won't start
            pytest.fail(f"could not start the {cls.scheme}:// test server: {e}", pytrace=False)
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        yield server
    finally:
        server.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with multi-worker runs (a Ray cluster, tests/runtime) first, each file's tests in
    their order: `scripts/test.sh` hands whole files to its two processes in this order, so
    the long files start first and the short ones fill the end, not one process finishing a
    long file alone while the other has nothing left."""
    heavy = {item.path for item in items if "ray_cluster" in getattr(item, "fixturenames", ())
             or "runtime" in item.path.parts}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        # The fused CPU kernels' build stays the host's: built once, by whichever process asks
        # first (the suite or a user), and never a measured choice.
        mp.setenv("TORCH_EXTENSIONS_DIR", str(cpu_kernels.build_dir().parent))
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    """A moto S3-API server (objects in memory: lost when it is killed)."""
    yield from _serve(S3Server, monkeypatch)


@pytest.fixture
def gcs_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    """A fake-gcs-server GCS-API server (objects on disk: they survive a kill)."""
    yield from _serve(GCSServer, monkeypatch)


@pytest.fixture(params=["s3", "gs"])
def object_server(request: pytest.FixtureRequest) -> LocalServer:
    """Each object-storage server in turn."""
    return request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")


@pytest.fixture(scope="session")
def ray_session_end() -> Iterator[None]:
    """Stops the Ray cluster the session's tests share (tests/runtime/conftest.py), if one is
    running, when the session ends."""
    yield
    if "ray" in sys.modules:
        sys.modules["ray"].shutdown()
