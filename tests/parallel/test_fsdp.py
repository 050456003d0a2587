"""Exact mode under sharding: the integer reduce-scatter sums every rank's micro-batches exactly,
in slices. The precision policy (`parallel.fsdp_param_dtype`): gathers in bf16 or fp32, fp32
state and reductions, on real gloo ranks."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import MixedPrecisionPolicy

from relaytrain.config.sections import OptimSection
from relaytrain.model.config import PRESETS
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3
from relaytrain.model.stages import build_stage
from relaytrain.parallel.fsdp import (
    SLICE_VALUES,
    ShardedGradReducer,
    _IntegerReduceScatter,
    mixed_precision,
    param_dtype,
    shard_model,
    sum_gradients,
)
from relaytrain.parallel.reduce import fold_kernel_builds, from_limbs, to_limbs
from relaytrain.train.optim import build_optimizer
from relaytrain.train.step import autocast_for


def _integer_reduce_scatter(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    chunk = 37

    def grads_of(r: int) -> list[torch.Tensor]:  # rank r's two micro-batches' gradients
        gen = torch.Generator().manual_seed(r)
        return [torch.randn(world * chunk, generator=gen) for _ in range(2)]

    outputs = []
    for slice_values in (5, SLICE_VALUES):  # slices of 2 values per rank; the whole at once
        reducer = ShardedGradReducer([], [], None, None, True, 2 * world, world)
        comm = _IntegerReduceScatter(reducer, 2, None, slice_values)
        outs = [torch.full((chunk,), float("nan")) for _ in range(2)]
        for g, out in zip(grads_of(rank), outs, strict=True):
            comm(out, g, dist.group.WORLD, None)
        assert torch.equal(outs[0], torch.zeros(chunk))  # FSDP2 accumulates: zero until the end
        outputs.append(outs[1])
    limbs = [to_limbs(g.view(world, chunk)[rank], reducer.limit, False)
             for r in range(world) for g in grads_of(r)]
    exact = from_limbs(sum(hi for hi, _ in limbs), sum(lo for _, lo in limbs)).float()
    assert torch.equal(outputs[0], exact) and torch.equal(outputs[1], exact)
    dist.destroy_process_group()


def _packed_reduce_scatter(rank: int, world: int, port: int) -> None:
    """Values that pack, and the same with one value above the packing bound on rank 0 only in
    one micro-batch's second slice: every rank reduces that slice's left-out values as two
    limbs too."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    chunk = 37

    def grads_of(r: int, big: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(r)
        out = [torch.randn(world * chunk, generator=gen) * 1e-3 for _ in range(2)]
        if big and r == 0:
            out[1][world * 3 + 1] = 5.0  # column 3 of chunk k = 0: the second slice of 2
        return out

    for big in (False, True):
        reducer = ShardedGradReducer([], [], None, None, True, 2 * world, world)
        reducer.fused = fold_kernel_builds()  # the kernel where it builds
        comm = _IntegerReduceScatter(reducer, 2, None, 2 * world)
        out = torch.full((chunk,), float("nan"))
        for g in grads_of(rank, big):
            comm(out, g, dist.group.WORLD, None)
        limbs = [to_limbs(g.view(world, chunk)[rank], reducer.limit, False)
                 for r in range(world) for g in grads_of(r, big)]
        exact = from_limbs(sum(hi for hi, _ in limbs), sum(lo for _, lo in limbs)).float()
        assert torch.equal(out, exact)
        # Per micro-batch and slice of 2: every rank's 2 packed values and its count of values
        # left out; the slice with the big value once more as two limbs.
        slices = -(-chunk // 2)
        assert reducer.stats.wire_bytes == 2 * 8 * world * (chunk + slices) + (
            16 * 2 * world if big else 0)
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_the_reduce_scatter_packs_where_every_rank_s_values_allow():
    """Packed values (8 bytes each on the wire) below the packing bound, and the count of
    values at or above it riding in the same reduce-scatter (8 bytes a rank and slice, no
    collective of its own); where any rank left one out, that slice's values once more as two
    limbs: the same integer sum either way."""
    mp.spawn(_packed_reduce_scatter, args=(2, _free_port()), nprocs=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_the_integer_reduce_scatter_sums_every_rank_s_micro_batches_exactly_in_slices():
    """Exact mode's reduce-scatter, on real gloo ranks: the integer sum of every rank's and
    micro-batch's gradient, delivered at the last micro-batch, the same whether the limbs are
    formed all at once or slice by slice (they take 32 bytes a value while formed)."""
    mp.spawn(_integer_reduce_scatter, args=(3, _free_port()), nprocs=3)


def test_auto_gathers_bf16_on_cuda_in_fast_mode_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert param_dtype("auto", cuda, exact=False) == torch.bfloat16  # Olmo 3's recipe
    assert param_dtype("auto", cuda, exact=True) == torch.float32  # the unsharded run's bits
    assert param_dtype("auto", cpu, exact=False) == torch.float32
    for device in (cuda, cpu):
        assert param_dtype("bf16", device, exact=False) == torch.bfloat16
        assert param_dtype("fp32", device, exact=False) == torch.float32


def test_the_bf16_policy_reduces_in_fp32_and_casts_only_at_the_root():
    """fp32 gathers are FSDP2's default policy (no casts: exact mode's bits); bf16 reduces in
    fp32, and only the root casts: a pipeline stage's fp32 activations in, fp32 out."""
    assert mixed_precision(torch.float32, root=True) == MixedPrecisionPolicy()
    assert mixed_precision(torch.float32, root=False) == MixedPrecisionPolicy()
    root, block = (mixed_precision(torch.bfloat16, root=r) for r in (True, False))
    assert (root.param_dtype, root.reduce_dtype, root.output_dtype, root.cast_forward_inputs) \
        == (torch.bfloat16, torch.float32, torch.float32, True)
    assert (block.param_dtype, block.reduce_dtype, block.output_dtype,
            block.cast_forward_inputs) == (torch.bfloat16, torch.float32, None, False)


def _seen_in_forward(module: torch.nn.Module, seen: dict[str, object], key: str) -> None:
    """Record in `seen[key]` the parameters `module` computes with (FSDP2's gathered ones) and
    the dtypes of its inputs, at its first forward."""
    def hook(mod: torch.nn.Module, args: tuple) -> None:
        seen.setdefault(key, ({n: p.detach().clone() for n, p in mod.named_parameters()},
                              [a.dtype for a in args if torch.is_tensor(a)]))
    module.register_forward_pre_hook(hook)


def _policy_check(rank: int, world: int, port: int, kind: str) -> None:
    """One rank of the policy test: gloo on the CPU (bf16 forced), or NCCL on CUDA under the
    autocast training uses, with `auto`'s dtype."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo" if kind == "cpu" else "nccl", rank=rank, world_size=world)
    device = torch.device(kind, rank if kind == "cuda" else None)
    if kind == "cuda":
        torch.cuda.set_device(device)
    cfg = PRESETS["tiny"].with_vocab(128)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(rank))
    tokens, group = tokens.to(device), dist.group.WORLD
    low = param_dtype("auto" if kind == "cuda" else "bf16", device, exact=False)
    assert low == torch.bfloat16
    for generation, dtype in enumerate((low, torch.float32)):
        model, seen = Olmo3(cfg).to(device), {}
        init_weights(model, 0)
        shard_model(model, list(model.layers.values()), group, device, generation, dtype)
        masters = {n: p.full_tensor() for n, p in model.named_parameters()}
        _seen_in_forward(model.layers["0"], seen, "block")
        _seen_in_forward(model.norm, seen, "norm")
        optimizer = build_optimizer(model, OptimSection())
        with autocast_for(device):
            total, _, _ = model(tokens[:, :-1], tokens[:, 1:])
        assert total.dtype == torch.float32
        total.backward()
        for key, prefix in (("block", "layers.0."), ("norm", "norm.")):
            gathered, inputs = seen[key]
            for name, p in gathered.items():  # the fp32 masters, rounded once to `dtype`
                assert torch.equal(p, masters[prefix + name].to(dtype)), (key, name)
            assert inputs[0] == dtype  # the residual stream
        assert seen["block"][1][1:] == [torch.float32] * 2  # RoPE's cos and sin: not cast
        grads = {n: p.grad.to_local() for n, p in model.named_parameters()}
        assert all(g.dtype == torch.float32 for g in grads.values())
        if dtype == low and world > 1:  # the ranks' bf16 gradients summed in fp32, not bf16
            g = grads["layers.0.mlp.up_proj.weight"]
            assert not torch.equal(g, g.to(torch.bfloat16).float())
        optimizer.step()
        for p in model.named_parameters():
            assert p[1].dtype == torch.float32 and p[1].to_local().dtype == torch.float32
        assert all(v.dtype == torch.float32 for state in optimizer.state.values()
                   for v in state.values())
    stage = build_stage(cfg, 0, 2, [range(0, 1), range(1, 2)]).to(device)
    shard_model(stage, list(stage.layers.values()), group, device, 2, low)
    with autocast_for(device):
        assert stage(tokens).dtype == torch.float32  # sent between stages as ACTIVATION_DTYPE
    stage, seen = build_stage(cfg, 1, 2, [range(0, 1), range(1, 2)]).to(device), {}
    shard_model(stage, list(stage.layers.values()), group, device, 3, low)
    _seen_in_forward(stage.layers["1"], seen, "block")
    with autocast_for(device):
        stage(torch.randn(2, 16, cfg.d_model, device=device), tokens[:, 1:])
    assert seen["block"][1][0] == low  # a stage computes as the whole model does
    dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_parameters_are_gathered_in_the_policy_s_dtype_and_state_and_gradients_stay_fp32():
    """bf16 forced on the CPU (gloo all-gathers it), then fp32, on two ranks: the forward
    computes with the fp32 masters rounded once to the gather dtype; the sharded parameters,
    gradients and AdamW moments are fp32, and bf16 gradients are reduce-scattered in fp32."""
    mp.spawn(_policy_check, args=(2, _free_port(), "cpu"), nprocs=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_on_cuda_auto_gathers_bf16_under_autocast():
    """The same on CUDA (scripts/gpu_check.sh runs it): `auto`'s bf16 over NCCL, on two GPUs
    where there are two (one rank otherwise: FSDP2 still gathers and casts)."""
    world = min(2, torch.cuda.device_count())
    mp.spawn(_policy_check, args=(world, _free_port(), "cuda"), nprocs=world)


class _Unit:
    """What `sum_gradients` sees of an FSDP unit: the methods of one torch version or the other."""

    def __init__(self, newer: bool):
        self.calls: list[tuple[str, object]] = []
        if newer:
            self.set_gradient_divide_factor = lambda f: self.calls.append(("divide", f))
            self.set_force_sum_reduction_for_comms = lambda on: self.calls.append(("sum", on))
        else:
            self.set_reduce_scatter_divide_factor = lambda f: self.calls.append(("rs-divide", f))


def test_gradients_are_summed_on_torch_with_and_without_fsdp2_s_forced_sums():
    newer, older = _Unit(newer=True), _Unit(newer=False)
    sum_gradients(newer)
    sum_gradients(older)
    assert newer.calls == [("divide", 1.0), ("sum", True)]
    assert older.calls == [("rs-divide", 1.0)]


_FIRST_SHARD = """
import sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import relaytrain.parallel.fsdp as fsdp
from relaytrain.model.config import PRESETS
from relaytrain.model.olmo3 import Olmo3
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
before = set(sys.modules)
model = Olmo3(PRESETS["tiny"].with_vocab(64))
fsdp.shard_model(model, list(model.layers.values()), dist.group.WORLD, torch.device("cpu"), 0)
print(sorted(m for m in set(sys.modules) - before if m.startswith("torch._dynamo")))
"""


def test_a_process_s_first_fully_shard_imports_nothing_the_module_did_not():
    """A standby warms up by importing this module: a replacement of a sharded worker must
    not import dynamo (1-2 s) inside the recovery, as FSDP2's first `fully_shard` did."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_SHARD], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
