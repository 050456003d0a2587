"""Sharded data parallelism (ZeRO-3, `parallel.fsdp`) on PyTorch's FSDP2.

A replica's parameters, gradients and AdamW moments are sharded over its fsdp ranks:
`fully_shard` on every block and on the root (embedding, final norm, head), over a DeviceMesh of
the replica's shard group. A rank holds dim-0 chunk `shard` of each tensor (torch.chunk's
split: the last chunks may be smaller or empty), gathers a block's parameters for its forward
and its backward, and gets its chunk of the gradient back by reduce-scatter. Replicas (dp > 1:
hybrid sharding) then sum their chunks with an all-reduce over the ranks holding the same shard,
in the same backward.

With pipeline stages (pp > 1) each stage's module is sharded the same way over its own
shard group (parallel/groups.py); the stage executor calls the module and runs backward so that
these hooks do the gathering and reducing (train/pipeline_stage.py).

Gradients are sums, not means: the loss is pre-scaled by 1 / (micro-batches in the global
batch) everywhere in relaytrain, so FSDP2's division is turned off.

Precision (`parallel.fsdp_param_dtype`, `param_dtype`): the sharded parameters, their gradients
and AdamW's moments are fp32 always. On CUDA in fast mode the parameters are gathered in bf16
and the forward and backward compute with them (Olmo 3's recipe, FSDP2's MixedPrecisionPolicy:
half the all-gather traffic and gathered memory); each unit's bf16 gradient is reduce-scattered
in fp32. Exact mode, and the CPU, gather fp32 (no policy: FSDP2 as it was): exact mode's bits
are the unsharded run's, which computes under autocast from fp32 weights (docs/DETERMINISM.md).

`fast` sums in float32 as FSDP2 does. `exact` keeps parallel/reduce.py's promise under
sharding: each micro-batch's unsharded gradient becomes int64 limbs, reduce-scattered as
integers and summed over this rank's micro-batches in an integer accumulator; at the last
micro-batch of the step the accumulator is summed over replicas and converted back, into the
chunk FSDP2 accumulates the gradient in (earlier micro-batches hand it zeros: adding an exact
zero changes no bit). The limbs travel packed (one int64 a value, parallel/reduce.py); each
rank's count of values the packing bound left out rides in the same reduce-scatter (one more
int64 a rank and slice), so every rank learns whether any were, with no collective of its own;
where some were, a second reduce-scatter carries those values' two limbs (rare: gradients are
mostly far below the bound), which add to the packed sums' limbs, the same integers. The
gradient norm is computed from each tensor's whole gradient, gathered one tensor at a time, so
it is the unsharded model's `get_total_norm` bit for bit. A step's state is then the same bits
for every (dp, fsdp) whose chunks are whole CPU vectors (parallel/shards.py's `misaligned`,
which says why), and every layout restores any other's state (parallel/shards.py converts
between sharded tensors and whole ones).

Imported only by a worker that shards (see parallel/shards.py: the import is 1.2 s), and by a
sharded run's standby and spares as they warm up. The import takes `torch._dynamo` too, which a
process's first `fully_shard` would otherwise import (FSDP2 turns dynamo off around its
`DTensor.from_local`: 1.0-1.9 s on 2 loaded cores): a standby that replaced a sharded worker
paid it inside the recovery's restore phase.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (see above: what a first fully_shard would import)
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from relaytrain.parallel.precision import gather_dtype
from relaytrain.parallel.reduce import (
    ReduceStats,
    any_rank,
    fold_kernel_builds,
    fold_packed,
    from_limbs,
    overflow_limit,
    pack_bound,
    pack_shift,
    rest_limbs,
    unpack,
    unpack_float,
)
from relaytrain.parallel.shards import is_sharded, local_tensor, whole_tensor

# torch 2.13 renamed reduce_scatter_tensor (and warns on the old name); torch 2.8 has only it.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Gradient values (over all ranks) converted to limbs and reduce-scattered at a time in exact
# mode: up to 45 bytes each while folded (torch's ops, and the int64 send buffer: bench.gpu's
# FOLD_BYTES + 8), so at most 720 MiB.
SLICE_VALUES = 2**24


# `parallel.fsdp_param_dtype`'s explicit settings.
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def param_dtype(setting: str, device: torch.device, exact: bool) -> torch.dtype:
    """The dtype FSDP2 gathers parameters in (`parallel.fsdp_param_dtype`): parallel/
    precision.py's `gather_dtype` says which and why."""
    return PARAM_DTYPES[gather_dtype(setting, device.type, exact)]


def mixed_precision(dtype: torch.dtype, root: bool) -> MixedPrecisionPolicy:
    """A unit's policy for parameters gathered in `dtype`, gradients reduced in fp32.

    fp32: FSDP2's default (no casts at all). Otherwise the root casts a pipeline stage's fp32
    input activation to `dtype` and its output back to fp32 (the dtype stages exchange,
    train/pipeline_stage.py: both casts exact, so a stage computes as the whole model does);
    a block casts none of its inputs (the residual stream is `dtype` already, and RoPE's
    cos/sin stay fp32)."""
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None,
                                cast_forward_inputs=root)


