"""SIGKILL at random moments while checkpointing (whole parts and shards) never exposes a broken
checkpoint."""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from relaytrain.checkpoint.store import CheckpointStore, CheckpointWarning
from relaytrain.errors import CheckpointError

SERVER = Path(__file__).with_name("crash_writer.py")
_spec = importlib.util.spec_from_file_location("crash_writer", SERVER)
crash_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_writer)

KILLS = 25


def check_store(root: Path) -> tuple[list[int], list[int]]:
    """Every committed step loads, verifies and holds its step's values; no other step loads.

    Returns (committed steps, uncommitted step directories).
    """
    store = CheckpointStore(str(root))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # a skipped commit is a failure
        committed = store.committed_steps()
        for step in committed:
            manifest, tensors = store.read(step)
            assert manifest["fill"] == step
            expected = crash_writer.expected(step)  # whole tensors, sharded ones too
            assert tensors.keys() == expected.keys()
            for k, t in expected.items():
                assert tensors[k].dtype == t.dtype and torch.equal(tensors[k], t), (step, k)
        assert store.latest_step() == (committed[-1] if committed else None)
    uncommitted = sorted(int(d.name[5:]) for d in root.glob("step_*")
                         if int(d.name[5:]) not in committed)
    for step in uncommitted:
        with pytest.raises(CheckpointError):
            store.read(step)
    return committed, uncommitted


@pytest.mark.timeout(120)
def test_sigkill_while_writing_never_leaves_a_loadable_broken_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    rng = random.Random(20260514)
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen([sys.executable, str(SERVER), str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=log, text=True)
    torn = 0  # kills that left a half-written step behind
    progress = []
    try:
        # At least KILLS kills, and on until half of KILLS landed mid-write: under load a forked
        # writer may still be starting when its kill comes, which tests nothing.
        for kills in itertools.count(1):
            server.stdin.write("go\n")
            server.stdin.flush()
            line = server.stdout.readline()
            assert line, f"fork server died: {log.seek(0) or log.read()}"
            pid = int(line)
            time.sleep(rng.uniform(0.0, 0.5))
            os.kill(pid, signal.SIGKILL)
            status = int(server.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
                f"writer exited on its own: {log.seek(0) or log.read()}"
            committed, uncommitted = check_store(root)
            torn += bool(uncommitted or list(root.glob("**/*.tmp")))
            progress.append(committed[-1] if committed else 0)
            if kills >= 3 * KILLS or (kills >= KILLS and torn >= KILLS // 2):
                break
    finally:
        server.kill()
        server.wait()
    assert progress[-1] > KILLS  # writers made progress between kills
    assert torn >= KILLS // 2  # and at least half of KILLS landed mid-write
    # the next clean commit clears the debris the kills left
    store = CheckpointStore(str(root), keep_last=crash_writer.KEEP_LAST)
    step = progress[-1] + 1
    crash_writer.write(store, step)
    committed, uncommitted = check_store(root)
    assert len(committed) == crash_writer.KEEP_LAST and uncommitted == []
    assert not list(root.glob("**/*.tmp"))
