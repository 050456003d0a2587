"""A worker's membership of a generation of one worker: no process group is formed, so there is
nothing to reduce over, abort or leave; the layout follows the placement."""

from __future__ import annotations

import torch
import torch.distributed as dist

from relaytrain.parallel.groups import Placement
from relaytrain.runtime.membership import Membership


def test_a_world_of_one_joins_without_a_process_group():
    m = Membership(torch.device("cpu"))
    assert m.layout == (0, 1, 1) and m.generation == -1
    m.join(3, Placement(rank=0, world=1, dp_rank=0, dp=1), None, 1.0)
    assert not dist.is_initialized()
    assert (m.generation, m.layout, m.dp_group(), m.groups, m.shard_group) == (
        3, (0, 1, 1), None, None, None)
    assert not m.abort(3)  # no collective to abort
    m.leave()
    assert m.groups is None and m.shard_group is None
