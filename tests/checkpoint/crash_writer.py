"""Fork server for test_checkpoint_crash: forks checkpoint writers for the test to SIGKILL.

Importing torch takes seconds; forking a process that already has it takes milliseconds, so
the test can kill dozens of real writer processes at random moments. The server does no tensor
work itself, so forking it is safe. Protocol: for each line on stdin, fork a writer, print its
pid, wait for it to die and print its wait status.

Usage: python crash_writer.py ROOT
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

from relaytrain.checkpoint.store import CheckpointStore

NUMEL = 512 * 1024  # 2 MiB per float32 tensor: about 4 MiB per checkpoint
KEEP_LAST = 3


def expected(step: int) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint `step`'s parts: every value equals the step number."""
    return {
        "model": {"model.w": torch.full((NUMEL,), float(step)),
                  "model.norm": torch.full((7,), float(step), dtype=torch.bfloat16)},
        "optim": {"optim.w.exp_avg": torch.full((NUMEL,), float(step)),
                  "optim.w.step": torch.tensor(step, dtype=torch.int64)},
    }


def write_forever(root: str) -> None:
    store = CheckpointStore(root, keep_last=KEEP_LAST)
    step = max(store.committed_steps(), default=0) + 1
    while True:
        parts = {p: store.write_part(step, p, t) for p, t in expected(step).items()}
        store.commit(step, parts, {"fill": step})
        step += 1


def main() -> None:
    root = sys.argv[1]
    while sys.stdin.readline():
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(root)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)  # only an error gets here; never run the server's cleanup
        print(pid, flush=True)
        print(os.waitpid(pid, 0)[1], flush=True)


if __name__ == "__main__":
    main()
