"""Which shardings keep exact mode's bits: every chunk but a tensor's last must be whole CPU
vectors (torch's fused AdamW updates the values that do not fill a vector one at a time, and
those can differ in the last bit)."""

import pytest
import torch

from relaytrain.parallel.fsdp import VECTOR_VALUES, misaligned


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
