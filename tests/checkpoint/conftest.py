"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest


class SlowRanges:
    """Stands in for a filesystem's `cat_file`: ranged reads take `delay` seconds each and are
    recorded (`calls`: (start, end) in order of arrival; `most`: the most in flight at once),
    so a test sees how a reader splits a file and how many requests it keeps outstanding."""

    def __init__(self, cat_file: Callable[..., bytes], delay: float):
        self._cat_file, self._delay = cat_file, delay
        self._lock, self._running = threading.Lock(), 0
        self.calls: list[tuple[int, int]] = []
        self.most = 0

    def __call__(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is None:  # a whole file (a manifest)
            return self._cat_file(path)
        with self._lock:
            self.calls.append((start, end))
            self._running += 1
            self.most = max(self.most, self._running)
        time.sleep(self._delay)
        with self._lock:
            self._running -= 1
        return self._cat_file(path, start=start, end=end)


@pytest.fixture
def slow_ranges(monkeypatch: pytest.MonkeyPatch) -> Callable[..., SlowRanges]:
    """`slow_ranges(fs, delay=0.02)`: `fs.cat_file` replaced by a `SlowRanges` for the test."""
    def install(fs: Any, delay: float = 0.02) -> SlowRanges:
        fake = SlowRanges(fs.cat_file, delay)
        monkeypatch.setattr(fs, "cat_file", fake)
        return fake
    return install
