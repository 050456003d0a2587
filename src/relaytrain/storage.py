"""Object storage for checkpoints and data: the one place that turns a URL into a filesystem.

Local paths and any fsspec URL work; `s3://` needs s3fs and `gs://` needs gcsfs (the `storage`
extra). Endpoints come from the environment the AWS and Google tools already use
(`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, `STORAGE_EMULATOR_HOST`), so one exported variable
points every relaytrain process, and every Ray worker it starts, at the same server. Credentials
are left to the providers' own chains (`AWS_ACCESS_KEY_ID`..., `AWS_PROFILE`, `~/.aws`,
`GOOGLE_APPLICATION_CREDENTIALS`, instance metadata): relaytrain never copies a secret into its
options, and `redact` strips them from anything it prints or logs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

from relaytrain.errors import UserError

# URL scheme -> (package that implements it, what it is)
BACKENDS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "S3"), "s3a": ("s3fs", "S3"), "gs": ("gcsfs", "Google Cloud Storage"),
    "gcs": ("gcsfs", "Google Cloud Storage"),
}
INSTALL_HINT = "pip install 'relaytrain[storage]'"

# Option and query-parameter names whose values are credentials (matched case-insensitively
# as a substring, so `aws_secret_access_key`, `X-Amz-Security-Token`, `client_secret` match).
_SECRET_NAMES = re.compile(
    r"secret|token|password|passwd|credential|signature|session|private|^key$|access_key|"
    r"^sig$|authorization|api_?key", re.IGNORECASE)
_REDACTED = "***"
FULL_SUFFIX = ".full"  # beside a local root: its injected quota (charge_injected_quota)
PROBE_PREFIX = ".relaytrain-probe-"  # the object `probe_writable` writes and deletes
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


class StorageError(UserError):
    """Storage that cannot be used as configured: backend missing, bucket unreachable."""


def scheme(url: str) -> str:
    """The URL's scheme, lower case; "file" for a plain path."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", str(url))
    return m.group(1).lower() if m else "file"


def storage_options(url: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """fsspec options for `url`: endpoints from the environment, then `overrides` on top.

    Nested dicts (`client_kwargs`, `config_kwargs`) are merged key by key, so a config can
    add e.g. timeouts without repeating the endpoint.
    """
    backend = _backend(url)
    opts: dict[str, Any] = {}
    if backend == "s3fs":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
    elif backend == "gcsfs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator and emulator != "default":
            opts["endpoint_url"] = (emulator if "://" in emulator else f"http://{emulator}")
            # An emulator takes any request; without this gcsfs would try Google's metadata
            # server for a token. Explicit credentials still win.
            opts["token"] = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or "anon"
    return _merge(opts, overrides or {})


def filesystem(url: str, options: Mapping[str, Any] | None = None,
               ) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path within it) for `url` with `storage_options(url, options)`.

    Raises `StorageError` naming the package to install when the backend is missing.
    """
    opts = storage_options(url, options)
    try:
        if _backend(url) == "gcsfs" and "endpoint_url" in opts:
            # gcsfs's default class first asks the gRPC control plane for the bucket's layout,
            # which emulators do not serve (a minute-long timeout per bucket); the plain
            # JSON-API class is what an emulator speaks.
            from gcsfs.core import GCSFileSystem

            return GCSFileSystem(**opts), GCSFileSystem._strip_protocol(url)
        return fsspec.core.url_to_fs(url, **opts)
    except ImportError as e:
        raise StorageError(_missing_backend(url, e)) from None


def probe_writable(url: str) -> None:
    """A small object written under `url`, read back and deleted: what proves a location
    writable before a run spends compute. Directories made for it (a local path that does not
    exist yet) are removed again, so a refusal leaves nothing behind. Raises what the storage
    raised."""
    fs, root = filesystem(url)
    root = root.rstrip("/") or "/"
    made: list[str] = []
    try:
        if isinstance(fs, LocalFileSystem):
            missing = root
            while not os.path.lexists(missing):
                made.insert(0, missing)
                missing = os.path.dirname(missing)
            for d in made:
                os.mkdir(d)
        path = f"{root}/{PROBE_PREFIX}{secrets.token_hex(6)}"
        data = b"relaytrain writability probe\n"
        fs.pipe_file(path, data)
        try:
            if isinstance(fs, LocalFileSystem):
                charge_injected_quota(root, path)
            if fs.cat_file(path) != data:
                raise OSError(errno.EIO, "the probe object read back differs from what was "
                              "written")
        finally:
            fs.rm_file(path)
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)


def charge_injected_quota(root: str, path: str) -> None:
    """`faults.disk_full_at` (runtime/faults.py), seen by everything that writes under the
    local directory `root`: while `root + FULL_SUFFIX` holds a byte count, a file just written
    at `path` (not yet renamed into place) that takes the bytes under `root` past it fails
    with ENOSPC, as on a full disk; deleting files frees room again."""
    try:
        with open(root + FULL_SUFFIX) as f:
            quota = int(f.read())
    except (FileNotFoundError, ValueError):
        return
    used = local_bytes(root)
    if used > quota:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by "
                      f"faults.disk_full_at: {used} bytes > {quota})", path)


def local_bytes(root: str) -> int:
    """The bytes the files under the local directory `root` hold."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(root)
               for n in names if os.path.isfile(os.path.join(d, n)))


