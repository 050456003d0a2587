"""Intra-document masking: a packed instance's logits are each document's logits run alone
(attention within the document, RoPE positions from its start, as OLMo-core's
`RotaryEmbedding` given `cu_doc_lens`), whichever kernel path runs it."""

import dataclasses

import pytest
import torch

from relaytrain.model.config import PRESETS
from relaytrain.model.documents import document_block_mask, document_positions, document_spans
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3

torch.set_num_threads(1)
# 3 layers: sliding (window 16), full, sliding; GQA; YaRN on the full layer
CFG = dataclasses.replace(PRESETS["tiny"].with_vocab(500), n_layers=3, n_kv_heads=2,
                          layer_types=("sliding_attention", "full_attention",
                                       "sliding_attention"),
                          rope_scaling={"factor": 4.0, "original_max_position_embeddings": 16,
                                        "beta_fast": 32, "beta_slow": 1})
# Documents shorter than the window (16), as long, and longer; one row a single document.
DOC_LENS = [[5, 30, 1, 12, 16], [64, 0, 0, 0, 0], [17, 47, 0, 0, 0]]


def model(attention="auto", kernels="torch"):
    m = Olmo3(CFG)
    init_weights(m, 0)
    m.configure(attention=attention, kernels=kernels)
    return m.eval()


def alone(m, tokens, doc_lens):
    """Each document run by itself, the logits concatenated back into rows."""
    out = torch.empty(*tokens.shape, m.n_logits)
    for row, start, n in document_spans(doc_lens, tokens.shape[1]):
        out[row, start:start + n] = m(tokens[row:row + 1, start:start + n])[0]
    return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention, kernels", [("chunks", "torch"), ("sdpa", "torch"),
                                                ("chunks", "fused"), ("flex", "torch")])
@torch.no_grad()
def test_a_packed_instance_is_its_documents_run_alone(attention, kernels):
    m = model(attention, kernels)
    tokens = torch.randint(0, 500, (3, 64), generator=torch.Generator().manual_seed(1))
    doc_lens = torch.tensor(DOC_LENS, dtype=torch.int32)
    packed = m(tokens, doc_lens=doc_lens)
    torch.testing.assert_close(packed, alone(m, tokens, doc_lens), rtol=0, atol=1e-5)
    crossed = m(tokens)  # without the lengths, attention crosses the documents
    assert (crossed - packed).abs().max() > 1e-2


def test_the_loss_of_a_packed_micro_batch_trains_within_documents():
    m = model()
    m.train()
    tokens = torch.randint(0, 500, (3, 65), generator=torch.Generator().manual_seed(2))
    doc_lens = torch.tensor(DOC_LENS, dtype=torch.int32)
    total, _, _ = m(tokens[:, :-1], labels=tokens[:, 1:], doc_lens=doc_lens)
    total.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_positions_restart_at_every_document_as_olmo_cores_rope_counts_them():
    rope = pytest.importorskip("olmo_core.nn.rope")
    doc_lens = torch.tensor([[3, 5], [8, 0]], dtype=torch.int32)
    mine = document_positions(doc_lens, 8)
    r = rope.RotaryEmbedding(head_size=4, theta=10_000)
    q = torch.randn(2, 8, 1, 4)
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32)  # OLMo-core's flattened cumulative
    theirs, _ = r(q, q, head_first=False, cu_doc_lens=cu)
    second, _ = r(q[:1, 3:], q[:1, 3:], head_first=False)  # the second document alone
    assert mine.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))]
    torch.testing.assert_close(theirs[0, 3:], second[0])
    torch.testing.assert_close(theirs[1], r(q, q, head_first=False)[0][1])


def visible(block_mask, row, t):
    """The [T, T] pairs row `row` of a block mask lets through (FlexAttention's semantics: a
    listed full tile, or a listed partial tile where mask_mod says yes)."""
    bq, bk = block_mask.BLOCK_SIZE
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    elementwise = block_mask.mask_mod(torch.tensor(row), 0, q, k)
    out = torch.zeros(t, t, dtype=torch.bool)
    for counts, indices, full in ((block_mask.kv_num_blocks, block_mask.kv_indices, False),
                                  (block_mask.full_kv_num_blocks,
                                   block_mask.full_kv_indices, True)):
        for i in range(counts.shape[-1]):
            for j in indices[row, 0, i, : counts[row, 0, i]].tolist():
                rows, cols = slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk)
                out[rows, cols] |= True if full else elementwise[rows, cols][:, :t]
    return out


@pytest.mark.parametrize("t, block, window", [(200, 16, 40), (200, 16, None), (600, 128, 300),
                                              (600, 128, None), (100, 32, 7)])
def test_the_document_block_mask_lets_through_exactly_each_documents_causal_window(
        t, block, window):
    rng = torch.Generator().manual_seed(t + block)
    rows = []
    for _ in range(3):  # documents within a tile, across tiles, whole tiles and the whole row
        cuts = sorted(torch.randperm(t - 1, generator=rng)[:int(torch.randint(0, 9, (1,),
                      generator=rng))].add(1).tolist())
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, t], strict=True)]
        rows.append(lens + [0] * (10 - len(lens)))
    doc_lens = torch.tensor(rows, dtype=torch.int32)
    bm = document_block_mask(doc_lens, t, window, block)
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for r, lens in enumerate(rows):
        doc = torch.repeat_interleave(torch.arange(10), torch.tensor(lens))
        want = (k <= q) & (doc[:, None] == doc[None, :]) & (q - k < (window or t))
        assert torch.equal(visible(bm, r, t), want), r
    n = -(-t // block)  # tile counts only: nothing of size T x T is built
    assert bm.kv_indices.shape == bm.full_kv_indices.shape == (3, 1, n, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
def test_on_cuda_the_flex_document_mask_trains_as_the_documents_alone():
    torch.manual_seed(0)
    m = model("flex").cuda().train()
    tokens = torch.randint(0, 500, (3, 65), device="cuda")
    doc_lens = torch.tensor(DOC_LENS, dtype=torch.int32, device="cuda")
    total, _, _ = m(tokens[:, :-1], labels=tokens[:, 1:], doc_lens=doc_lens)
    total.backward()
    with torch.no_grad():
        packed = m(tokens[:, :-1], doc_lens=doc_lens)
        torch.testing.assert_close(packed, alone(m, tokens[:, :-1], doc_lens), rtol=0, atol=1e-4)
