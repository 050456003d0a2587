"""The worker's checkpoint writes as the controller collects them (the rest of the worker is
exercised through real runs: test_train.py, test_elastic.py)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from relaytrain.runtime.wire import WriteReport
from relaytrain.runtime.worker import Worker

pytestmark = pytest.mark.timeout(30)


def _worker_writing(*futures: Future) -> Worker:
    w = object.__new__(Worker)  # only the writes' bookkeeping is used
    w._pending = [(4, f"part{i}", f) for i, f in enumerate(futures)]
    return w


def test_a_bounded_flush_reports_the_finished_writes_and_keeps_the_rest_pending():
    """Recovery waits for the survivors' writes no longer than for storage: a write stuck on
    unresponsive storage stays pending instead of holding the call past its deadline."""
    done, stuck = Future(), Future()
    done.set_result({"file": "part0.safetensors"})
    w = _worker_writing(done, stuck)
    assert w.flush_writes(timeout=0.05) == [WriteReport(4, "part0",
                                                        info={"file": "part0.safetensors"})]
    stuck.set_exception(OSError("storage unreachable"))
    assert w.flush_writes() == [WriteReport(4, "part1", error="OSError: storage unreachable")]
    assert w.flush_writes() == []
