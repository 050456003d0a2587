"""Worker failures as typed exceptions: what the controller's recovery logic handles."""

from __future__ import annotations


class WorkerFailure(Exception):
    """A worker could not complete a call. `kind` says how it failed."""

    kind = "failed"

    def __init__(self, wid: int, message: str):
        super().__init__(f"worker {wid} {self.kind}: {message}")
        self.wid = wid  # the engine's worker id (the controller maps it to a rank)
        self.message = message


class WorkerDied(WorkerFailure):
    """The process is gone (SIGKILL, OOM, crash)."""

    kind = "died"


class WorkerRaised(WorkerFailure):
    """The worker raised an exception (e.g. a collective failed because a peer died)."""

    kind = "raised"


class WorkerHung(WorkerFailure):
    """The call passed its deadline (SIGSTOP, deadlock in a collective)."""

    kind = "hung"


class NodeLost(WorkerFailure):
    """The node holding the worker left the cluster."""

    kind = "lost its node"


# The failures that take a worker's process, which a recovery replaces (a survivor's collective
# error, a peer's death seen from its side, does not)
GONE = (WorkerDied, WorkerHung, NodeLost)


def carry_snapshot(error: BaseException, step: int | None) -> None:
    """Attach a worker's snapshot step to the error its failed (or refused) step call raises:
    once a step of a generation failed, the worker takes no snapshot before the next build, so
    the step is final for the recovery, which need not ask for it (a round of N answers)."""
    error.snapshot_held = (step,)  # type: ignore[attr-defined]


def carried_snapshot(error: BaseException) -> tuple[int | None] | tuple[()]:
    """The snapshot step `error` carries (`carry_snapshot`), as a 1-tuple; () if none."""
    return getattr(error, "snapshot_held", ())


class RecoveryLimitExceeded(RuntimeError):
    """Too many recoveries in the configured window: a crash loop, not a transient fault."""
