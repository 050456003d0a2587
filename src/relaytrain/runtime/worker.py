"""The training worker: one process's model replica (or pipeline stage), optimizer, loader shard
and checkpoint writer, driven by the controller's coarse calls (`WorkerAPI`,
runtime/engines/base.py).

Engine-neutral on purpose: plain Python methods with plain arguments and results, driven by the
controller through an engine (in-process or Ray actors). Nothing here knows about Ray. The
worker delegates to its parts, each with its own state: its membership of a generation
(runtime/membership.py), its training state (train/state.py), its stepper (train/stepper.py),
its checkpoint writes (checkpoint/writer.py) and its evaluator (train/evaluate.py).
"""

from __future__ import annotations

import os
import socket
import time

import torch

from relaytrain.checkpoint.pieces import Piece
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.checkpoint.writer import AsyncCheckpointWriter, PartWrites
from relaytrain.config.sections import RunConfig
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.loader import Loader
from relaytrain.data.packing import train_split
from relaytrain.parallel.groups import Placement
from relaytrain.runtime.failures import carry_snapshot
from relaytrain.runtime.faults import RaiseHook
from relaytrain.runtime.kvstore import StoreAccess
from relaytrain.runtime.liveness import process_identity
from relaytrain.runtime.membership import Membership
from relaytrain.runtime.wire import ProcessIdentity, StepResult, WorkerInfo, WriteReport
from relaytrain.train.evaluate import Evaluator
from relaytrain.train.execution import pick_device, retain_freed_memory, set_determinism
from relaytrain.train.skip_step import SkipHistory
from relaytrain.train.state import Donation, TrainState
from relaytrain.train.stepper import Stepper, make_reducer, make_stepper


