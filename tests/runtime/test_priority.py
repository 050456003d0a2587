"""The standby's CPU priority: every thread of the process at SCHED_IDLE, threads started
later too, and every one back at SCHED_OTHER; where the kernel refuses, one warning and the
process goes on at its priority."""

from __future__ import annotations

import os
import threading

import pytest

from relaytrain.runtime import priority
from relaytrain.runtime.priority import policies, run_idle, run_normally

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")


def test_every_thread_goes_idle_and_back_threads_started_meanwhile_included():
    started, stop = threading.Event(), threading.Event()
    before = threading.Thread(target=stop.wait)
    before.start()
    try:
        assert run_idle()
        after = threading.Thread(target=lambda: (started.set(), stop.wait()))
        after.start()
        started.wait(10)
        assert len(policies()) >= 3
        assert set(policies().values()) == {os.SCHED_IDLE}
        assert set(policies(os.getpid()).values()) == {os.SCHED_IDLE}
    finally:
        assert run_normally()
        stop.set()
    assert set(policies().values()) == {os.SCHED_OTHER}


def test_a_refusal_is_one_warning_and_nothing_changes(monkeypatch):
    def refuse(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(priority.os, "sched_setscheduler", refuse)
    with pytest.warns(RuntimeWarning, match="normal priority") as warned:
        assert not run_idle()
    assert len(warned) == 1
    assert set(policies().values()) == {os.SCHED_OTHER}
