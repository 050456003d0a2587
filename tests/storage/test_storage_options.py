"""relaytrain.storage: endpoints from the environment, secrets never shown, clear errors."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

from relaytrain import storage
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.storage import StorageError

ENDPOINT_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST",
                 "GOOGLE_APPLICATION_CREDENTIALS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENDPOINT_VARS:
        monkeypatch.delenv(name, raising=False)


def test_s3_endpoint_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    assert storage.storage_options("s3://b/x") == {"endpoint_url": "http://127.0.0.1:1"}
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")  # the S3-specific one wins
    assert storage.storage_options("s3://b/x") == {"endpoint_url": "http://127.0.0.1:2"}


def test_credentials_are_left_to_the_provider_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI")
    assert "wJalrXUtnFEMI" not in repr(storage.storage_options("s3://b/x"))


def test_gcs_emulator_needs_no_google_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    assert storage.storage_options("gs://b/x") == {"endpoint_url": "http://127.0.0.1:4443",
                                                   "token": "anon"}
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/etc/sa.json")
    assert storage.storage_options("gs://b/x")["token"] == "/etc/sa.json"


def test_explicit_options_merge_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    opts = storage.storage_options("s3://b", {"config_kwargs": {"read_timeout": 5},
                                              "client_kwargs": {"region_name": "eu-west-1"}})
    assert opts == {"endpoint_url": "http://127.0.0.1:2", "config_kwargs": {"read_timeout": 5},
                    "client_kwargs": {"region_name": "eu-west-1"}}
    assert storage.storage_options("/local/dir", {"auto_mkdir": True}) == {"auto_mkdir": True}


def test_redact_hides_credentials_in_urls_messages_and_options() -> None:
    assert storage.redact("https://user:pw@host:9000/b?X-Amz-Signature=abc&part=1") == \
        "https://***@host:9000/b?X-Amz-Signature=***&part=1"
    assert storage.redact("failed: GET http://k:s@h/o?token=t1 (503)") == \
        "failed: GET http://***@h/o?token=*** (503)"
    opts = {"key": "AKID", "secret": "S3CR3T", "endpoint_url": "http://127.0.0.1:9",
            "client_kwargs": {"aws_session_token": "T0K", "region_name": "us-east-1"}}
    assert storage.redact(opts) == {
        "key": "***", "secret": "***", "endpoint_url": "http://127.0.0.1:9",
        "client_kwargs": {"aws_session_token": "***", "region_name": "us-east-1"}}
    assert storage.redact("s3://bucket/ckpt") == "s3://bucket/ckpt"


def test_missing_backend_names_the_package_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now fails
    registry = importlib.import_module("fsspec.registry")._registry
    monkeypatch.delitem(registry, "s3", raising=False)  # nor cached by fsspec
    with pytest.raises(StorageError, match=r"s3:// .*needs s3fs.*relaytrain\[storage\]"):
        storage.filesystem("s3://bucket/ckpt")


@pytest.mark.parametrize(("exc", "transient"), [
    (ConnectionRefusedError(111, "refused"), True),
    (TimeoutError(), True),
    (OSError(5, "EIO"), True),
    (FileNotFoundError("gone"), False),
    (PermissionError("denied"), False),
    (ValueError("Bad Request"), False),
    # a full disk, a quota and a read-only file system do not pass with time: no backoff
    (OSError(28, "No space left on device"), False),
    (OSError(122, "Disk quota exceeded"), False),
    (OSError(30, "Read-only file system"), False),
])
def test_transient_errors_are_told_apart_from_permanent_ones(exc: BaseException,
                                                            transient: bool) -> None:
    assert storage.is_transient(exc) is transient


def test_client_library_errors_are_classified() -> None:
    import aiohttp
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError
    from gcsfs.retry import HttpError

    assert storage.is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert storage.is_transient(aiohttp.ServerDisconnectedError())
    assert storage.is_transient(HttpError({"code": 503, "message": "busy"}))
    assert not storage.is_transient(HttpError({"code": 400, "message": "bad"}))
    assert not storage.is_transient(NoCredentialsError())


@pytest.mark.timeout(60)
def test_secrets_never_reach_the_logs(s3_server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    store = CheckpointStore(s3_server.url("ckpt"))
    store.commit(1, {"model": store.write_part(1, "model", {"w": torch.ones(4)})}, {})
    store.read(1)
    assert caplog.records, "expected the client libraries to log at DEBUG"
    assert s3_server.SECRET_KEY not in caplog.text