class Worker:
    """State lives in the parts between the controller's calls (setup, build, run_steps, ...)."""

    def __init__(self, cfg: RunConfig, tokenizer_vocab: int):
        self.cfg = cfg
        torch.set_num_threads(self.cfg.runtime.threads_per_worker)
        self.model_cfg = self.cfg.model_config(tokenizer_vocab)
        self.device = pick_device(self.cfg.train.device)
        set_determinism(self.device, self.cfg.determinism == "exact")
        retain_freed_memory()  # no page faults for buffers freed and re-allocated every step
        self.dataset = TokenDataset.open(self.cfg.data.path)
        self.train_split = train_split(self.dataset, self.cfg.seq_len, self.cfg.packing)
        self.membership = Membership(self.device)
        store = CheckpointStore(self.cfg.checkpoint_url, keep_last=self.cfg.checkpoint.keep_last)
        self.state = TrainState(self.cfg, self.model_cfg, self.device, store)
        self.writes = PartWrites(AsyncCheckpointWriter(store))
        self.evaluator = Evaluator(self.dataset, self.cfg.eval.sets)
        self.loader: Loader | None = None  # this generation's data shard (setup)
        self.stepper: Stepper | None = None  # for the state built in this generation (build)
        self.raise_hook = RaiseHook()  # faults.raise_at (see runtime/faults.py)
        self._identity = process_identity()  # fixed for the process: each ping answers it
        # The step the next run_steps must start at; None after a failed one, until the next
        # build: a step dispatched ahead (runtime/controller.py) must not run on a state its
        # predecessor left half-done, nor snapshot that state as the step before it.
        self._next_step: int | None = None

    # ---- membership ------------------------------------------------------------------------
    def ping(self) -> ProcessIdentity:
        return self._identity

    def info(self) -> WorkerInfo:
        return WorkerInfo(self._identity, socket.gethostname(), str(self.device))

    def setup(self, generation: int, placement: Placement | None,
              store: StoreAccess | None = None, timeout_s: float = 30.0) -> WorkerInfo | None:
        """Join generation `generation`: its process groups (through its rendezvous `store`)
        and this rank's data shard; this worker as it joined. `placement` None: the place it
        joined the last generation at (a survivor kept in its rank: the controller sends every
        such survivor one small call), answering None."""
        kept = placement is None
        if kept:
            if self.membership.placement is None:
                raise RuntimeError(f"generation {generation}: no placement given, and this "
                                   "worker joined no generation before")
            placement = self.membership.placement
        self.leave()
        self.membership.join(generation, placement, store, timeout_s)
        if self.loader is not None:
            self.loader.close()
        t = self.cfg.train
        self.loader = Loader(self.train_split, self.cfg.seq_len, self.cfg.data_seed,
                             t.global_batch, t.micro_batch, placement.dp_rank, placement.dp,
                             prefetch=self.cfg.data.prefetch, order=self.cfg.data.order)
        if placement.world > 1:
            print(f"[rank {placement.rank}] joined generation {generation}: dp rank "
                  f"{placement.dp_rank}/{placement.dp}, stage {placement.stage}/{placement.pp}, "
                  f"pid {os.getpid()}, {self.device}", flush=True)
        return None if kept else self.info()

    def abort(self, generation: int) -> bool:
        """See `Membership.abort` (called on the thread that answers pings)."""
        return self.membership.abort(generation)

    def leave(self) -> None:
        """Drop the current generation's process groups, and what lives on them: the stepper
        (its reducer and transport), and a sharded model."""
        sharded = self.membership.shard_group is not None
        self.membership.leave()
        self.stepper = None
        if sharded:  # a sharded model lives on its generation's groups
            self.state.drop()

    # ---- state -----------------------------------------------------------------------------
    def rejoin(self, generation: int, store: StoreAccess | None, timeout_s: float,
               step: int) -> None:
        """A survivor kept in its rank: `setup` at its place, then `build` from its own state
        of `step`, in one call (no build collective waits for the others)."""
        self.setup(generation, None, store, timeout_s)
        self.build(step)

    def build(self, step: int, given: Donation = None) -> int:
        """Fresh model and optimizer for this generation, holding the state after `step`
        (`TrainState.build` says from where), and the stepper that trains them. Returns the
        step restored."""
        m = self.membership
        self.state.build(step, given, m.layout, m.shard_group, m.generation)
        if m.replica_group is not None:
            # Sharded snapshots are taken at the end of a span (run_steps): one of the state
            # just restored, so a replacement holds one before its first span ends too.
            self.state.take_snapshot(step)
        dp = m.placement.dp if m.placement else 1
        reducer = make_reducer(self.cfg, self.state, m.dp_group(), m.replica_group, dp)
        cp = None if m.cp_group is None else (m.placement.cp_rank, m.cp_group)
        self.stepper = make_stepper(self.cfg, self.state, reducer, self.loader, m.groups, dp, cp)
        self._next_step = step + 1
        return step

    def warm_up(self) -> None:
        """See `TrainState.warm_up`: a spare or the standby builds its model ahead."""
        self.state.warm_up()

    def arm_fault(self, step: int) -> None:
        """Fault injection (faults.raise_at): raise InjectedFault when `step` starts."""
        self.raise_hook.arm(step)

    def snapshot_step(self) -> int | None:
        return self.state.snapshot_step()

    def snapshot_tensors(self, step: int) -> dict[str, torch.Tensor]:
        return self.state.snapshot_tensors(step)

    def snapshot_rows(self, step: int, shards: int, shard: int) -> dict[str, Piece]:
        return self.state.snapshot_rows(step, shards, shard)

    def take_snapshot(self, step: int) -> None:
        self.state.take_snapshot(step)

    # ---- training --------------------------------------------------------------------------
    def run_steps(self, first: int, count: int, history: SkipHistory | None = None
                  ) -> list[StepResult]:
        """Optimizer steps first .. first+count-1 (1-based; step k trains global batch k-1),
        compared with the steps before by `history` under optim.skip_spikes.

        One call may cover several steps: tiny steps amortise the call, and asynchronous
        pipeline schedules need a span to keep the pipeline full. A span ends drained, so its
        end is a consistent cut (the state a snapshot or checkpoint captures). A failed (or
        refused) span's error carries this worker's snapshot step (`carry_snapshot`): final
        until the next build, since no span runs before it."""
        try:
            return self._span(first, count, history)
        except Exception as e:
            self._next_step = None  # (a refused span's too)
            carry_snapshot(e, self.state.snapshot_step())
            raise

    def _span(self, first: int, count: int, history: SkipHistory | None) -> list[StepResult]:
        """`run_steps`' steps."""
        # Only a worker whose rows another also holds benefits (a DP or cp peer; under
        # sharding, the same shard of another replica): that copy outlives this process. A
        # sharded one is taken at the end of a span, when the span's collectives are done (at
        # its start, an abort after a peer's death raced with it, and the survivors' snapshots
        # disagreed).
        if first != self._next_step:
            raise RuntimeError(f"steps {first}..{first + count - 1} cannot run: "
                               + ("an earlier step of this generation failed"
                                  if self._next_step is None
                                  else f"the next step is {self._next_step}"))
        self._next_step = None  # until this span is done
        p, every = self.membership.placement, self.cfg.elastic.snapshot_every
        sharded = self.membership.shard_group is not None
        # another holds this worker's rows: another replica (sharded), else a DP or cp peer
        due = (p.dp // p.fsdp if sharded else p.dp * p.cp) > 1 and every > 0
        if due and not sharded and (first - 1) % every == 0:
            self.state.take_snapshot(first - 1)
        self.raise_hook.check(first, count)
        out = self.stepper.run(first, count, history)
        last = first + count - 1
        if due and sharded and last % every == 0:
            self.state.take_snapshot(last)
        out[-1].written = self.writes.collect(wait=False)
        self._next_step = last + 1
        return out

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, step: int, part: str, attempt: str) -> float:
        """Copy the state to host memory now; write it in the background as `part` (sharded:
        this shard's rows only) of the save `attempt`. Returns copy time."""
        t0 = time.perf_counter()
        p = self.membership.placement
        state, where = self.state.held(first=p is None or p.shard == 0)
        self.writes.submit(step, part, state, where, attempt)
        return time.perf_counter() - t0

    def flush_writes(self, timeout: float | None = None) -> list[WriteReport]:
        return self.writes.collect(wait=True, timeout=timeout)

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, sets: dict[str, list[int]]) -> dict[str, dict[int, float]]:
        p = self.membership.placement
        # A replica's shards run every forward together (each gathers parameters): they take
        # the replica's chunks, and its first shard reports.
        losses = self.evaluator.losses(sets, self.stepper.evaluate, p.replica, p.dp // p.fsdp)
        return {name: got if p.shard == 0 else {} for name, got in losses.items()}

    def close(self) -> None:
        self.writes.close()
        if self.loader is not None:
            self.loader.close()
        self.leave()
