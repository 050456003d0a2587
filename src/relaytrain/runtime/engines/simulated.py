"""Simulated workers: the control plane measured and tested at 1,024 workers on one machine.

Not a `runtime.engine` choice: the control-plane benchmark (bench/control_plane.py) and tests
give it to `Controller(engine=...)`. Every worker of the run lives in one host process beside
the controller and answers the real calls (setup, build, run_steps, snapshots, save, ...) with
the real wire types (runtime/wire.py), pickled as Ray would (a call once for all the workers
it goes to, each worker's answer on its own): the
controller's own code runs unchanged, its step loop, reporter, ledger, catalogue and recovery
included. What a worker does not do is train: a step takes a fixed `step_s` (the host builds the
workers' results within it), its ids are the loader's (so the ledger audits), its losses a
function of the step; a checkpoint part is a real, one-number file.

A worker runs its calls in the order they were started, one at a time; the host measures how
long its workers sat idle between consecutive steps (the controller's gap) and whether building
the results ever outran the step time. `fail` plans a failure (a death or a raise) for a
rank at a step; the other workers of that step fail as a collective aborted by a lost peer does.
A new worker is up `start_s` after it was asked for (`prestart`, or `spawn`), as a process's
start-up would be, so that a recovery that need not wait for one goes on without it, as on Ray.
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.config.sections import RunConfig
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.loader import Loader
from relaytrain.parallel.groups import Placement
from relaytrain.runtime.engines.base import Engine, Invocation, invocation
from relaytrain.runtime.failures import WorkerDied, WorkerFailure, WorkerRaised
from relaytrain.runtime.wire import (
    ProcessIdentity,
    StepResult,
    WorkerInfo,
    WriteReport,
    steps_from_wire,
    steps_to_wire,
)

# A simulated worker's "pid": above Linux's largest (2**22), so a signal sent to it (an injected
# kill_at) reaches no process.
PID_BASE = 5_000_000


class _Died(Exception):
    """The simulated process is gone."""


class _SimWorker:
    """One worker's answers to the controller's calls (the `WorkerAPI` it uses)."""

    def __init__(self, wid: int, cfg: RunConfig, split: Any, store: CheckpointStore):
        self.wid, self.cfg, self.split, self.store = wid, cfg, split, store
        self.placement: Placement | None = None
        self.loader: Loader | None = None
        self.next_step: int | None = None  # None: unbuilt, or after a failed step
        self.snapshot: int | None = None
        self.done: list[WriteReport] = []

    def ping(self) -> ProcessIdentity:
        return ProcessIdentity(pid=PID_BASE + self.wid, start=0, boot=None)

    def setup(self, generation: int, placement: Placement | None, store: Any, timeout_s: float
              ) -> WorkerInfo | None:
        if placement is None:  # the same place: the same loader
            self.next_step = None
            return None
        t = self.cfg.train
        if self.loader is None or (self.placement.dp_rank, self.placement.dp) != \
                (placement.dp_rank, placement.dp):
            self.loader = Loader(self.split, self.cfg.seq_len, self.cfg.data_seed,
                                 t.global_batch, t.micro_batch, placement.dp_rank, placement.dp,
                                 prefetch=0, order=self.cfg.data.order)
        self.placement, self.next_step = placement, None
        return WorkerInfo(self.ping(), "simulated", "cpu")

    def build(self, step: int, given: Any = None) -> int:
        self.next_step = step + 1
        return step

    def rejoin(self, generation: int, store: Any, timeout_s: float, step: int) -> None:
        self.setup(generation, None, store, timeout_s)
        self.build(step)

    def begin(self, first: int) -> None:
        """What a worker does before its steps run, as runtime/worker.py does it."""
        if first != self.next_step:
            raise RuntimeError(f"steps {first}..: the next step is {self.next_step}")
        self.next_step = None  # until the steps are done
        every = self.cfg.elastic.snapshot_every
        if self.placement.dp > 1 and every and (first - 1) % every == 0:
            self.snapshot = first - 1

    def run_steps(self, first: int, count: int, history: Any = None) -> list[tuple]:
        self.begin(first)
        m = self.loader.micro_indices
        out = []
        for step in range(first, first + count):
            loss = 10.0 / (1.0 + step / 100)
            out.append(StepResult(step=step, losses={j: (loss, loss, 0.0) for j in m},
                                  grad_norm=1.0, finite=True,
                                  ids=self.loader.ids(step - 1).tolist(), time_data=0.0,
                                  time_compute=0.0))
        out[-1].written, self.done = self.done, []
        self.next_step = first + count
        return steps_to_wire(out)  # as the Ray actor sends them (engines/ray.py)

    def snapshot_step(self) -> int | None:
        return self.snapshot

    def snapshot_tensors(self, step: int) -> dict[str, torch.Tensor]:
        return {"step": torch.tensor([step])}

    def take_snapshot(self, step: int) -> None:
        self.snapshot = step

    def save(self, step: int, part: str, attempt: str) -> float:
        info = self.store.write_part(step, part, {"step": torch.tensor([step])},
                                     attempt=attempt)
        self.done.append(WriteReport(step, part, info))
        return 0.0

    def flush_writes(self, timeout: float | None = None) -> list[WriteReport]:
        done, self.done = self.done, []
        return done

    def abort(self, generation: int) -> bool:
        return True

    def warm_up(self) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass
class _Plan:
    """Failures planned by `SimulatedEngine.fail`: step -> (rank, "died" | "raised")."""

    at: dict[int, tuple[int, str]] = field(default_factory=dict)


class _Host:
    """The workers, in the host process: carries out each batch of calls, times the steps."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.workers: dict[int, _SimWorker] = {}
        self.dead: set[int] = set()
        self.plan = _Plan()
        self.split: Any = None
        self.store: CheckpointStore | None = None
        self.last_end: float | None = None  # when the last batch of steps ended
        self.idle: list[float] = []  # each gap between consecutive batches of steps
        self.overruns = 0  # batches whose results took longer to build than the step time

    def spawn(self, wids: list[int], worker_args: tuple) -> None:
        cfg = worker_args[0]
        if self.split is None:
            self.split = TokenDataset.open(cfg.data.path).split("train")
            self.store = CheckpointStore(cfg.checkpoint_url)
        for w in wids:
            self.workers[w] = _SimWorker(w, cfg, self.split, self.store)

    def serve(self, arrived: float, calls: dict[int, bytes]
              ) -> tuple[dict[int, bytes], dict[int, tuple[str, str, tuple]]]:
        """The workers' answers: each result pickled on its own, and the failures (kind,
        message, the snapshot step a failed step call carries: `_carried`)."""
        invs = {w: pickle.loads(b) for w, b in calls.items()}
        steps = [i for i in invs.values() if i.method == "run_steps"]
        start = max(arrived, self.last_end or 0.0)
        if steps and self.last_end is not None:
            self.idle.append(start - self.last_end)
        failing = self._failing(invs) if steps else None
        out = {w: self._one(w, inv, failing) for w, inv in invs.items()}
        if steps and all(a[0] != "ok" for a in out.values()):
            steps = []  # refused at once (steps after a failed one): no step time passes
        if steps:
            end = start + self.step_s * steps[0].args[1]
            now = time.monotonic()
            self.overruns += now > end
            time.sleep(max(0.0, end - now))
            self.last_end = max(end, now)
        else:
            self.last_end = None  # steps after another call are not consecutive
        return ({w: a[1] for w, a in out.items() if a[0] == "ok"},
                {w: a for w, a in out.items() if a[0] != "ok"})

    def _failing(self, invs: dict[int, Invocation]) -> tuple[int, str] | None:
        """The worker and kind of a failure planned within these steps."""
        first, count = next(iter(invs.values())).args[:2]
        for step in range(first, first + count):
            if step in self.plan.at:
                rank, kind = self.plan.at.pop(step)
                ranks = {self.workers[w].placement.rank: w for w in invs}
                return ranks[rank % len(ranks)], kind
        return None

    def _one(self, w: int, inv: Invocation, failing: tuple[int, str] | None) -> tuple:
        if w in self.dead or w not in self.workers:
            return ("died", "the simulated worker is gone", ())
        worker = self.workers[w]
        if failing is not None:
            if worker.next_step == inv.args[0]:
                worker.begin(inv.args[0])  # then its step fails: nothing runs until a build
            worker.next_step = None
            if failing == (w, "died"):
                self.dead.add(w)
                return ("died", "killed by SimulatedEngine.fail", ())
            return ("raised", "RuntimeError: injected by SimulatedEngine.fail"
                    if failing[0] == w else "RuntimeError: the collective was aborted",
                    (worker.snapshot,))
        try:
            return ("ok", pickle.dumps(getattr(worker, inv.method)(*inv.args, **inv.kwargs)))
        except Exception as e:
            worker.next_step = None
            return ("raised", f"{type(e).__name__}: {e}", _carried(worker, inv))

    def control(self, kind: str, payload: Any) -> Any:
        if kind == "spawn":
            self.spawn(*payload)
        elif kind == "kill":
            self.dead.add(payload)
            self.workers.pop(payload, None)
        elif kind == "fail":
            step, rank, how = payload
            self.plan.at[step] = (rank, how)
        elif kind == "stats":
            idle, self.idle = self.idle, []
            overruns, self.overruns = self.overruns, 0
            return {"idle_s": idle, "overruns": overruns}
        return None