def shard_model(model: nn.Module, blocks: list[nn.Module], group: dist.ProcessGroup,
                device: torch.device, generation: int,
                dtype: torch.dtype = torch.float32) -> list[FSDPModule]:
    """Shard `model` over `group` in place: each of `blocks`, then the root (what is left:
    embedding, final norm, head), gathering parameters in `dtype` (`param_dtype`). Returns
    the FSDP units.

    The mesh is named for the `generation`, so that no mesh equals an earlier generation's
    (DTensor caches sharding decisions by mesh; that generation's process groups are gone)."""
    mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=(f"shard{generation}",))
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mixed_precision(dtype, root=False))
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision(dtype, root=True))
    units: list[FSDPModule] = [*blocks, model]  # type: ignore[list-item]
    for unit in units:
        sum_gradients(unit)
    return units


def sum_gradients(unit: Any) -> None:
    """Make FSDP unit `unit` sum gradients across ranks (relaytrain pre-scales the loss).
    torch before FSDP2's forced sums (pytorch PR 155915, mid-2025) names the same factor
    `set_reduce_scatter_divide_factor` and has no forcing: a factor of 1 is a sum there too."""
    if hasattr(unit, "set_force_sum_reduction_for_comms"):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    else:
        unit.set_reduce_scatter_divide_factor(1.0)


class ShardedGradReducer:
    """The gradient of a sharded replica: FSDP2 reduces it during backward; this object sets
    how (exact: integer limbs), agrees on overflow, and computes the norm and clips.
    The interface of `parallel.reduce.GradReducer`."""

    def __init__(self, units: list[FSDPModule], params: list[nn.Parameter],
                 group: dist.ProcessGroup | None, replicas: dist.ProcessGroup | None,
                 exact: bool, total_micro_batches: int, data_parallel: int):
        self.params = [p for p in params if p.requires_grad]
        self.group = group  # every data-parallel rank: agrees on overflow
        self.exact = exact
        self.limit = overflow_limit(total_micro_batches)
        self.shift = pack_shift(total_micro_batches)
        self.bound = pack_bound(total_micro_batches)
        self.numel = sum(p.numel() for p in self.params)  # the whole tensors'
        on_cpu = bool(self.params) and self.params[0].device.type == "cpu"
        self.fused = exact and on_cpu and fold_kernel_builds()
        self.overflow = False
        self.stats = ReduceStats(self.numel)  # fast mode: bytes only (FSDP2 reduces)
        self._comms: list[_IntegerReduceScatter] = []
        if exact:
            local = total_micro_batches // data_parallel
            for unit in units:
                comm = _IntegerReduceScatter(self, local, replicas)
                unit.set_custom_reduce_scatter(comm)
                self._comms.append(comm)
        elif replicas is not None:
            for unit in units:
                unit.set_all_reduce_hook(lambda out: self._all_reduce_fast(out, replicas))

    def _all_reduce_fast(self, out: torch.Tensor, replicas: dist.ProcessGroup) -> None:
        self.stats.wire_bytes += out.nbytes
        dist.all_reduce(out, group=replicas)

    def start(self) -> None:
        self.overflow = False
        self.stats = ReduceStats(self.numel)
        for p in self.params:
            p.grad = None
        for comm in self._comms:
            comm.reset()

    def overlapping(self, micro_batches: int | None = None) -> contextlib.AbstractContextManager:
        """Nothing to add: FSDP2 reduces each unit's gradient within the backward already."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Nothing to do: FSDP2 reduced this micro-batch's gradient in its backward (fast mode:
        its reduce-scatter's fp32 input, counted here, 4 bytes a parameter)."""
        if not self.exact:
            self.stats.wire_bytes += 4 * self.numel

    def finish(self) -> bool:
        """Agree on overflow (exact); False if any rank saw one."""
        if self.exact and self.group is not None:
            self.overflow = any_rank(self.overflow, self.group, self.params[0].device)
        return not self.overflow

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradient to `max_norm` by its global norm (returned).

        On the shards' local tensors, not through DTensor: DTensor propagates an op's sharding
        once per mesh, and a recovery's new generation has a new mesh, so its first step paid
        0.5-1.4 s (2 cores, loaded) propagating the norm's and the scaling's foreach ops over
        every gradient. The scaling is torch's `clip_grads_with_norm_` on the same local
        tensors (elementwise: the same bits)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.exact:  # the whole tensors' norms, as on one worker
            norms = [torch._foreach_norm([whole_tensor(g)], 2.0)[0] for g in grads]
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        else:  # the shards' sums of squares, summed over the replica's shards
            local = [local_tensor(g) for g in grads]
            squares = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local, 2.0)),
                                               2.0) ** 2
            if is_sharded(grads[0]):
                dist.all_reduce(squares, group=grads[0].device_mesh.get_group())
            total = squares.sqrt()
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # as clip_grads_with_norm_
        torch._foreach_mul_([local_tensor(g) for g in grads], coef.to(grads[0].device))
        return total


