"""What the controller needs from an engine: start workers, call them with a deadline, stop
them. Workers are named by an id the engine hands out (a rank can move to another worker after a
resize); failures come back as `WorkerFailure` exceptions naming the worker.

Calls are written against `WorkerAPI`, the worker's interface, as `lambda w: w.run_steps(1, 2)`:
the engine records the one method call the lambda makes, checks it against the interface (a
misspelt method or wrong arguments fail in the controller, before any worker is reached) and
runs it on each worker its own way (a direct call in process, a remote call on a Ray actor).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from relaytrain.runtime.failures import WorkerFailure

if TYPE_CHECKING:
    import torch

    from relaytrain.parallel.groups import Placement
    from relaytrain.runtime.kvstore import StoreAccess
    from relaytrain.runtime.wire import (
        ProcessIdentity,
        SkipHistory,
        StepResult,
        WorkerInfo,
        WriteReport,
    )


class WorkerAPI(Protocol):
    """The methods the controller may call on a worker (runtime/worker.py implements them)."""

    def ping(self) -> ProcessIdentity:
        """The worker process as the OS knows it (PID, start time, host boot), answered on a
        second thread, even mid-step."""

    def setup(self, generation: int, placement: Placement | None, store: StoreAccess | None,
              timeout_s: float) -> WorkerInfo | None:
        """Join a generation's process groups at `placement` and take its data shard; the
        worker as it joined. `placement` None: at the place it joined the last generation at
        (a survivor of a failure replaced in its rank), answering None (nothing new)."""

    def build(self, step: int, given: Any) -> int:
        """Hold the state after `step` (a peer's snapshot or pieces of it, own snapshot,
        checkpoint or seed)."""

    def rejoin(self, generation: int, store: StoreAccess | None, timeout_s: float,
               step: int) -> None:
        """`setup` at the place it joined the last generation at, then `build` from its own
        state of `step`: a survivor kept in its rank, one round of calls instead of two (at
        1,024 workers, a round's answers cost a recovery ~0.6 ms)."""

    def warm_up(self) -> None:
        """A standby spare builds its model ahead of a promotion."""

    def run_steps(self, first: int, count: int, history: SkipHistory | None = None
                  ) -> list[StepResult]:
        """Train steps first .. first+count-1 (`history`: optim.skip_spikes' window)."""

    def snapshot_step(self) -> int | None:
        """The step of the in-memory snapshot, if any."""

    def snapshot_tensors(self, step: int) -> dict[str, torch.Tensor]:
        """The in-memory snapshot of `step`, for a replacement to load."""

    def snapshot_rows(self, step: int, shards: int, shard: int) -> dict[str, Any]:
        """A shard's snapshot of `step`: its pieces of the rows shard `shard` of `shards`
        holds (for a worker of another layout to assemble its own)."""

    def take_snapshot(self, step: int) -> None:
        """Keep the current state (after `step`) in memory."""

    def save(self, step: int, part: str, attempt: str) -> float:
        """Start writing checkpoint part `part` of `step` in the background; `attempt` names
        this save of the step (its part records carry it)."""

    def flush_writes(self, timeout: float | None = None) -> list[WriteReport]:
        """Wait for every background write (at most `timeout` seconds: those still running
        stay pending); the finished ones' reports."""

    def evaluate(self, sets: dict[str, list[int]]) -> dict[str, dict[int, float]]:
        """Per evaluation set, the losses of this rank's share of its instances `ids`."""

    def abort(self, generation: int) -> bool:
        """Make `generation`'s collectives fail at once (called while a step is blocked)."""

    def arm_fault(self, step: int) -> None:
        """Fault injection: raise when `step` starts."""

    def close(self) -> None:
        """Finish writes and leave the process groups."""


WorkerCall = Callable[[WorkerAPI], Any]


class Invocation(NamedTuple):
    method: str
    args: tuple
    kwargs: dict[str, Any]


_SIGNATURES = {name: inspect.signature(fn) for name, fn in vars(WorkerAPI).items()
               if not name.startswith("_") and callable(fn)}
# The call shapes (method, positional count, keyword names) that bound: whether a call binds
# depends on its shape alone, so each is checked once (a recovery at 1,024 workers makes 1,024
# setup calls; binding each took it ~0.1 s)
_BOUND: set[tuple[str, int, tuple[str, ...]]] = set()


class _Recorder:
    """Stands in for a worker: records the method call a `WorkerCall` makes."""

    def __getattr__(self, name: str) -> Callable[..., Invocation]:
        if name not in _SIGNATURES:
            raise AttributeError(f"{name!r} is not a method of the worker interface "
                                 f"(WorkerAPI: {', '.join(sorted(_SIGNATURES))})")

        def record(*args: Any, **kwargs: Any) -> Invocation:
            shape = (name, len(args), tuple(kwargs))
            if shape not in _BOUND:
                _SIGNATURES[name].bind(None, *args, **kwargs)  # TypeError on a wrong call
                _BOUND.add(shape)
            return Invocation(name, args, kwargs)

        return record


def invocation(call: WorkerCall) -> Invocation:
    """The one checked method call `call` makes on a worker."""
    out = call(_Recorder())  # type: ignore[arg-type]
    if not isinstance(out, Invocation):
        raise TypeError("a worker call is one method call on the worker, e.g. "
                        "`lambda w: w.run_steps(1, 1)`")
    return out


class Engine(ABC):
    @abstractmethod
    def spawn(self, worker_args: tuple, wait: float) -> int:
        """Create one worker constructed with `worker_args`; its id. Raises `WorkerFailure` when
        it cannot be placed within `wait` seconds."""

    def spawn_many(self, n: int, worker_args: tuple, wait: float) -> list[int]:
        """`n` workers (an engine may start them concurrently)."""
        return [self.spawn(worker_args, wait) for _ in range(n)]

    def call(self, calls: dict[int, WorkerCall], timeout: float) -> dict[int, Any]:
        """Run each worker's call concurrently; results by worker id.

        Raises the first `WorkerFailure` seen; the other calls may still be running
        (`settle` waits for them). A call object given to several workers is checked once
        (at 1,024 workers, once per worker cost a recovery tens of milliseconds)."""
        checked = {c: invocation(c) for c in dict.fromkeys(calls.values())}
        # mapped without a Python step per worker (a recovery at 1,024 workers makes several)
        return self.run(dict(zip(calls, map(checked.__getitem__, calls.values()), strict=True)),
                        timeout)

    def call_all(self, wids: list[int], call: WorkerCall, timeout: float) -> dict[int, Any]:
        """The same call on every worker of `wids`."""
        inv = invocation(call)
        return self.run(dict.fromkeys(wids, inv), timeout)

    @abstractmethod
    def run(self, invocations: dict[int, Invocation], timeout: float) -> dict[int, Any]:
        """Carry out checked invocations (see `call`)."""

    def start_all(self, wids: list[int], call: WorkerCall, timeout: float) -> Any:
        """Dispatch the same call to every worker of `wids` without waiting for it; `finish`
        takes the handle. A worker runs its calls in the order they were started, so the
        controller can dispatch the next step while this one runs (dispatch ahead). `timeout`
        counts from `finish`. Here the call runs in `finish`: an engine that cannot queue
        calls stays strictly one call at a time."""
        inv = invocation(call)
        return dict.fromkeys(wids, inv), timeout

    def finish(self, started: Any) -> dict[int, Any]:
        """The results of a `start_all`; its failures are raised as `call`'s are (`settle`
        then also waits for the calls started after it)."""
        invocations, timeout = started
        return self.run(invocations, timeout)

    def settle(self, timeout: float) -> dict[int, WorkerFailure]:
        """Wait for calls still running after a failure: the workers among them whose process
        is gone (`failures.GONE`: dead, hung, its node lost, or not finished in time), each
        with its failure. The others' errors (a survivor's collective aborted by the failure)
        are left out: a recovery replaces only the gone, and at 1,024 workers building an
        error for every survivor cost it a millisecond."""
        return {}

    def carried_snapshots(self) -> dict[int, int | None]:
        """The snapshot steps that the failure's failed (or refused) step calls carried
        (`failures.carry_snapshot`), by worker, taken once after `settle`: the recovery asks
        only the others (at 1,024 workers, a round of answers costs it ~0.6 ms). Engines that
        do not keep them: none."""
        return {}

    def abort(self, wids: list[int], generation: int) -> None:
        """Ask each worker to abort `generation`'s collectives now, without waiting: a call
        blocked in one fails at once (runtime/abort.py). Engines of one worker have no peers
        to wait for."""
        return None

    def spawn_ready(self, worker_args: tuple) -> int | None:
        """A worker that is up now, taken without waiting for a process to start (a warm spare,
        a standby with a slot placed for it, one `prestart` started that is warm by now);
        None if there is none: the run then goes on without it (runtime/recovery.py). Engines
        that cannot start workers in the background place one here, at once or not at all."""
        try:
            return self.spawn(worker_args, 0.0)
        except WorkerFailure:
            return None

    def prestart(self, n: int = 1) -> None:
        """Have `n` workers starting in the background (placed whenever capacity allows) for
        the next `spawn` or `spawn_ready` to take, so that no one waits for their start-up.
        Engines without spares start them in `spawn`."""
        return None

    def cancel_starts(self) -> None:
        """Give up the workers `prestart` started beyond the configured spares (a run that
        stopped trying to grow back). Engines without spares have none."""
        return None

    def refill(self) -> None:
        """Start standby spares again after some were promoted (off the recovery path).
        Engines without spares have nothing to do."""
        return None

    def hold_capacity(self, wid: int, seconds: float) -> None:
        """When worker `wid` is killed, its slot stays occupied for `seconds` (fault
        injection: a lost node whose capacity does not come back at once): nothing started
        after the failure can take it first."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold capacity")

    @abstractmethod
    def pid(self, wid: int) -> int:
        """The worker's process id (to deliver real signals in fault injection)."""

    @abstractmethod
    def kill(self, wid: int) -> None:
        """Forcefully end a worker (a hung one, or one being replaced)."""

    def retire(self, wid: int) -> None:
        """End a failed worker whose replacement follows: an engine may keep its resources
        reserved for the replacement, which then needs no new placement."""
        self.kill(wid)

    @abstractmethod
    def store_host(self) -> str:
        """The address workers use to reach the controller's rendezvous store."""

    def processes(self) -> list[ProcessIdentity]:
        """The worker processes started, as they identified themselves (none in process)."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stop all workers and release the engine's resources."""
