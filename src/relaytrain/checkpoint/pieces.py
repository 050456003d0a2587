"""Rows of tensors held apart: which rows of a piece a reader wants, and the wanted rows put
back together. A sharded run's checkpoint files and its workers' in-memory snapshots both hold
pieces (rows [start, stop) of a larger tensor); a reader asks for whole tensors or for the rows
its own shard holds under another layout."""

from __future__ import annotations

import torch

Rows = dict[str, tuple[int, int]]  # tensor name -> the rows [start, stop) of it wanted
Piece = tuple[int | None, torch.Tensor]  # (first row, rows), or (None, a whole unsharded tensor)
Where = dict[str, list[int]]  # a piece's record: {"shape": the whole shape, "rows": [start, stop]}


def rows_to_take(key: str, span: tuple[int, int] | None, sharded: bool, rows: Rows
                 ) -> tuple[int | None, int, int] | None:
    """What to take of a held tensor `key` that holds rows `span` of the whole (None: a tensor
    without rows): (None, 0, 0) the whole (unsharded and not among `rows`); (first row in the
    whole tensor, i, j) its rows [i, j); None nothing (it holds none of the rows wanted)."""
    if span is None or (key not in rows and not sharded):
        return None, 0, 0
    a, b = rows.get(key, span)
    if a == b:  # an empty chunk (more shards than rows): the type and row shape only
        return a, 0, 0
    lo, hi = max(a, span[0]), min(b, span[1])
    return (lo, lo - span[0], hi - span[0]) if lo < hi else None


def cut(tensors: dict[str, torch.Tensor], shards: dict[str, Where], rows: Rows
        ) -> dict[str, Piece]:
    """Held tensors (pieces where `shards` says so) as pieces cut to the rows wanted."""
    out: dict[str, Piece] = {}
    for key, t in tensors.items():
        where = shards.get(key)
        span = tuple(where["rows"]) if where else ((0, t.shape[0]) if t.dim() else None)
        got = rows_to_take(key, span, where is not None, rows)
        if got is not None:
            first, i, j = got
            out[key] = (first, t if first is None else t[i:j])
    return out


def assemble(key: str, parts: list[tuple[int, torch.Tensor]], want: tuple[int, int],
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `want` of tensor `key` from pieces that must cover them exactly once (ValueError
    naming what they hold otherwise); copied into `out` when it has their shape and dtype (the
    tensor they restore), else a piece itself or a new tensor."""
    parts = sorted(parts, key=lambda p: p[0])
    end = want[0]
    for start, t in parts:
        if start != end:
            break
        end += t.shape[0]
    if not parts or end != want[1] or parts[0][0] != want[0]:
        got = [(a, a + t.shape[0]) for a, t in parts]
        raise ValueError(f"rows {want[0]}:{want[1]} of {key} wanted, its pieces hold {got}")
    first = parts[0][1]
    if out is not None and out.dtype == first.dtype and \
            tuple(out.shape) == (want[1] - want[0], *first.shape[1:]):
        for start, t in parts:
            if t is not out:
                out[start - want[0]:start - want[0] + t.shape[0]].copy_(t)
        return out
    return first if len(parts) == 1 else torch.cat([t for _, t in parts])