def _serve(conn: Any, step_s: float) -> None:
    """The host process: a reader thread stamps each message as it arrives (the controller's
    send never waits for a sleeping host), the main thread answers them in order."""
    torch.set_num_threads(1)
    inbox: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                msg = None
            inbox.put((time.monotonic(), msg))
            if msg is None:
                return

    threading.Thread(target=read, daemon=True).start()
    host = _Host(step_s)
    while (item := inbox.get())[1] is not None:
        arrived, (seq, kind, payload) = item
        try:
            answer = ("ok", host.serve(arrived, payload) if kind == "call"
                      else host.control(kind, payload))
        except Exception as e:  # a bug of the simulation: the controller raises it
            answer = ("error", f"{type(e).__name__}: {e}")
        conn.send((seq, answer))


def _failure(wid: int, kind: str, message: str) -> WorkerFailure:
    return (WorkerDied if kind == "died" else WorkerRaised)(wid, message)


def _carried(worker: _SimWorker, inv: Invocation) -> tuple[int | None] | tuple[()]:
    """What a failed call's error carries, as runtime/worker.py's: a step call's, the
    worker's snapshot step (`failures.carry_snapshot`)."""
    return (worker.snapshot,) if inv.method == "run_steps" else ()


def _snapshots(failed: dict[int, tuple[str, str, tuple]]) -> dict[int, int | None]:
    """The snapshot steps a batch's failed calls carried, by worker."""
    return {w: f[2][0] for w, f in failed.items() if f[2]}


