"""Exact mode under sharding: the integer reduce-scatter sums every rank's micro-batches exactly,
in slices."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relaytrain.parallel.fsdp import (
    SLICE_VALUES,
    ShardedGradReducer,
    _IntegerReduceScatter,
    sum_gradients,
)
from relaytrain.parallel.reduce import from_limbs, to_limbs


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


@pytest.mark.timeout(60)
def test_the_integer_reduce_scatter_sums_every_rank_s_micro_batches_exactly_in_slices():
    """Exact mode's reduce-scatter, on real gloo ranks: the integer sum of every rank's and
    micro-batch's gradient, delivered at the last micro-batch, the same whether the limbs are
    formed all at once or slice by slice (they take 32 bytes a value while formed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_integer_reduce_scatter, args=(3, port), nprocs=3)


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
