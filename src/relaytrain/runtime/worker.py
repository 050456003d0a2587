"""The training worker: one process's model replica (or pipeline stage), optimizer, loader shard
and checkpoint writer.

Engine-neutral on purpose: plain Python methods with plain arguments and results, driven by the
controller through an engine (in-process or Ray actors). Nothing here knows about Ray.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent import futures
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from relaytrain.checkpoint.keys import model_key, optim_key, tensor_param
from relaytrain.checkpoint.pieces import Piece, Rows, assemble, cut
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.checkpoint.writer import AsyncCheckpointWriter, snapshot_to_host
from relaytrain.config import RunConfig, config_from_dict
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.eval_sets import open_eval_sets
from relaytrain.data.loader import Loader
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3
from relaytrain.model.stages import build_stage, partition_layers
from relaytrain.parallel.groups import PipelineGroups, Placement, form_groups, form_shard_groups
from relaytrain.parallel.reduce import GradReducer
from relaytrain.parallel.shards import (
    assign_,
    chunk_rows,
    local_tensor,
    own_rows,
    shard_pieces,
)
from relaytrain.runtime import rendezvous
from relaytrain.runtime.abort import (
    GroupSockets,
    abort_groups,
    keep_process_on_collective_errors,
)
from relaytrain.runtime.faults import RaiseHook
from relaytrain.runtime.kvstore import Client, StoreAccess
from relaytrain.runtime.liveness import process_identity
from relaytrain.runtime.wire import StepResult, WriteReport
from relaytrain.train.evaluate import heldout_losses
from relaytrain.train.execution import (
    pick_device,
    prepare_model,
    retain_freed_memory,
    set_determinism,
)
from relaytrain.train.metrics import proc_bytes
from relaytrain.train.optim import (
    MOMENTS,
    AdamW,
    build_optimizer,
    load_optimizer_state,
    lr_at,
    optimizer_state_tensors,
    set_lr,
)
from relaytrain.train.pipeline_stage import StageRunner, StageSpec, Transport
from relaytrain.train.step import StepOutcome, train_step, warm_kernels

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# What a peer gives a worker to restore: its whole snapshot, or (sharded) pieces of this
# worker's rows, one dict per peer holding some.
Donation = dict[str, torch.Tensor] | list[dict[str, Piece]] | None


def reset_peak_rss() -> None:
    """Start the process's peak resident size (VmHWM) afresh (Linux; elsewhere nothing)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    """The process's peak resident bytes since `reset_peak_rss` (0 where /proc is missing)."""
    return proc_bytes("/proc/self/status", "VmHWM") or 0


def state_bytes(model: torch.nn.Module, optimizer: AdamW) -> int:
    """Bytes of the parameters, their gradients and the optimizer state this process holds
    (local shards of sharded tensors). Gradients are counted at the parameters' size: they
    have their shape and dtype, and exist through a step's backward and update."""
    params = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    moments = sum(local_tensor(v).numel() * v.element_size() for s in optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v))
    return 2 * params + moments