class SimulatedEngine(Engine):
    """N simulated workers in one host process (see the module docstring)."""

    def __init__(self, step_s: float = 0.0, capacity: int | None = None,
                 start_s: float = 0.0):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._host = ctx.Process(target=_serve, args=(child, step_s), daemon=True,
                                 name="relaytrain-simulated-workers")
        self._host.start()
        child.close()
        self.capacity = capacity  # workers that can still be placed (None: no limit)
        self.start_s = start_s  # how long a new worker takes to come up
        self._starting: list[tuple[float, int]] = []  # (up at, worker) started ahead
        self._wanted = 0  # how many `prestart` asked for, placed once capacity allows
        self._worker_args: tuple | None = None
        self._ids = itertools.count()
        self._seqs = itertools.count()
        self._replies: dict[int, Any] = {}
        self._started: list[int] = []  # batches of calls started, not yet finished
        self._outstanding: list[int] = []  # after a failure: the batches `settle` waits for
        self._carried: dict[int, int | None] = {}  # see `carried_snapshots`
        self.waited_s = 0.0  # how long the controller has waited for answers
        self._steps: set[int] = set()  # the batches of calls that are steps
        # when each batch of steps' results were taken: the time, the time waited by then,
        # and this process's CPU time (the controller's, unlike wall time, whatever the load)
        self.step_marks: list[tuple[float, float, float]] = []
        self.idle_s: list[float] = []  # each gap between consecutive steps (at shutdown)
        self.overruns = 0  # steps whose results took longer to build than the step time

    # ---- the host --------------------------------------------------------------------------
    def _send(self, kind: str, payload: Any) -> int:
        seq = next(self._seqs)
        self._conn.send((seq, kind, payload))
        return seq

    def _answer(self, seq: int) -> Any:
        t0 = time.perf_counter()
        while seq not in self._replies:
            got, answer = self._conn.recv()
            self._replies[got] = answer
        self.waited_s += time.perf_counter() - t0
        status, value = self._replies.pop(seq)
        if status != "ok":
            raise RuntimeError(f"the simulated workers' host failed: {value}")
        return value

    def _control(self, kind: str, payload: Any = None) -> Any:
        return self._answer(self._send(kind, payload))

    def fail(self, step: int, rank: int, kind: str = "died") -> None:
        """Rank `rank` fails at `step` ("died": its process is gone; "raised")."""
        self._control("fail", (step, rank, kind))

    def _stats(self) -> None:
        got = self._control("stats")
        self.idle_s += got["idle_s"]
        self.overruns += got["overruns"]

    # ---- the engine ------------------------------------------------------------------------
    def spawn(self, worker_args: tuple, wait: float) -> int:
        """One started ahead (waited for until it is up), else a new one, up after
        `start_s`."""
        self._worker_args = worker_args
        self._place()
        if not self._starting:
            self.prestart(1)
        if not self._starting or self._starting[0][0] > time.monotonic() + wait:
            raise WorkerDied(-1, f"no capacity (simulated) within {wait:g}s")
        up, wid = self._starting.pop(0)
        self._wanted = max(self._wanted - 1, 0)
        time.sleep(max(0.0, up - time.monotonic()))
        return wid

    def spawn_ready(self, worker_args: tuple) -> int | None:
        self._worker_args = worker_args
        self._place()
        if not self._starting or self._starting[0][0] > time.monotonic():
            return None
        self._wanted = max(self._wanted - 1, 0)
        return self._starting.pop(0)[1]

    def prestart(self, n: int = 1) -> None:
        self._wanted = max(self._wanted, n)
        self._place()

    def _place(self) -> None:
        """Start the workers `prestart` asked for, as capacity allows."""
        while len(self._starting) < self._wanted and self._worker_args is not None \
                and (self.capacity is None or self.capacity > 0):
            if self.capacity is not None:
                self.capacity -= 1
            [wid] = self.spawn_many(1, self._worker_args, 0.0)
            self._starting.append((time.monotonic() + self.start_s, wid))

    def cancel_starts(self) -> None:
        for _, wid in self._starting:
            self.kill(wid)
        self._starting, self._wanted = [], 0

    def spawn_many(self, n: int, worker_args: tuple, wait: float) -> list[int]:
        self._worker_args = worker_args
        wids = [next(self._ids) for _ in range(n)]
        self._control("spawn", (wids, worker_args))
        return wids

    def run(self, invocations: dict[int, Invocation], timeout: float) -> dict[int, Any]:
        return self.finish(self._start(invocations))

    def start_all(self, wids: list[int], call: Callable, timeout: float) -> int:
        inv = invocation(call)
        return self._start(dict.fromkeys(wids, inv))

    def _start(self, invocations: dict[int, Invocation]) -> int:
        # one pickling per distinct call (start_all's one call to every worker: a broadcast;
        # the message refers to it from every worker's entry), mapped without a Python step
        # per worker
        invs = invocations.values()
        distinct = dict(zip(map(id, invs), invs, strict=True))
        blobs = {k: pickle.dumps(i) for k, i in distinct.items()}
        seq = self._send("call", dict(zip(invocations, map(blobs.__getitem__, map(id, invs)),
                                          strict=True)))
        self._started.append(seq)
        if any(i.method == "run_steps" for i in distinct.values()):
            self._steps.add(seq)
        return seq

    def finish(self, started: int) -> dict[int, Any]:
        self._started.remove(started)
        ok, failed = self._answer(started)
        if failed:
            self._outstanding, self._started = self._started, []
            self._carried = _snapshots(failed)  # this failure's, the one raised included
            w, (kind, message, _) = min(failed.items(),
                                        key=lambda f: (f[1][0] != "died", f[0]))
            raise _failure(w, kind, message)
        # each worker's answer unpickled on its own, as Ray's get of a list of results does
        answers = map(pickle.loads, ok.values())
        if started not in self._steps:
            return dict(zip(ok, answers, strict=True))
        results = dict(zip(ok, steps_from_wire(answers), strict=True))
        self._steps.discard(started)
        self.step_marks.append((time.perf_counter(), self.waited_s, time.process_time()))
        return results

    def settle(self, timeout: float) -> dict[int, WorkerFailure]:
        out: dict[int, WorkerFailure] = {}
        for seq in self._outstanding:
            failed = self._answer(seq)[1]
            self._carried |= _snapshots(failed)
            for w, (kind, message, _) in failed.items():
                if kind == "died" and w not in out:
                    out[w] = _failure(w, kind, message)
        self._outstanding = []
        return out

    def carried_snapshots(self) -> dict[int, int | None]:
        carried, self._carried = self._carried, {}
        return carried

    def pid(self, wid: int) -> int:
        return PID_BASE + wid

    def kill(self, wid: int) -> None:
        self._control("kill", wid)

    def store_host(self) -> str:
        return "127.0.0.1"

    def shutdown(self) -> None:
        if self._host.is_alive():
            self._stats()
            self._conn.send(None)
            self._host.join(10)
        self._conn.close()
