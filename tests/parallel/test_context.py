"""Context parallelism's split and attention: the zig-zag split balances the causal triangle,
the block attention equals dense masked attention (causal, window, documents), and on real
gloo ranks cp 2 and cp 4 give each rank cp 1's outputs and gradients of its tokens, to the bit
in exact mode; sliding layers fetch only their window's keys."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from relaytrain.model.olmo3 import repeat_kv
from relaytrain.parallel.context import (
    ContextGroup,
    ContextSplit,
    context_attention,
    doc_ids,
    plan_attention,
    split_problem,
)

B, H, HKV, T, D = 2, 4, 2, 128, 8
WINDOW = 16
DOCS = [[10, 40, 13, 65], [128]]  # a row of four documents (one longer than the window) and one


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=gen)
                 for shape in ((B, H, T, D), (B, HKV, T, D), (B, HKV, T, D), (B, H, T, D)))


def _dense(q, k, v, window, docs):
    pos = torch.arange(T)
    seen = pos[None, :] <= pos[:, None]
    if window is not None:
        seen &= pos[None, :] > pos[:, None] - window
    seen = seen[None, None]
    if docs is not None:
        seen = seen & (docs[:, None, :, None] == docs[:, None, None, :])
    return F.scaled_dot_product_attention(q, repeat_kv(k, H // HKV), repeat_kv(v, H // HKV),
                                          attn_mask=seen, scale=D**-0.5)


def _run(split: ContextSplit, group, exact: bool, window, docs) -> tuple[torch.Tensor, ...]:
    """This rank's output and dQ, dK, dV of its tokens (local order)."""
    q, k, v, g = (split.local(x, dim=2).requires_grad_() for x in _inputs())
    comm = ContextGroup(split, group, exact, docs)
    out = context_attention(q, k, v, comm.plan(window), comm, D**-0.5)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), g.detach()))


CASES = [(w, d) for w in (None, WINDOW) for d in (False, True)]


def test_cp_1_equals_dense_masked_attention_causal_windowed_and_by_document():
    q, k, v, g = (x.requires_grad_() for x in _inputs())
    for window, by_doc in CASES:
        docs = doc_ids(DOCS, T) if by_doc else None
        for exact in (False, True):
            got = _run(ContextSplit(T), None, exact, window, docs)
            ref = _dense(q, k, v, window, docs)
            want = (ref.detach(), *torch.autograd.grad(ref, (q, k, v), g.detach()))
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=5e-6)


def test_the_zig_zag_split_balances_the_causal_triangle_and_refuses_uneven_lengths():
    split = ContextSplit(T, degree=4, rank=1)
    assert split.chunks() == (1, 6)  # an early and a late chunk, as OLMo-core's zig-zag
    assert split.positions().tolist() == list(range(16, 32)) + list(range(96, 112))
    work = [sum(p + 1 for p in ContextSplit(T, 4, r).positions().tolist()) for r in range(4)]
    assert len(set(work)) == 1  # every rank scores as many causal pairs
    assert split_problem(T, 4) is None and "multiple of 2 x cp x 4" in split_problem(120, 4)
    with pytest.raises(ValueError, match="do not split over cp 4"):
        ContextSplit(120, degree=4)


def test_sliding_layers_fetch_only_the_window_s_keys_and_documents_cut_the_fetch():
    """At cp 4 of 128 tokens (chunks of 16, blocks of 8) a rank holds two chunks and fetches
    the 16-token window before each, where full layers fetch every earlier block."""
    split = ContextSplit(T, degree=4, rank=2)
    full, sliding = plan_attention(split), plan_attention(split, WINDOW)
    assert sliding.fetched_tokens == 2 * WINDOW
    assert full.fetched_tokens == 64  # keys 0..32 and 48..80: all before 96 held elsewhere
    by_doc = plan_attention(split, None, doc_ids([[64, 64]], T))
    assert by_doc.fetched_tokens == 48  # 0..32, and 64..80 of the second document


