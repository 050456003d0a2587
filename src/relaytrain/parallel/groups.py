"""Placements and process groups of a data-parallel x context-parallel x pipeline-parallel
layout: world = dp x cp x pp, dp counting data-parallel ranks (replicas x fsdp).

Rank r is DP rank r % dp of stage r // dp (`placements`); with context parallelism each DP rank
is cp consecutive ranks (cp rank r % cp of DP rank r // cp % dp of stage r // (dp x cp)). Under
sharding (fsdp > 1, or `parallel.shard_over_cp` at fsdp 1) the dp data-parallel ranks of a stage
are dp / fsdp replicas of fsdp DP ranks, each replica's state sharded over its fsdp x cp
consecutive ranks (`form_shard_groups`): a cp group's ranks would hold the same weights, so they
shard them, and the shards' reduce-scatter sums the cp ranks' parts of the gradient with the DP
ranks'. A stage's DP replicas reduce their gradients together (with cp, all the stage's dp x cp
ranks: each holds its part of every micro-batch's gradient); one replica's stages agree on a
global gradient norm; each rank exchanges activations with the rank of the same DP rank and cp
rank in the neighbouring stages (both hold the same part of the same sequences).

`torch.distributed.new_group` is collective over the whole world and must be called for every
group in the same order on every rank, so `form_groups` creates all of them, always in the same
order, right after the generation's process group is formed (and again in every new generation:
destroying the default group destroys these too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist


class Placement(NamedTuple):
    """Where a worker sits in a generation's layout. A named tuple, not a dataclass: a
    recovery at 1,024 workers forms 1,024 and sends each to its worker, and a tuple is built
    and pickled in a fifth of a frozen dataclass's time (bench control-plane)."""

    rank: int
    world: int
    dp_rank: int
    dp: int
    stage: int = 0
    pp: int = 1
    fsdp: int = 1  # ranks a replica is sharded over; dp_rank % fsdp is this rank's shard
    cp: int = 1  # ranks each sequence is split over (context parallelism)
    cp_rank: int = 0  # this rank's part of the sequence
    shard_over_cp: bool = False  # sharded over the cp ranks at fsdp 1 too (`replica_shards`)

    @property
    def shards(self) -> int:
        return replica_shards(self.fsdp, self.cp, self.shard_over_cp)

    @property
    def shard(self) -> int:
        """This rank's shard of its replica's state (its rank within the replica)."""
        return (self.dp_rank % self.fsdp) * self.cp + self.cp_rank if self.shards > 1 else 0

    @property
    def replica(self) -> int:
        return self.dp_rank // self.fsdp


def replica_shards(fsdp: int, cp: int, shard_over_cp: bool) -> int:
    """Ranks a replica's state is sharded over: its fsdp DP ranks and each one's cp ranks
    when fsdp > 1 or `shard_over_cp` (cp ranks hold the same weights, so they shard them too,
    as OLMo-core flattens its cp mesh dimension into the shard one; at fsdp 1, OLMo-core's hsdp
    with shard_degree=1); 1 unsharded."""
    return fsdp * cp if fsdp > 1 or shard_over_cp else 1


def shard_size(data_parallel: int, fsdp: int) -> int:
    """The ranks a replica is sharded over when `data_parallel` ranks train a run configured
    with `fsdp`: fsdp while whole replicas fit (resized by replicas), else all of them, in one
    replica (an elastic run that lost part of one; chunks may then be uneven)."""
    return fsdp if data_parallel % fsdp == 0 else data_parallel


def placements(members: Sequence[int], dp: int, pp: int, fsdp: int = 1, cp: int = 1,
               shard_over_cp: bool = False) -> dict[int, Placement]:
    """Worker id -> its place, members in rank order: rank r is DP rank r % dp of stage r // dp,
    so a stage's DP ranks are consecutive ranks (and so are a replica's shards). `dp` counts
    data-parallel ranks: replicas x fsdp. With context parallelism (cp > 1) each DP
    rank is cp consecutive ranks, cp rank r % cp of DP rank r // cp: they share its batches,
    each holding its part of every sequence (and with `shard_over_cp` its shard of the state)."""
    if len(members) != dp * pp * cp or dp % fsdp:
        raise ValueError(f"{len(members)} members for a layout of dp {dp} x pp {pp} "
                         f"(fsdp {fsdp}, cp {cp})")
    return {wid: Placement(rank=r, world=dp * pp * cp, dp_rank=r // cp % dp, dp=dp,
                           stage=r // (dp * cp), pp=pp, fsdp=fsdp, cp=cp, cp_rank=r % cp,
                           shard_over_cp=shard_over_cp)
            for r, wid in enumerate(members)}


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's groups. A group of one rank is None (nothing to reduce); `pipe` is None when
    the pipeline is the whole world (dp = 1), which torch.distributed reads as WORLD."""

    dp: dist.ProcessGroup | None  # the DP replicas of this rank's stage
    pipe: dist.ProcessGroup | None  # this DP replica's stages
    prev: int | None  # global rank of the previous stage (same DP rank), None on the first
    next: int | None  # global rank of the next stage, None on the last
    # global rank across the pipeline's ends (the last stage's on the first, the first's on the
    # last, None in between): interleaved chunks pass activations round through it
    wrap: int | None = None


def stage_ranks(stage: int, dp: int) -> list[int]:
    return [stage * dp + d for d in range(dp)]


def stage_members(members: Sequence[int], dp: int, pp: int, cp: int = 1) -> list[list[int]]:
    """Each stage's members (in rank order, as `placements` takes them): its dp x cp ranks."""
    span = dp * cp
    return [list(members[s * span:(s + 1) * span]) for s in range(pp)]


