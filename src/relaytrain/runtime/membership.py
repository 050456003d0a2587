"""A worker's membership of a generation: the process groups it joins through the generation's
rendezvous (the world, and with pp > 1 or sharding the pipeline and shard groups), their abort
from another thread when a peer fails (runtime/abort.py), and leaving them."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from relaytrain.parallel.groups import (
    PipelineGroups,
    Placement,
    form_cp_group,
    form_groups,
    form_shard_groups,
)
from relaytrain.runtime import rendezvous
from relaytrain.runtime.abort import GroupSockets, abort_groups, keep_process_on_collective_errors
from relaytrain.runtime.kvstore import Client, StoreAccess
from relaytrain.train.state import Layout


class Membership:
    """This worker's place in the current generation and the process groups that go with it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.generation = -1
        self.placement: Placement | None = None
        self.groups: PipelineGroups | None = None  # pp > 1: this generation's groups
        # sharded: this generation's shard group (a replica's ranks, its cp ranks included),
        # and the replica group (the ranks holding the same shard; None with one replica)
        self.shard_group: dist.ProcessGroup | None = None
        self.replica_group: dist.ProcessGroup | None = None
        self.cp_group: dist.ProcessGroup | None = None  # cp > 1: the ranks sharing sequences
        self._sockets: GroupSockets | None = None  # the current groups' (runtime/abort.py)
        self._abort_lock = threading.Lock()  # abort() runs beside the call it interrupts
        self._rendezvous: Client | None = None  # the generation's store, while its groups live

    @property
    def layout(self) -> Layout:
        """What this worker's model is built for: (stage, pp, shards)."""
        p = self.placement
        return (p.stage, p.pp, p.shards) if p else (0, 1, 1)

    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel replicas of this worker's stage (None: nothing to reduce over)."""
        if self.groups is not None:
            return self.groups.dp
        return dist.group.WORLD if dist.is_initialized() else None

    def join(self, generation: int, placement: Placement, store: StoreAccess | None,
             timeout_s: float) -> None:
        """Join generation `generation` at `placement`: its process groups, formed through
        its rendezvous `store` (none for a world of one)."""
        self.generation = generation
        self.placement = placement
        if placement.world <= 1:
            return
        keep_process_on_collective_errors()
        sockets = GroupSockets()
        self._rendezvous = rendezvous.join(store, timeout_s)
        prefixed = dist.PrefixStore(f"gen{generation}", self._rendezvous)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=prefixed, rank=placement.rank,
                                world_size=placement.world, timeout=timedelta(seconds=timeout_s))
        if placement.pp > 1:
            self.groups = form_groups(placement.stage, placement.dp_rank, placement.dp,
                                      placement.pp, timedelta(seconds=timeout_s),
                                      placement.cp, placement.cp_rank)
        if placement.shards > 1:
            self.shard_group, self.replica_group = form_shard_groups(
                placement, timedelta(seconds=timeout_s))
        if placement.cp > 1:
            self.cp_group = form_cp_group(placement, timedelta(seconds=timeout_s))
        sockets.formed()
        with self._abort_lock:
            self._sockets = sockets

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
        """Drop the current generation's process groups (a no-op if there are none)."""
        with self._abort_lock:
            self._sockets = None
        if dist.is_initialized():
            dist.destroy_process_group()  # and the pipeline's groups with it
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None
        self.groups = self.shard_group = self.replica_group = self.cp_group = None
