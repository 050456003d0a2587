"""Which shardings keep exact mode's bits (every chunk but a tensor's last must be whole CPU
vectors: torch's fused AdamW updates the values that do not fill a vector one at a time, and those
can differ in the last bit), and which rows of a tensor a rank holds (torch.chunk's split)."""


import pytest
import torch

from relaytrain.parallel.shards import (
    VECTOR_VALUES,
    assign_,
    chunk_rows,
    misaligned,
    own_rows,
    shard_pieces,
)
from relaytrain.train.optim import AdamW


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
        opt = AdamW([{"params": parts, "weight_decay": 0.01}], lr=1e-2, betas=(0.9, 0.999),
                    eps=1e-8)
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


def test_chunk_rows_are_torch_chunk_s_split_the_one_fsdp2_shards_by():
    for rows in range(0, 13):
        for shards in range(1, 7):
            chunks = torch.chunk(torch.arange(rows), shards) if rows else ()
            got = [chunk_rows(rows, shards, r) for r in range(shards)]
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
            assert [g for g in got if g[1] > g[0]] == want, (rows, shards)
            assert all(a <= b for a, b in got) and got[-1][1] == rows


def test_a_plain_tensor_is_whole_and_takes_only_its_own_shape():
    dest = torch.zeros(4, 3)
    assign_(dest, torch.ones(4, 3))
    assert own_rows(dest) is None and torch.equal(dest, torch.ones(4, 3))
    with pytest.raises(ValueError, match=r"\(1, 3\) is not the whole of this rank's part"):
        assign_(dest, torch.ones(1, 3))  # not broadcast
    assert shard_pieces({"a": dest}, first=False) == ({}, {})
    assert shard_pieces({"a": dest}, first=True)[0]["a"] is dest
