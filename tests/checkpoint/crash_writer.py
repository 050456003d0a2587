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


def parts(step: int) -> dict[str, tuple[dict[str, torch.Tensor], dict | None]]:
    """Checkpoint `step`'s parts and their shard records: every value equals the step number.
    `model.w` is written as two shards (a sharded run's workers), the rest whole."""
    w, half = torch.full((NUMEL,), float(step)), NUMEL // 2
    return {
        "shard0": ({"model.w": w[:half].clone(),
                    "model.norm": torch.full((7,), float(step), dtype=torch.bfloat16)},
                   {"model.w": {"shape": [NUMEL], "rows": [0, half]}}),
        "shard1": ({"model.w": w[half:].clone()},
                   {"model.w": {"shape": [NUMEL], "rows": [half, NUMEL]}}),
        "optim": ({"optim.w.exp_avg": torch.full((NUMEL,), float(step)),
                   "optim.w.step": torch.tensor(step, dtype=torch.int64)}, None),
    }


def expected(step: int) -> dict[str, torch.Tensor]:
    """What a reader gets of checkpoint `step`: whole tensors."""
    return {"model.w": torch.full((NUMEL,), float(step)),
            **{k: t for p, (ts, _) in parts(step).items() if p != "shard1"
               for k, t in ts.items() if k != "model.w"}}


def write(store: CheckpointStore, step: int) -> None:
    records = {p: store.write_part(step, p, t, shards) for p, (t, shards) in parts(step).items()}
    store.commit(step, records, {"fill": step})


def write_forever(root: str) -> None:
    store = CheckpointStore(root, keep_last=KEEP_LAST)
    step = max(store.committed_steps(), default=0) + 1
    while True:
        write(store, step)
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
