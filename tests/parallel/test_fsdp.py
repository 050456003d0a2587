"""Exact mode under sharding: the integer reduce-scatter, and which shardings keep its bits
(every chunk but a tensor's last must be whole CPU vectors: torch's fused AdamW updates the
values that do not fill a vector one at a time, and those can differ in the last bit)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relaytrain.parallel.fsdp import (
    SLICE_VALUES,
    VECTOR_VALUES,
    ShardedGradReducer,
    _IntegerReduceScatter,
    misaligned,
)
from relaytrain.parallel.reduce import from_limbs, to_limbs


def test_chunks_of_whole_vectors_are_aligned():
    shapes = {"norm": (64,), "proj": (48, 64), "head": (100, 16)}
    assert misaligned(shapes, 1) is None
    assert misaligned(shapes, 2) is None  # 32 values; 24 rows x 64; 50 rows x 16
    assert misaligned(shapes, 4) is None
    assert misaligned(shapes, 3) == ("norm", 22)  # torch.chunk: 22, 22, 20


def test_a_tensor_in_one_chunk_is_aligned_whatever_its_size():
    assert misaligned({"bias": (5,)}, 8) == ("bias", 1)  # 5 chunks of one value
    assert misaligned({"scalar": ()}, 4) is None  # one chunk: as the whole tensor


@pytest.mark.parametrize(("sizes", "same"), [([2048, 2048], True), ([1360, 2736], True),
                                             ([1366, 1366, 1364], False)])
def test_the_fused_optimizer_gives_whole_vector_chunks_the_whole_tensor_s_bits(sizes, same):
    """Why the rule exists (measured on this torch: the 3-way split changes values at each
    chunk's tail; whole-vector chunks never do)."""
    assert all(s % VECTOR_VALUES == 0 for s in sizes[:-1]) == same
    gen = torch.Generator().manual_seed(0)
    n = sum(sizes)
    start = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 1, (n,), generator=gen)
             for _ in range(5)]

    def train(split: list[int]) -> torch.Tensor:
        parts = [x.clone().requires_grad_() for x in torch.split(start, split)]
        opt = torch.optim.AdamW(parts, lr=1e-2, fused=True)
        for g in grads:
            for p, part in zip(parts, torch.split(g, split), strict=True):
                p.grad = part.clone()
            opt.step()
        return torch.cat([opt.state[p]["exp_avg_sq"] for p in parts])

    whole = train([n])
    if same:
        assert torch.equal(train(sizes), whole)
    elif torch.equal(train(sizes), whole):
        pytest.skip("this CPU's kernel gave the same bits on the uneven split")


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