def is_space_error(exc: BaseException) -> bool:
    """Whether `exc` says the storage is full (ENOSPC, or a quota: EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def redact(value: Any) -> Any:
    """`value` with credentials replaced by "***": user:password in URLs, secret-looking query
    parameters (presigned URLs) and option keys, recursively through dicts and lists."""
    if isinstance(value, str):
        return _redact_url(value)
    if isinstance(value, Mapping):
        return {k: (_REDACTED if isinstance(k, str) and _SECRET_NAMES.search(k)
                    and v is not None else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def is_transient(exc: BaseException) -> bool:
    """Whether another attempt might succeed: connection refused or reset, timeouts, throttling
    and server errors, as raised by fsspec, s3fs (botocore) and gcsfs (aiohttp, google-auth).

    Missing files, permissions, bad requests, a full disk and a read-only file system are
    permanent: retrying with backoff does not free space (the writer frees it: `is_space_error`).
    """
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError,
                        IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return False
    if isinstance(exc, OSError):  # includes TimeoutError and aiohttp's connection errors
        return True
    if not isinstance(exc, Exception):
        return False
    status = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(status, int) and (status >= 500 or status in (408, 429)):
        return True  # gcsfs HttpError, aiohttp ClientResponseError
    return isinstance(exc, _transient_library_errors())


def _transient_library_errors() -> tuple[type[BaseException], ...]:
    """Connection-level error classes of the client libraries that are loaded (a library that
    was never imported raised nothing)."""
    found: list[type[BaseException]] = []
    names = {"botocore.exceptions": ("HTTPClientError", "ConnectionError"),
             "aiohttp": ("ClientConnectionError", "ClientPayloadError"),
             "requests.exceptions": ("ConnectionError", "Timeout", "ChunkedEncodingError"),
             "google.auth.exceptions": ("TransportError",)}
    for module, classes in names.items():
        mod = sys.modules.get(module)
        if mod is not None:
            found.extend(c for c in (getattr(mod, n, None) for n in classes)
                         if isinstance(c, type))
    return tuple(found)


def _backend(url: str) -> str:
    """The package behind `url`'s scheme if it is an object store, else ""."""
    return BACKENDS.get(scheme(url), ("", ""))[0]


def _missing_backend(url: str, err: ImportError) -> str:
    s = scheme(url)
    if s in BACKENDS:
        package, what = BACKENDS[s]
        return f"{s}:// ({what}) needs {package}, which is not installed: {INSTALL_HINT}"
    return f"{redact(url)}: no filesystem for {s}:// ({one_line(err)})"


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _redact_url(text: str) -> str:
    """`text` with every URL in it redacted (a whole URL, or URLs inside a message)."""
    return _URL.sub(lambda m: _redact_one_url(m.group(0)), text)


def _redact_one_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{_REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        query = urlencode([(k, _REDACTED if _SECRET_NAMES.search(k) else v)
                           for k, v in parse_qsl(query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def one_line(err: BaseException) -> str:
    """An error as one redacted line of at most 300 characters, for the CLI."""
    return redact(" ".join(str(err).split()))[:300]