def replica_ranks(dp_rank: int, dp: int, pp: int) -> list[int]:
    return [s * dp + dp_rank for s in range(pp)]


def form_groups(stage: int, dp_rank: int, dp: int, pp: int,
                timeout: timedelta | None = None, cp: int = 1, cp_rank: int = 0
                ) -> PipelineGroups:
    """Create every DP group (per stage: its dp x cp ranks) then every pipeline group (per DP
    rank and cp rank: the ranks holding the same part of the same micro-batches) and return
    this rank's. Needs an initialised default process group of dp x cp x pp ranks."""
    span, at = dp * cp, dp_rank * cp + cp_rank  # a stage's ranks, this rank's place among them
    if dist.get_world_size() != span * pp:
        raise ValueError(f"world of {dist.get_world_size()} ranks, layout needs dp {dp} x "
                         f"cp {cp} x pp {pp}")
    mine_dp = mine_pipe = None
    if span > 1:
        for s in range(pp):
            group = dist.new_group(stage_ranks(s, span), timeout=timeout)
            if s == stage:
                mine_dp = group
        for d in range(span):
            group = dist.new_group(replica_ranks(d, span, pp), timeout=timeout)
            if d == at:
                mine_pipe = group
    rank = stage * span + at
    return PipelineGroups(dp=mine_dp, pipe=mine_pipe,
                          prev=rank - span if stage > 0 else None,
                          next=rank + span if stage < pp - 1 else None,
                          wrap=None if 0 < stage < pp - 1 else
                          (pp - 1 - stage) * span + at if pp > 1 else None)


def form_shard_groups(placement: Placement, timeout: timedelta | None = None
                      ) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """Create, stage by stage, every shard group (a replica's `shards` consecutive ranks: its
    fsdp DP ranks and their cp ranks) then every replica group (the ranks holding the same
    shard), and return this rank's; the replica group is None with one replica. Needs an
    initialised default process group of dp x cp x pp ranks (and, with pp > 1, `form_groups`
    called first on every rank)."""
    p = placement
    span, shards = p.dp * p.cp, p.shards  # a stage's ranks, a replica's
    if dist.get_world_size() != span * p.pp or p.dp % p.fsdp:
        raise ValueError(f"world of {dist.get_world_size()} ranks, layout needs dp {p.dp} "
                         f"sharded {p.fsdp} ways x cp {p.cp} x pp {p.pp}")
    replicas = span // shards
    mine_shard = mine_replica = None
    for s in range(p.pp):
        base = s * span
        for r in range(replicas):
            group = dist.new_group(list(range(base + r * shards, base + (r + 1) * shards)),
                                   timeout=timeout)
            if (s, r) == (p.stage, p.replica):
                mine_shard = group
        if replicas > 1:
            for k in range(shards):
                group = dist.new_group(list(range(base + k, base + span, shards)),
                                       timeout=timeout)
                if (s, k) == (p.stage, p.shard):
                    mine_replica = group
    assert mine_shard is not None
    return mine_shard, mine_replica


def form_cp_group(placement: Placement, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """Create every cp group (a DP rank's cp consecutive ranks, stage by stage) in rank order
    and return this rank's. Needs an initialised default process group of dp x cp x pp
    ranks."""
    p = placement
    if dist.get_world_size() != p.dp * p.cp * p.pp:
        raise ValueError(f"world of {dist.get_world_size()} ranks, layout needs dp {p.dp} x "
                         f"cp {p.cp} x pp {p.pp}")
    mine = None
    for d in range(p.dp * p.pp):
        group = dist.new_group(list(range(d * p.cp, (d + 1) * p.cp)), timeout=timeout)
        if d == p.stage * p.dp + p.dp_rank:
            mine = group
    assert mine is not None
    return mine
