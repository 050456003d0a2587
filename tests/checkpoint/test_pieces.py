"""Rows held apart (a sharded run's checkpoint files and snapshots): any layout's pieces give
back any other layout's rows, exactly, and a gap or an overlap is an error, never a guess."""

import pytest
import torch

from relaytrain.checkpoint.pieces import assemble, cut


def chunks(rows: int, n: int) -> list[tuple[int, int]]:
    """torch.chunk's split of `rows` over `n` shards (empty chunks at the end)."""
    size = -(-rows // n)
    return [(min(k * size, rows), min((k + 1) * size, rows)) for k in range(n)]


@pytest.mark.parametrize("rows", [1, 5, 12])
@pytest.mark.parametrize("old", [1, 2, 3, 4])
@pytest.mark.parametrize("new", [1, 2, 3, 8])
def test_any_layout_s_pieces_give_any_other_layout_s_rows(rows, old, new):
    whole = torch.arange(rows * 3.0).reshape(rows, 3)
    holders = [({"w": whole[a:b], "step": torch.tensor(7.0)},
                {"w": {"shape": [rows, 3], "rows": [a, b]}}) for a, b in chunks(rows, old)]
    for a, b in chunks(rows, new):
        parts = []
        for tensors, where in holders:
            for key, (first, t) in cut(tensors, where, {"w": (a, b)}).items():
                if first is None:  # not sharded: whole from every holder
                    assert key == "step" and t.item() == 7.0
                else:
                    parts.append((first, t))
        got = assemble("w", parts, (a, b))
        assert torch.equal(got, whole[a:b]) and got.shape == (b - a, 3)


def test_pieces_go_into_the_tensor_they_restore_when_it_has_their_shape():
    whole = torch.arange(30.0).reshape(10, 3)
    parts = [(2, whole[2:4]), (4, whole[4:7])]
    out = torch.zeros(5, 3)
    assert assemble("w", parts, (2, 7), out) is out and torch.equal(out, whole[2:7])
    other = torch.zeros(5, 3, dtype=torch.float64)  # another dtype: a new tensor, it untouched
    got = assemble("w", parts, (2, 7), other)
    assert got is not other and torch.equal(got, whole[2:7]) and not other.any()


def test_a_gap_or_an_overlap_names_the_rows_held():
    w = torch.zeros(10, 2)
    with pytest.raises(ValueError, match=r"rows 0:10 of w wanted, its pieces hold \[\(0, 4\), "
                                         r"\(6, 10\)\]"):
        assemble("w", [(0, w[:4]), (6, w[6:])], (0, 10))
    with pytest.raises(ValueError, match=r"\(0, 6\), \(4, 10\)"):
        assemble("w", [(0, w[:6]), (4, w[4:])], (0, 10))
    with pytest.raises(ValueError, match=r"its pieces hold \[\]"):
        assemble("w", [], (0, 10))


def test_a_whole_tensor_not_asked_for_by_rows_comes_whole():
    t = torch.ones(4, 2)
    assert cut({"w": t}, {}, {})["w"][0] is None  # unsharded, no rows asked: whole
    first, part = cut({"w": t}, {}, {"w": (1, 3)})["w"]
    assert first == 1 and torch.equal(part, t[1:3])
    assert cut({"w": t[:2]}, {"w": {"shape": [4, 2], "rows": [0, 2]}}, {"w": (2, 4)}) == {}