class Worker:
    """State lives here between the controller's coarse calls (setup, run_step, save, ...)."""

    def __init__(self, config: dict[str, Any], tokenizer_vocab: int):
        self.cfg: RunConfig = config_from_dict(config)
        torch.set_num_threads(self.cfg.runtime.threads_per_worker)
        self.model_cfg = self.cfg.model_config(tokenizer_vocab)
        self.device = pick_device(self.cfg.train.device)
        set_determinism(self.device, self.cfg.determinism == "exact")
        retain_freed_memory()  # no page faults for buffers freed and re-allocated every step
        self.dataset = TokenDataset.open(self.cfg.data.path)
        self.train_split = self.dataset.split("train")
        self.eval_splits: dict[str, Any] | None = None  # opened at the first evaluation
        self.placement: Placement | None = None
        self.generation = -1
        self.model: Olmo3 | None = None
        self.optimizer: AdamW | None = None
        self.loader: Loader | None = None
        self.reducer: GradReducer | None = None
        self.groups: PipelineGroups | None = None  # pp > 1: this generation's groups
        self.pipeline: StageRunner | None = None  # pp > 1: this stage's schedule runner
        # fsdp > 1: this generation's (shard group, replica group), and the model's FSDP units
        self.shards: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None
        self._units: list[FSDPModule] = []
        self._state_bytes: int | None = None  # measured after the first step of a build
        self.store = CheckpointStore(self.cfg.checkpoint_url)
        self.writer = AsyncCheckpointWriter(self.store)
        self._pending: list[tuple[int, str, Any]] = []
        # (step, tensors, the rows they are of when sharded)
        self._snapshot: tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None = None
        self._layout: tuple[int, int, int] | None = None  # (stage, pp, fsdp) of the model
        self.raise_hook = RaiseHook()  # faults.raise_at (see runtime/faults.py)
        self._sockets: GroupSockets | None = None  # the current groups' (runtime/abort.py)
        self._abort_lock = threading.Lock()  # abort() runs beside the call it interrupts
        self._rendezvous: Client | None = None  # the generation's store, while its groups live
        self._identity = process_identity()  # fixed for the process: each ping answers it

    # ---- membership ------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return self._identity

    def info(self) -> dict[str, Any]:
        return {**self._identity, "host": socket.gethostname(), "device": str(self.device)}

    def setup(self, generation: int, placement: Placement, store: StoreAccess | None = None,
              timeout_s: float = 30.0) -> dict[str, Any]:
        """Join generation `generation`: its process group (through its rendezvous `store`)
        and this rank's data shard."""
        self.leave()
        self.generation = generation
        self.placement = placement
        if placement.world > 1:
            keep_process_on_collective_errors()
            sockets = GroupSockets()
            self._rendezvous = rendezvous.join(store, timeout_s)
            prefixed = dist.PrefixStore(f"gen{generation}", self._rendezvous)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=prefixed, rank=placement.rank,
                                    world_size=placement.world,
                                    timeout=timedelta(seconds=timeout_s))
            if placement.pp > 1:
                self.groups = form_groups(placement.stage, placement.dp_rank, placement.dp,
                                          placement.pp, timedelta(seconds=timeout_s))
            if placement.fsdp > 1:
                self.shards = form_shard_groups(placement.dp_rank, placement.dp,
                                                placement.fsdp, placement.stage, placement.pp,
                                                timedelta(seconds=timeout_s))
            sockets.formed()
            with self._abort_lock:
                self._sockets = sockets
        if self.loader is not None:
            self.loader.close()
        t = self.cfg.train
        self.loader = Loader(self.train_split, self.cfg.seq_len, self.cfg.seed, t.global_batch,
                             t.micro_batch, placement.dp_rank, placement.dp,
                             prefetch=self.cfg.data.prefetch, order=self.cfg.data.order)
        if placement.world > 1:
            print(f"[rank {placement.rank}] joined generation {generation}: dp rank "
                  f"{placement.dp_rank}/{placement.dp}, stage {placement.stage}/{placement.pp}, "
                  f"pid {os.getpid()}, {self.device}", flush=True)
        return self.info()

    def abort(self, generation: int) -> bool:
        """Abort generation `generation`'s collectives now: a call blocked in one (on another
        thread) fails at once, and so does every collective after it, here and on the peers it
        talks to (runtime/abort.py). False if this worker is not in that generation (any
        more)."""
        with self._abort_lock:
            if generation != self.generation or self._sockets is None:
                return False
            abort_groups(self._sockets)
            self._sockets = None
            return True

    def leave(self) -> None:
        """Drop the current generation's process group (a no-op if there is none)."""
        with self._abort_lock:
            self._sockets = None
        if dist.is_initialized():
            dist.destroy_process_group()  # and the pipeline's groups with it
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None
        self.reducer = None
        self.groups = self.pipeline = None
        if self.shards is not None:  # a sharded model lives on its generation's groups
            self.shards = self.model = self.optimizer = None
            self._units = []

    def _group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD if dist.is_initialized() else None

    # ---- state -----------------------------------------------------------------------------
    def build(self, step: int, given: Donation = None) -> int:
        """Fresh model and optimizer for this generation, holding the state after `step`.

        The state comes from `given` (a peer's whole snapshot, for a replacement; in a sharded
        run, pieces of this worker's rows from the snapshots of the peers holding them), else
        this worker's own snapshot if it is of `step` (a shard's, only if its rows are this
        worker's now: the controller gives pieces otherwise), else checkpoint `step` from
        storage, else (step 0) the seed. Returns the step restored."""
        p = self.placement
        layout = (p.stage, p.pp, p.fsdp) if p else (0, 1, 1)
        if self.model is None or step == 0 or self._layout != layout:
            # A new module; a worker re-forming with the same layout keeps its own, since
            # every restored value is overwritten below (that makes recovery cheap).
            self._fresh(self._new_module(), layout)
        self._restore(step, given)
        if self.shards is not None and self.placement.dp // self.placement.fsdp > 1:
            # Sharded snapshots are taken at the end of a span (run_steps): one of the state
            # just restored, so a replacement holds one before its first span ends too.
            self.take_snapshot(step)
        self._state_bytes = None
        group = self.groups.dp if self.groups is not None else self._group()
        exact = self.cfg.determinism == "exact"
        if self.shards is not None:
            from relaytrain.parallel.fsdp import ShardedGradReducer  # parallel/shards.py: why

            self.reducer = ShardedGradReducer(self._units, list(self.model.parameters()), group,
                                              self.shards[1], exact, self.cfg.micro_batches,
                                              self.placement.dp)
        else:
            self.reducer = GradReducer(list(self.model.parameters()), group, exact=exact,
                                       total_micro_batches=self.cfg.micro_batches)
        self.pipeline = self._stage_runner() if self.groups is not None else None
        return step

    def warm_up(self) -> None:
        """For a spare or the standby: build the model now (for an unpipelined layout) and
        run its kernels once (`warm_kernels`), and import FSDP2 if the run shards
        (parallel/shards.py), so a promotion only loads state."""
        if self.cfg.parallel.fsdp > 1:
            import relaytrain.parallel.fsdp  # noqa: F401
        if self.cfg.parallel.pp == 1:
            self._fresh(Olmo3(self.model_cfg), (0, 1, 1))
            warm_kernels(self.model, self.cfg.train.micro_batch, self.cfg.data.seq_len,
                         self.cfg.train.z_loss, self.device)

    def _fresh(self, model: Olmo3, layout: tuple[int, int, int]) -> None:
        """`model` with the seed's weights, prepared for this device, and a new optimizer."""
        init_weights(model, self.cfg.seed)
        self.model = prepare_model(model, self.cfg.model, self.device)
        if self.shards is not None:
            from relaytrain.parallel.fsdp import shard_model  # parallel/shards.py: why

            self._units = shard_model(self.model, list(self.model.layers.values()),
                                      self.shards[0], self.device, self.generation)
        self.optimizer = build_optimizer(self.model, self.cfg.optim)
        self._layout = layout

    def arm_fault(self, step: int) -> None:
        """Fault injection (faults.raise_at): raise InjectedFault when `step` starts."""
        self.raise_hook.arm(step)

    def snapshot_step(self) -> int | None:
        return None if self._snapshot is None else self._snapshot[0]

    def _snapshot_of(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if self._snapshot is None or self._snapshot[0] != step:
            raise LookupError(f"no in-memory snapshot of step {step} "
                              f"(have {self.snapshot_step()})")
        return self._snapshot[1], self._snapshot[2]

    def snapshot_tensors(self, step: int) -> dict[str, torch.Tensor]:
        """The in-memory snapshot of `step` (unsharded: whole), for a replacement to pull."""
        return self._snapshot_of(step)[0]

    def snapshot_rows(self, step: int, shards: int, shard: int) -> dict[str, Piece]:
        """What this worker's snapshot of `step` (a shard's) holds of the rows that shard
        `shard` of `shards` holds, for a worker of another layout to assemble its own."""
        tensors, where = self._snapshot_of(step)
        rows = {k: chunk_rows(w["shape"][0], shards, shard) for k, w in where.items()}
        return cut(tensors, where, rows)

    def take_snapshot(self, step: int) -> None:
        """Keep the state (after `step`) as this worker holds it (sharded: its own rows) in
        RAM: a recovery restores it, losing at most the step in progress, without reading
        storage. No collective: any worker may take one at any time."""
        previous = self._snapshot[1] if self._snapshot is not None else None
        state, where = self._held(first=True)
        self._snapshot = (step, snapshot_to_host(state, out=previous), where)

    def _restore(self, step: int, given: Donation) -> None:
        """The state after `step` from where `build` says."""
        if isinstance(given, list):
            self.load_tensors(self._assembled(given), local=True)
        elif given is not None:
            self.load_tensors(given)
        elif self._snapshot is not None and self._snapshot[0] == step:
            _, tensors, where = self._snapshot
            if where and {k: tuple(w["rows"]) for k, w in where.items()} != self._own_rows():
                raise RuntimeError(f"this worker's snapshot of step {step} holds rows of "
                                   "another layout (they must be pulled from the peers)")
            self.load_tensors(tensors, local=bool(where))
        elif step > 0:
            self.load_tensors(self._read_checkpoint(step), local=True, owned=True)

    def _own_rows(self) -> Rows:
        """The rows this worker holds of each sharded tensor of the state (none unsharded)."""
        assert self.model is not None
        rows = {}
        for name, p in self.model.named_parameters():
            own = own_rows(p)
            if own is not None:
                rows[model_key(name)] = own
                rows.update({optim_key(name, m): own for m in MOMENTS})
        return rows

    def _assembled(self, given: list[dict[str, Piece]]) -> dict[str, torch.Tensor]:
        """This worker's rows of every tensor, from the pieces its peers sent."""
        rows, parts, out = self._own_rows(), {}, {}
        for pieces in given:
            for key, (first, t) in pieces.items():
                if first is None:
                    out[key] = t
                else:
                    parts.setdefault(key, []).append((first, t))
        out.update({key: assemble(key, ps, rows[key]) for key, ps in parts.items()})
        return out

    def _read_checkpoint(self, step: int) -> dict[str, torch.Tensor]:
        """This worker's tensors of checkpoint `step`: its stage's, and of sharded ones only
        its own rows (only the blocks holding them are read). What one file holds all of is
        read straight into the parameter or optimizer state it restores (the store's `into`):
        a failed read leaves them partly overwritten, and a build that fails is followed by
        another restore before any step (`build` overwrites every value)."""
        assert self.model is not None
        names = {n for n, _ in self.model.named_parameters()}
        live = {k: local_tensor(t) for k, t in self.state_tensors().items()}
        _, tensors = self.store.read(step, keys=lambda k: tensor_param(k) in names,
                                     rows=self._own_rows(), into=live)
        return tensors

    def load_tensors(self, tensors: dict[str, torch.Tensor], local: bool = False,
                     owned: bool = False) -> None:
        """The state from whole tensors, or with `local` from this rank's rows of the sharded
        ones (`_read_checkpoint`). `owned`: `tensors` are this restore's alone (a checkpoint
        read, not a snapshot or a peer's donation), so the optimizer state takes them as they
        are; a parameter read in place is already set (copying a tensor onto its own memory is
        a no-op in torch)."""
        assert self.model is not None and self.optimizer is not None
        params = dict(self.model.named_parameters())
        missing = [n for n in params if model_key(n) not in tensors]
        if missing:
            raise KeyError(f"checkpoint lacks parameter {missing[0]!r}")
        with torch.no_grad():
            for name, p in params.items():
                assign_(p, tensors[model_key(name)], local)
        self.optimizer.state.clear()  # nothing of the live run survives a restore
        load_optimizer_state(self.model, self.optimizer, tensors, local, owned)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state as this worker holds it: whole tensors, or (sharded) its DTensors."""
        assert self.model is not None and self.optimizer is not None
        for unit in self._units:  # FSDP2 keeps the root's parameters gathered after a forward
            unit.reshard()  # with no backward (an evaluation): they must be the sharded ones
        out = {model_key(n): p.detach() for n, p in self.model.named_parameters()}
        out.update(optimizer_state_tensors(self.model, self.optimizer))
        return out

    def _held(self, first: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The state as plain tensors, and (sharded) the record of the rows they are of
        (parallel/shards.py `shard_pieces`: unsharded tensors only if `first`)."""
        state = self.state_tensors()
        return shard_pieces(state, first) if self.shards is not None else (state, {})

    # ---- training --------------------------------------------------------------------------
    def run_steps(self, first: int, count: int) -> list[StepResult]:
        """Optimizer steps first .. first+count-1 (1-based; step k trains global batch k-1).

        One call may cover several steps: tiny steps amortise the call, and asynchronous
        pipeline schedules need a span to keep the pipeline full. A span ends drained, so its
        end is a consistent cut (the state a snapshot or checkpoint captures)."""
        # Only a worker whose rows another also holds benefits (a DP peer; under sharding, the
        # same shard of another replica): that copy outlives this process. A sharded one is
        # taken at the end of a span, when the span's collectives are done (at its start, an
        # abort after a peer's death raced with it, and the survivors' snapshots disagreed).
        every = self.cfg.elastic.snapshot_every
        due = self.placement.dp // self.placement.fsdp > 1 and every > 0
        if due and self.shards is None and (first - 1) % every == 0:
            self.take_snapshot(first - 1)
        self.raise_hook.check(first, count)
        if self.pipeline is not None:
            out = self._run_span(first, count)
        else:
            out = [self._step(step) for step in range(first, first + count)]
        last = first + count - 1
        if due and self.shards is not None and last % every == 0:
            self.take_snapshot(last)
        out[-1].written = self._collect(wait=False)
        return out

    def _step(self, step: int) -> StepResult:
        assert self.loader is not None and self.reducer is not None
        reset_peak_rss()
        t0 = time.perf_counter()
        batch = self.loader.get(step - 1)
        t1 = time.perf_counter()
        set_lr(self.optimizer, lr_at(step, self.cfg.optim, self.cfg.train.max_steps))
        self.model.train()
        out = train_step(self.model, self.optimizer, self.reducer, batch.micro_batches,
                         self.cfg.micro_batches, self.cfg.train.z_loss, self.cfg.train.clip,
                         self.device)
        result = self._result(step, out, batch.ids.tolist(), t1 - t0, self._synced_since(t1))
        if self._state_bytes is None:  # fixed for a generation once AdamW's state exists
            self._state_bytes = state_bytes(self.model, self.optimizer)
        result.state_bytes = self._state_bytes
        result.peak_rss = peak_rss()
        return result

    def _synced_since(self, t: float) -> float:
        """Seconds since `t`, once the device has finished the work queued on it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t

    @staticmethod
    def _result(step: int, out: StepOutcome, ids: list[int], time_data: float,
                time_compute: float) -> StepResult:
        """The one place a step's result is formed, for plain and pipelined steps alike."""
        return StepResult(step=step, losses=out.losses, grad_norm=out.grad_norm,
                          finite=out.finite, ids=ids, time_data=time_data,
                          time_compute=time_compute, pipeline=out.pipeline)

    # ---- pipeline parallelism (parallel.pp > 1) ----------------------------------------------
    def _new_module(self) -> Olmo3:
        """The whole model, or this rank's stage of it (global parameter names either way)."""
        p = self.placement
        if p.pp == 1:
            return Olmo3(self.model_cfg)
        ranges = partition_layers(self.model_cfg, p.pp, self.cfg.parallel.stage_layers,
                                  self.cfg.seq_len)
        return build_stage(self.model_cfg, p.stage, p.pp, ranges)

    def _stage_runner(self) -> StageRunner:
        assert self.groups is not None and self.placement is not None
        spec = StageSpec.from_config(self.cfg, self.placement.stage, self.model_cfg.d_model)
        return StageRunner(self.model, self.optimizer, self.reducer, spec,
                           Transport(self.device), self.groups.prev, self.groups.next,
                           self.groups.pipe,
                           lambda step: lr_at(step, self.cfg.optim, self.cfg.train.max_steps),
                           self.device, sharded=self.shards is not None)

    def _run_span(self, first: int, count: int) -> list[StepResult]:
        """Steps first .. first+count-1 as one pipeline span (one step for flush schedules)."""
        assert self.loader is not None and self.pipeline is not None
        t0 = time.perf_counter()
        batches = [self.loader.get(step - 1) for step in range(first, first + count)]
        t1 = time.perf_counter()
        outs = self.pipeline.run_span(first, batches)
        compute = self._synced_since(t1)
        return [self._result(first + i, out, batch.ids.tolist(), (t1 - t0) / count,
                             compute / count)
                for i, (out, batch) in enumerate(zip(outs, batches, strict=True))]

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, step: int, part: str, attempt: str) -> float:
        """Copy the state to host memory now; write it in the background as `part` (sharded:
        this shard's rows only) of the save `attempt`. Returns copy time."""
        t0 = time.perf_counter()
        state, where = self._held(first=self.placement is None or self.placement.shard == 0)
        self._pending.append((step, part, self.writer.submit(
            step, part, snapshot_to_host(state), shards=where or None, attempt=attempt)))
        return time.perf_counter() - t0

    def _collect(self, wait: bool, timeout: float | None = None) -> list[WriteReport]:
        """Reports of the finished writes; with `wait`, of all once finished (within `timeout`
        seconds, if given: the rest stay pending)."""
        if wait and timeout is not None:
            futures.wait([fut for *_, fut in self._pending], timeout)
            wait = False
        done, keep = [], []
        for step, part, fut in self._pending:
            if not wait and not fut.done():
                keep.append((step, part, fut))
                continue
            try:
                done.append(WriteReport(step, part, info=fut.result()))
            except Exception as e:  # reported to the controller, which will not commit
                done.append(WriteReport(step, part, error=f"{type(e).__name__}: {e}"))
        self._pending = keep
        return done

    def flush_writes(self, timeout: float | None = None) -> list[WriteReport]:
        return self._collect(wait=True, timeout=timeout)

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, sets: dict[str, list[int]]) -> dict[str, dict[int, float]]:
        if self.eval_splits is None:
            self.eval_splits = open_eval_sets(self.dataset, self.cfg.eval.sets)
        return {name: self._evaluate(self.eval_splits[name], ids) for name, ids in sets.items()}

    def _evaluate(self, split: Any, ids: list[int]) -> dict[int, float]:
        assert self.model is not None and self.placement is not None
        p = self.placement
        # A replica's shards run every forward together (each gathers parameters): they take
        # the replica's chunks, and its first shard reports.
        if self.pipeline is not None:
            losses = self.pipeline.evaluate(split, ids, p.replica, p.dp // p.fsdp)
        else:
            losses = heldout_losses(self.model, split, ids, self.cfg.seq_len,
                                    self.cfg.train.micro_batch, self.device, p.replica,
                                    p.dp // p.fsdp)
        return losses if p.shard == 0 else {}

    def close(self) -> None:
        self._collect(wait=True)
        self.writer.close()
        if self.loader is not None:
            self.loader.close()
        self.leave()
