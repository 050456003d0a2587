"""Intra-document masking (`model.document_masking`): in a packed instance every token attends
only to earlier tokens of its own document (and, in sliding layers, only within the window),
and RoPE counts positions from the document's start, as OLMo-core does given `doc_lens`
(its `RotaryEmbedding` with `cu_doc_lens`, olmo_core/nn/rope.py): a packed instance's logits
are each document's logits as if it ran alone. (RoPE scores depend on relative positions
only, so restarting them changes the results by rounding alone: the masking is what matters.)

Two ways, neither ever building a T x T mask:
- per-document spans (`Documents`, the CPU's path): attention runs once per document on its
  own [L, L] problem through the kernels a whole sequence uses (SDPA `is_causal` for full
  layers; the window kernel or the chunks for sliding ones, or under `model.attention: sdpa`
  the L x L window mask that backend builds for a whole sequence anyway), with RoPE's tables
  cut to the first L positions. The cost is the sum of L^2 (or L x window) over
  the documents, never T^2, and a document's attention is computed as it would be alone
  (the logits then differ from a lone run's by GEMM rounding only, ~4e-7 on the tiny model). At
  65K tokens of a few dozen documents the Python loop over documents is noise next to the
  attention itself.
- a FlexAttention block mask (`document_block_mask`, CUDA's path, and `model.attention:
  flex`): built from tile arithmetic like the sliding block mask (`olmo3.sliding_block_mask`),
  (T / 128)^2 small integers per row: a tile pair is skipped when no document spans both,
  full when one document covers both and causality (and the window) hold for every pair, and
  partial otherwise, where `mask_mod` compares document ids. RoPE takes per-token tables
  gathered at each token's position in its document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask


@dataclass(frozen=True)
class Documents:
    """What a layer receives for a mask on the per-document path: the documents, as (row,
    first token, length), and, for sliding layers, the window mask of each length over the
    window (`Olmo3.sliding_mask`; None: causal, as for full layers)."""

    spans: tuple[tuple[int, int, int], ...]
    masks: dict[int, Any] | None = None


def document_spans(doc_lens: Tensor, seq_len: int) -> tuple[tuple[int, int, int], ...]:
    """(row, first token, length) of every document of `doc_lens` [B, D] (zero-padded, each
    row summing to `seq_len`: OLMo-core's doc_lens)."""
    rows = doc_lens.tolist()
    out = []
    for b, lens in enumerate(rows):
        lens = [int(n) for n in lens if n > 0]
        if sum(lens) != seq_len:
            raise ValueError(f"doc_lens row {b} sums to {sum(lens)}, not the {seq_len} tokens")
        start = 0
        for n in lens:
            out.append((b, start, n))
            start += n
    return tuple(out)


def document_ids(doc_lens: Tensor, length: int) -> Tensor:
    """int32 [B, length]: each token's document index in its row (positions past the row's
    tokens, a tile's padding, get -1: they match no document)."""
    out = torch.full((doc_lens.shape[0], length), -1, dtype=torch.int32, device=doc_lens.device)
    for b, lens in enumerate(doc_lens.tolist()):
        lens = [int(n) for n in lens if n > 0]
        ids = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32),
                                      torch.tensor(lens))
        out[b, :ids.numel()] = ids.to(out.device)
    return out


def document_positions(doc_lens: Tensor, seq_len: int) -> Tensor:
    """int64 [B, seq_len]: each token's position within its document (RoPE's)."""
    ids = document_ids(doc_lens, seq_len).long()
    starts = torch.cumsum(doc_lens.long(), 1) - doc_lens.long()
    return torch.arange(seq_len, device=doc_lens.device)[None, :] - starts.gather(1, ids)


def document_block_mask(doc_lens: Tensor, seq_len: int, window: int | None,
                        block: int) -> BlockMask:
    """The FlexAttention block mask of causal attention within documents (and within `window`
    tokens when given), from tile arithmetic: nothing of size T^2."""
    n = -(-seq_len // block)
    doc = document_ids(doc_lens, n * block)
    device = doc.device
    first = doc[:, ::block]  # [B, n]: each tile's first token's document
    last = doc[:, block - 1::block].clone()
    last[:, -1] = doc[:, seq_len - 1]  # the last tile's last real token
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    q_lo, q_hi = i * block, torch.clamp((i + 1) * block, max=seq_len) - 1
    k_lo, k_hi = j * block, (j + 1) * block - 1
    w = seq_len if window is None else window
    touched = (k_lo <= q_hi) & (k_hi > q_lo - w)
    full = (k_hi <= q_lo) & (k_lo > q_hi - w) & (k_hi < seq_len)
    shared = last[:, None, :] >= first[:, :, None]  # [B, q tile, k tile]: a document in both
    one = first[:, None, :] == last[:, :, None]  # one document covers both tiles
    touched, full = touched & shared, full & one

    def rows(tiles: Tensor) -> tuple[Tensor, Tensor]:
        count = tiles.sum(-1, dtype=torch.int32)
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[:, None], order[:, None]

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (k <= q) & (q - k < w) & (doc[b, q] == doc[b, k])

    partial_count, partial_idx = rows(touched & ~full)
    full_count, full_idx = rows(full)
    return BlockMask.from_kv_blocks(partial_count, partial_idx, full_count, full_idx,
                                    BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))
