"""Prepared data sets on object storage (s3://, gs://, any fsspec URL).

Token files are memory-mapped, so a remote data set is copied once into a local cache and
read from there. The remote `index.json` (written last by `data prepare`) is the commit marker
and lists the size and sha256 of every file: each copied file is verified against it, the copy
is assembled in a temporary directory and renamed into place, and a cache whose index matches
the remote one is reused without downloading anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from relaytrain.errors import DataError
from relaytrain.storage import filesystem, redact

INDEX = "index.json"
CHUNK = 8 << 20


def cache_root() -> Path:
    return Path(os.environ.get("RELAYTRAIN_CACHE", Path.home() / ".cache" / "relaytrain"))


def fetch_prepared(url: str) -> Path:
    """A verified local copy of the prepared data set at `url`."""
    fs, root = filesystem(url)
    shown = redact(url)
    try:
        raw = fs.cat_file(f"{root.rstrip('/')}/{INDEX}")
        index = json.loads(raw)
        files = index["files"]
    except FileNotFoundError:
        raise DataError(f"data dir {shown} has no {INDEX}; expected a directory written by "
                        "`relaytrain data prepare`") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{shown}/{INDEX}: corrupt ({e}); re-run relaytrain data prepare") \
            from None
    except OSError as e:
        raise DataError(f"data dir {shown}: unreadable ({type(e).__name__}: {e})") from None
    local = cache_root() / "data" / hashlib.sha256(url.encode()).hexdigest()[:20]
    if (local / INDEX).is_file() and (local / INDEX).read_bytes() == raw:
        return local
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=local.parent))
    try:
        for name, meta in sorted(files.items()):
            if "/" in name or name.startswith("."):
                raise DataError(f"{shown}/{INDEX}: unsafe file name {name!r}")
            digest = hashlib.sha256()
            size = 0
            with fs.open(f"{root.rstrip('/')}/{name}", "rb") as src, \
                    open(tmp / name, "wb") as dst:
                while block := src.read(CHUNK):
                    digest.update(block)
                    size += len(block)
                    dst.write(block)
            if size != meta["size"] or digest.hexdigest() != meta["sha256"]:
                raise DataError(f"{shown}/{name}: size or sha256 does not match {INDEX}; the "
                                "remote data set is corrupt or being rewritten")
        (tmp / INDEX).write_bytes(raw)  # last: the local copy's commit marker
        if local.exists():
            shutil.rmtree(local)
        os.replace(tmp, local)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return local
