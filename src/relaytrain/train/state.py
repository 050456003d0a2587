"""One worker's training state: its model (whole, a pipeline stage, or FSDP shards of either)
and optimizer, and the in-memory snapshot of them a recovery restores without storage.

Built fresh from the seed, then restored from wherever the controller says (a peer's donation,
this worker's own snapshot, a checkpoint); read back as checkpoint tensors (`state_tensors`),
as a snapshot, or as the rows of a snapshot that a worker of another layout holds. Only sharding
needs a process group (`build` given a shard group); everything else runs without one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from relaytrain.checkpoint.keys import model_key, optim_key, tensor_param
from relaytrain.checkpoint.pieces import Piece, Rows, assemble, cut
from relaytrain.checkpoint.store import CheckpointStore
from relaytrain.checkpoint.writer import snapshot_to_host
from relaytrain.config.sections import RunConfig
from relaytrain.model.config import Olmo3Config
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3
from relaytrain.model.stages import build_stage, partition_layers
from relaytrain.parallel.shards import (
    assign_,
    chunk_rows,
    local_tensor,
    own_rows,
    shard_pieces,
)
from relaytrain.train.execution import prepare_model
from relaytrain.train.init_from import read_origin
from relaytrain.train.optim import (
    MOMENTS,
    AdamW,
    build_optimizer,
    load_optimizer_state,
    optimizer_state_tensors,
)
from relaytrain.train.step import warm_kernels

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

Layout = tuple[int, int, int]  # (stage, pp, shards) of the model: what a module is built for

# What a peer gives a worker to restore: its whole snapshot, or (sharded) pieces of this
# worker's rows, one dict per peer holding some.
Donation = dict[str, torch.Tensor] | list[dict[str, Piece]] | None


def state_bytes(model: torch.nn.Module, optimizer: AdamW) -> int:
    """Bytes of the parameters, their gradients and the optimizer state this process holds
    (local shards of sharded tensors). Gradients are counted at the parameters' size: they
    have their shape and dtype, and exist through a step's backward and update."""
    params = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    moments = sum(local_tensor(v).numel() * v.element_size() for s in optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v))
    return 2 * params + moments


