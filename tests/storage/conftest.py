"""Instrumentation for the object-storage tests."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlencode

import aiohttp
import pytest

from tests.runtime.conftest import corpus_data  # noqa: F401  (a shared fixture)


class HttpLog(list):
    """(method, url with query) of every request sent, in order; `hook(method, url)`, if set,
    runs just before each request leaves (on the client's event-loop thread)."""

    hook: Callable[[str, str], None] | None = None


@pytest.fixture
def http_requests(monkeypatch: pytest.MonkeyPatch) -> HttpLog:
    """Every HTTP request s3fs (aiobotocore) and gcsfs send.

    Both clients go through `aiohttp.ClientSession._request`, so this sees what reaches the
    server, whichever fsspec call or retry sent it.
    """
    log = HttpLog()
    original = aiohttp.ClientSession._request

    async def logged(self, method, url, *args, **kwargs):
        query = urlencode(kwargs.get("params") or {})  # gcsfs passes the query separately
        entry = (method, f"{url}?{query}" if query else str(url))
        log.append(entry)
        if log.hook is not None:
            log.hook(*entry)
        return await original(self, method, url, *args, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "_request", logged)
    return log