def _ranks(rank: int, degree: int, port: int, exact: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=degree)
    try:
        for window, by_doc in CASES:
            docs = doc_ids(DOCS, T) if by_doc else None
            split = ContextSplit(T, degree, rank)
            got = _run(split, dist.group.WORLD, exact, window, docs)
            want = [split.local(x, dim=2) for x in _run(ContextSplit(T), None, exact, window,
                                                        docs)]
            for a, b in zip(got, want, strict=True):
                if exact:
                    assert torch.equal(a, b), (window, by_doc, (a - b).abs().max())
                else:
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)  # four spawned processes importing torch on a shared 2-core host
# Each mode at one degree in CI (exact where the split is finest), the others on demand
@pytest.mark.parametrize(("exact", "degree"), [(True, 4), (False, 2)] + [
    pytest.param(e, d, marks=pytest.mark.soak) for e, d in [(True, 2), (False, 4)]])
def test_cp_ranks_get_cp_1_s_outputs_and_gradients_bit_identical_in_exact_mode(degree, exact):
    """Real gloo ranks, causal and sliding, with and without documents: each rank's outputs,
    dQ, dK and dV are cp 1's for its tokens, to the bit in exact mode (one softmax per query
    block over the same keys in the same order; dK/dV summed as integers), within float
    rounding in fast mode."""
    mp.spawn(_ranks, args=(degree, _free_port(), exact), nprocs=degree)


def test_the_model_with_a_cp_1_context_trains_as_without_one():
    """The tiny model (a sliding and a full layer) given the split as its context: positions
    from the split, every layer through the block attention; loss and gradients as the plain
    model's, to float rounding."""
    from relaytrain.model.config import PRESETS
    from relaytrain.model.init import init_weights
    from relaytrain.model.olmo3 import Olmo3

    model = Olmo3(PRESETS["tiny-gqa"].with_vocab(300))
    init_weights(model, seed=0)
    tokens = torch.randint(0, 300, (2, 65), generator=torch.Generator().manual_seed(1))
    got = []
    for context in (None, ContextGroup(ContextSplit(64), None, exact=True)):
        model.zero_grad()
        kwargs = {} if context is None else {"context": context}
        loss = model(tokens[:, :-1], labels=tokens[:, 1:], **kwargs)[0]
        loss.backward()
        got.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_model_with_a_cp_1_context_keeps_documents_as_without_one():
    """Packed rows (documents shorter and longer than the window) given the split as the
    context with their document lengths: attention within documents, RoPE positions from each
    document's start, as the unsplit document-masked model; loss and gradients to float
    rounding, and not those of the rows unmasked."""
    from relaytrain.model.config import PRESETS
    from relaytrain.model.init import init_weights
    from relaytrain.model.olmo3 import Olmo3

    cfg = PRESETS["tiny-gqa"].with_vocab(300)
    model = Olmo3(cfg)
    init_weights(model, seed=0)
    tokens = torch.randint(0, 300, (2, 65), generator=torch.Generator().manual_seed(1))
    long = cfg.sliding_window + 5
    doc_lens = torch.tensor([[3, long, 64 - 3 - long], [64, 0, 0]])
    got = []
    for kwargs in ({"doc_lens": doc_lens},
                   {"doc_lens": doc_lens, "context": ContextGroup(ContextSplit(64), None, True)},
                   {"context": ContextGroup(ContextSplit(64), None, True)}):
        model.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:], **kwargs)[0]
        loss.backward()
        got.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(got[0], got[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert abs(float(got[1][0] - got[2][0])) > 1e-4  # the documents change the loss


def test_bf16_inputs_are_scored_in_fp32_and_get_gradients_of_their_dtype():
    """Under CUDA's autocast q, k, v arrive in bf16: scores, softmax and sums run in fp32 (as
    flash kernels'), the output and gradients come back in bf16."""
    q, k, v, g = (x.bfloat16().requires_grad_() for x in _inputs())
    comm = ContextGroup(ContextSplit(T), None, exact=True)
    out = context_attention(q, k, v, comm.plan(WINDOW), comm, D**-0.5)
    grads = torch.autograd.grad(out, (q, k, v), g.detach())
    assert {t.dtype for t in (out, *grads)} == {torch.bfloat16}
    ref = _dense(*(x.detach().float() for x in (q, k, v)), WINDOW, None)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=8e-3)  # bf16's rounding of out