class TrainState:
    """The model, optimizer and snapshot one worker holds between the controller's calls."""

    def __init__(self, cfg: RunConfig, model_cfg: Olmo3Config, device: torch.device,
                 store: CheckpointStore):
        self.cfg, self.model_cfg, self.device, self.store = cfg, model_cfg, device, store
        self.model: Olmo3 | None = None
        self.optimizer: AdamW | None = None
        self.layout: Layout | None = None
        self.sharded = False  # FSDP2 shards over the generation's shard group (`build`)
        self.units: list[FSDPModule] = []  # the model's FSDP units, when sharded
        # (step, tensors, the rows they are of when sharded)
        self._snapshot: tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None = None

    # ---- building --------------------------------------------------------------------------
    def build(self, step: int, given: Donation, layout: Layout,
              shard_group: dist.ProcessGroup | None = None, generation: int = 0) -> None:
        """A model of `layout` (sharded over `shard_group`, if given) and its optimizer,
        holding the state after `step`.

        The state comes from `given` (a peer's whole snapshot, for a replacement; in a sharded
        run, pieces of this worker's rows from the snapshots of the peers holding them), else
        this worker's own snapshot if it is of `step` (a shard's, only if its rows are this
        worker's now: the controller gives pieces otherwise), else checkpoint `step` from
        storage, else (the run's start: step 0, or the step a continued run starts at) the
        run's `init.from` origin if it has one (train/init_from.py), else the seed."""
        if self.model is None or step == self.cfg.start_step or self.layout != layout:
            # A new module; a worker re-forming with the same layout keeps its own, since
            # every restored value is overwritten below (that makes recovery cheap).
            self.fresh(self._new_module(layout), layout, shard_group, generation)
        self._restore(step, given)

    def warm_up(self) -> None:
        """For a spare or the standby: build the model now (for an unpipelined layout) and
        run its kernels once (`warm_kernels`), and import FSDP2 if the run shards
        (parallel/shards.py), so a promotion only loads state."""
        if self.cfg.parallel.shards > 1:
            import relaytrain.parallel.fsdp  # noqa: F401
        if self.cfg.parallel.pp == 1:
            self.fresh(Olmo3(self.model_cfg), (0, 1, 1))
            warm_kernels(self.model, self.cfg.train.micro_batch, self.cfg.data.seq_len,
                         self.cfg.train.z_loss, self.device)

    def fresh(self, model: Olmo3, layout: Layout, shard_group: dist.ProcessGroup | None = None,
              generation: int = 0) -> None:
        """`model` with the seed's weights, prepared for this device (sharded over
        `shard_group`, if given, for generation `generation`), and a new optimizer."""
        init_weights(model, self.cfg.seed)
        self.model = prepare_model(model, self.cfg.model, self.device)
        self.units = []
        if shard_group is not None:
            # imported only when sharding: parallel/shards.py says why
            from relaytrain.parallel.fsdp import param_dtype, shard_model

            dtype = param_dtype(self.cfg.parallel.fsdp_param_dtype, self.device,
                                self.cfg.determinism == "exact")
            self.units = shard_model(self.model, list(self.model.layers.values()), shard_group,
                                     self.device, generation, dtype)
        self.sharded = shard_group is not None
        self.optimizer = build_optimizer(self.model, self.cfg.optim)
        self.layout = layout

    def drop(self) -> None:
        """Let go of the model and optimizer (a sharded one lives on its generation's groups)."""
        self.model = self.optimizer = None
        self.units = []
        self.sharded = False

    def _new_module(self, layout: Layout) -> Olmo3:
        """The whole model, or this rank's stage of it (global parameter names either way, so
        checkpoints and snapshots are the same tensors whatever the layout: a rank of
        interleaved-1f1b holds its V chunks' layers in one module)."""
        stage, pp, _ = layout
        if pp == 1:
            return Olmo3(self.model_cfg)
        p = self.cfg.parallel
        virtual = p.virtual_stages if p.schedule == "interleaved-1f1b" else 1
        ranges = partition_layers(self.model_cfg, pp * virtual, p.stage_layers, self.cfg.seq_len)
        return build_stage(self.model_cfg, stage, pp, ranges)

    # ---- snapshots -------------------------------------------------------------------------
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
        state, where = self.held(first=True)
        self._snapshot = (step, snapshot_to_host(state, out=previous), where)

    # ---- restoring -------------------------------------------------------------------------
    def _restore(self, step: int, given: Donation) -> None:
        """The state after `step` from where `build` says."""
        if isinstance(given, list):
            self.load_tensors(self._assembled(given), local=True)
        elif given is not None:
            self.load_tensors(given)
        elif self._snapshot is not None and self._snapshot[0] == step and (
                not self._snapshot[2] or self._own_rows() ==
                {k: tuple(w["rows"]) for k, w in self._snapshot[2].items()}):
            _, tensors, where = self._snapshot
            self.load_tensors(tensors, local=bool(where))
        elif step > self.cfg.start_step:
            # (also past a snapshot of `step` that holds rows of another layout: a restore from
            # the checkpoint of the step it was taken at, onto fewer workers; from memory, the
            # controller gives a worker whose rows changed their pieces instead)
            self.load_tensors(self._read_checkpoint(step), local=True, owned=True)
        elif self.cfg.init.origin is not None:
            self.load_tensors(self._read_checkpoint(None), local=True, owned=True)

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
        """This worker's rows of every tensor, from the pieces its peers sent (a whole tensor
        from an unsharded peer, e.g. a run grown back from one worker, holds them all)."""
        rows, parts, out = self._own_rows(), {}, {}
        for pieces in given:
            for key, (first, t) in pieces.items():
                if first is None:
                    out[key] = t[rows[key][0]:rows[key][1]] if key in rows else t
                else:
                    parts.setdefault(key, []).append((first, t))
        out.update({key: assemble(key, ps, rows[key]) for key, ps in parts.items()})
        return out

    def _read_checkpoint(self, step: int | None) -> dict[str, torch.Tensor]:
        """This worker's tensors of checkpoint `step` (None: the run's `init.from` origin, its
        weights and the optimizer state it took): its stage's, and of sharded ones only its
        own rows (only the blocks holding them are read). What one file holds all of is
        read straight into the parameter or optimizer state it restores (the store's `into`):
        a failed read leaves them partly overwritten, and a build that fails is followed by
        another restore before any step (`build` overwrites every value)."""
        assert self.model is not None
        names = {n for n, _ in self.model.named_parameters()}
        live = {k: local_tensor(t) for k, t in self.state_tensors().items()}
        if step is None:
            return read_origin(self.cfg.init.origin, names, self._own_rows(), into=live)
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

    # ---- reading ---------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state as this worker holds it: whole tensors, or (sharded) its DTensors."""
        assert self.model is not None and self.optimizer is not None
        for unit in self.units:  # FSDP2 keeps the root's parameters gathered after a forward
            unit.reshard()  # with no backward (an evaluation): they must be the sharded ones
        out = {model_key(n): p.detach() for n, p in self.model.named_parameters()}
        out.update(optimizer_state_tensors(self.model, self.optimizer))
        return out

    def held(self, first: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The state as plain tensors, and (sharded) the record of the rows they are of
        (parallel/shards.py `shard_pieces`: unsharded tensors only if `first`)."""
        state = self.state_tensors()
        return shard_pieces(state, first) if self.sharded else (state, {})