class _IntegerReduceScatter(ReduceScatter):
    """One FSDP unit's reduce-scatter in exact mode (see the module docstring)."""

    def __init__(self, reducer: ShardedGradReducer, micro_batches: int,
                 replicas: dist.ProcessGroup | None, slice_values: int = SLICE_VALUES):
        self.reducer = reducer
        self.micro_batches = micro_batches  # this rank's, per step
        self.replicas = replicas
        self.slice_values = slice_values
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.acc: torch.Tensor | None = None  # packed sums
        self.wide: torch.Tensor | None = None  # [2, chunk] limbs' sums of the slices not packed

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        world, chunk = group.size(), output_tensor.numel()
        if self.acc is None:  # the packed sums, then room for _total's flag
            self.acc = torch.zeros(chunk + 1, dtype=torch.int64, device=output_tensor.device)
        # Rank k's part of the input is chunk k. In slices of every chunk (the limbs take up to
        # 45 bytes a value while they are formed: a whole head's gradient would take tens of GB).
        step = max(1, self.slice_values // world)
        rows, packed = input_tensor.view(world, chunk), self.acc[:chunk]
        for a in range(0, chunk, step):
            piece = rows[:, a: a + step]
            got, left = self._scatter_packed(piece, group)
            packed[a: a + step] += got
            if left:  # values some rank's packed sums left out: their two limbs
                self._widen(chunk)[:, a: a + step] += self._scatter_limbs(piece, group)
        self.calls += 1
        if self.calls < self.micro_batches:
            output_tensor.zero_()
            return None
        output_tensor.copy_(self._total().view_as(output_tensor))
        self.reset()
        return None

    def _widen(self, chunk: int) -> torch.Tensor:
        """The two limbs' sums of the values the packed sums left out, zeros at first."""
        if self.wide is None:
            self.wide = torch.zeros((2, chunk), dtype=torch.int64, device=self.acc.device)
        return self.wide

    def _scatter_packed(self, piece: torch.Tensor,
                        group: dist.ProcessGroup) -> tuple[torch.Tensor, int]:
        """This rank's slice of every rank's packed `piece`, summed (8 bytes a value), and how
        many values all ranks left out of it (at or above the packing bound, or not finite):
        each rank's count rides in one more value of every rank's part of the reduce-scatter,
        so every rank gets the sum of them all, with no collective of its own."""
        r = self.reducer
        t0 = time.perf_counter()
        world, n = piece.shape
        send = torch.empty((world, n + 1), dtype=torch.int64, device=piece.device)
        send[:, n] = sum(fold_packed(piece[k], send[k, :n], r.shift, r.bound, True, r.fused)
                         for k in range(world))
        got = torch.empty(n + 1, dtype=torch.int64, device=piece.device)
        t1 = time.perf_counter()
        _reduce_scatter(got, send.view(-1), group=group)
        left = int(got[n])
        self._count(t1 - t0, time.perf_counter() - t1, send.nbytes)
        return got[:n], left

    def _scatter_limbs(self, piece: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """This rank's slice of every rank's values of `piece` the packed sums left out, as two
        limbs, summed (16 bytes a value; the packed values as zeros)."""
        r = self.reducer
        t0 = time.perf_counter()
        world = piece.shape[0]
        hi, lo, over = rest_limbs(piece, r.bound, r.limit)
        r.overflow |= over
        # Rows 2k and 2k + 1, rank k's two limbs, go to rank k.
        send = torch.stack([hi.view(world, -1), lo.view(world, -1)], dim=1)
        got = torch.empty((2, piece.shape[1]), dtype=torch.int64, device=piece.device)
        t1 = time.perf_counter()
        _reduce_scatter(got, send.view(2 * world, -1), group=group)
        self._count(t1 - t0, time.perf_counter() - t1, send.nbytes)
        return got

    def _total(self) -> torch.Tensor:
        """The step's sum over this rank's micro-batches and (hybrid) the replicas, as float32:
        the packed sums, plus the two limbs' sums of the values they left out where any replica
        has some (a flag in the packed all-reduce's tail says)."""
        r = self.reducer
        assert self.acc is not None
        t0 = time.perf_counter()
        packed, flag = self.acc[:-1], self.acc[-1:]
        flag.fill_(int(self.wide is not None))
        comm_s, wire = 0.0, 0
        if self.replicas is not None:
            t1 = time.perf_counter()
            dist.all_reduce(self.acc, group=self.replicas)
            if flag.item() > 0:
                wide = self._widen(packed.numel())
                dist.all_reduce(wide, group=self.replicas)
                wire += wide.nbytes
            comm_s, wire = time.perf_counter() - t1, wire + self.acc.nbytes
        if self.wide is not None:
            limbs = torch.stack(unpack(packed, r.shift)) + self.wide
            out = from_limbs(limbs[0], limbs[1]).float()
        else:
            out = unpack_float(packed, r.shift, torch.float32, r.fused)
        self._count(time.perf_counter() - t0 - comm_s, comm_s, wire)
        return out

    def _count(self, fold_s: float, comm_s: float, wire_bytes: int) -> None:
        stats = self.reducer.stats
        stats.fold_s += fold_s
        stats.comm_s += comm_s
        stats.wire_bytes += wire_bytes
