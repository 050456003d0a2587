"""A worker on the controller's host as its OS knows it: running (its CPU time), or stopped,
gone, or elsewhere, where only the ping deadline can judge it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from relaytrain.runtime.liveness import ProcessIdentity, cpu_ticks, process_identity

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux's /proc")]


@pytest.fixture
def child():
    """A Python process spinning on a CPU, and its identity as it reports it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import json, sys\n"
         "from relaytrain.runtime.liveness import process_identity\n"
         "print(json.dumps(process_identity()._asdict()), flush=True)\n"
         "while True: pass"], stdout=subprocess.PIPE, text=True)
    try:
        yield proc, ProcessIdentity(**json.loads(proc.stdout.readline()))
    finally:
        proc.kill()
        proc.wait()


def test_a_running_process_on_this_host_shows_its_cpu_time_growing(child):
    proc, identity = child
    assert identity.pid == proc.pid and identity.boot
    first = cpu_ticks(identity)
    deadline = time.monotonic() + 20
    while cpu_ticks(identity) == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cpu_ticks(identity) > first >= 0


def test_a_stopped_process_is_not_running_until_continued(child):
    proc, identity = child
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20
        while cpu_ticks(identity) is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # the stop lands asynchronously
        assert cpu_ticks(identity) is None
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while cpu_ticks(identity) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(cpu_ticks(identity), int)


def test_a_gone_recycled_or_remote_process_is_left_to_the_ping_deadline(child):
    proc, identity = child
    assert cpu_ticks(identity._replace(start=identity.start + 1)) is None  # recycled
    assert cpu_ticks(identity._replace(boot="another-host-or-boot")) is None
    assert cpu_ticks(identity._replace(boot=None)) is None
    assert cpu_ticks(None) is None and cpu_ticks(1234) is None  # no identity known
    proc.kill()
    proc.wait()
    assert cpu_ticks(identity) is None


def test_this_process_knows_itself():
    me = process_identity()
    assert me.pid == os.getpid()
    assert isinstance(cpu_ticks(me), int)
