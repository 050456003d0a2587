"""Placements: rank r is DP rank r % dp of stage r // dp, members taken in rank order, and the
groups' rank lists agree with them."""

import pytest

from relaytrain.parallel.groups import (
    Placement,
    placements,
    replica_ranks,
    replica_shards,
    shard_size,
    stage_members,
    stage_ranks,
)


def test_a_stage_s_dp_replicas_are_consecutive_ranks():
    got = placements([40, 41, 42, 43, 44, 45], dp=2, pp=3)
    assert list(got) == [40, 41, 42, 43, 44, 45]  # worker ids, in rank order
    assert [(p.rank, p.stage, p.dp_rank) for p in got.values()] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (4, 2, 0), (5, 2, 1)]
    assert {(p.world, p.dp, p.pp) for p in got.values()} == {(6, 2, 3)}


def test_unpipelined_layout_is_all_stage_zero():
    assert placements([7, 3, 5], dp=3, pp=1) == {
        7: Placement(0, 3, 0, 3, 0, 1), 3: Placement(1, 3, 1, 3, 0, 1),
        5: Placement(2, 3, 2, 3, 0, 1)}


@pytest.mark.parametrize(("dp", "pp"), [(1, 4), (2, 2), (3, 2), (4, 1)])
def test_placements_agree_with_the_process_groups(dp, pp):
    got = placements(range(dp * pp), dp, pp)
    for s in range(pp):
        assert stage_ranks(s, dp) == [p.rank for p in got.values() if p.stage == s]
    for d in range(dp):
        assert replica_ranks(d, dp, pp) == [p.rank for p in got.values() if p.dp_rank == d]


def test_a_pipelined_cp_layout_s_stages_span_dp_x_cp_ranks_and_link_equal_cp_ranks():
    """dp 2 x cp 2 x pp 2: a stage's DP group is its dp x cp ranks (they reduce every part of
    every micro-batch), and the pipeline groups (the activations' links) join the ranks of the
    same DP rank and cp rank, each holding the same part of the sequences."""
    got = placements(range(8), dp=2, pp=2, cp=2)
    assert [(p.stage, p.dp_rank, p.cp_rank) for p in got.values()] == [
        (s, d, c) for s in range(2) for d in range(2) for c in range(2)]
    for s in range(2):
        assert stage_ranks(s, 2 * 2) == [p.rank for p in got.values() if p.stage == s]
    for at in range(4):
        link = [p for p in got.values() if p.dp_rank * 2 + p.cp_rank == at]
        assert replica_ranks(at, 2 * 2, 2) == [p.rank for p in link]
        assert len({(p.dp_rank, p.cp_rank) for p in link}) == 1


def test_members_must_fill_the_layout():
    with pytest.raises(ValueError, match="3 members for a layout of dp 2 x pp 2"):
        placements([0, 1, 2], dp=2, pp=2)


def test_a_replica_s_shards_are_consecutive_ranks():
    got = placements([10, 11, 12, 13], dp=4, pp=1, fsdp=2)
    assert [(p.dp_rank, p.replica, p.shard) for p in got.values()] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]


def test_a_dp_rank_s_cp_ranks_are_consecutive_and_share_its_data():
    got = placements([10, 11, 12, 13], dp=2, pp=1, cp=2)
    assert [(p.dp_rank, p.cp_rank) for p in got.values()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {(p.world, p.dp, p.cp) for p in got.values()} == {(4, 2, 2)}
    with pytest.raises(ValueError, match="2 members for a layout of dp 2 x pp 1"):
        placements([0, 1], dp=2, pp=1, cp=2)


def test_a_sharded_replica_s_shards_are_its_fsdp_x_cp_consecutive_ranks():
    """dp 4 (2 replicas x fsdp 2) x cp 2: each replica's state over its 4 ranks, cp ranks
    included (they would hold the same weights); shard k of each replica holds the same rows."""
    got = placements(range(8), dp=4, pp=1, fsdp=2, cp=2)
    assert [(p.replica, p.dp_rank, p.cp_rank, p.shard) for p in got.values()] == [
        (0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 2), (0, 1, 1, 3),
        (1, 2, 0, 0), (1, 2, 1, 1), (1, 3, 0, 2), (1, 3, 1, 3)]
    assert {p.shards for p in got.values()} == {4}
    assert {p.shards for p in placements(range(4), dp=2, pp=1, cp=2).values()} == {1}


def test_shard_over_cp_shards_a_replica_over_its_cp_ranks_at_fsdp_1():
    """dp 2 x cp 4, parallel.shard_over_cp: each DP rank's state over its 4 cp ranks, shard k
    its cp rank k; without it every rank holds the whole state. fsdp > 1 shards over fsdp x cp
    either way (cp ranks always shard a sharded replica), and at cp 1 there is nothing to shard."""
    got = placements(range(8), dp=2, pp=1, cp=4, shard_over_cp=True)
    assert [(p.replica, p.cp_rank, p.shard) for p in got.values()] == [
        (0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 0, 0), (1, 1, 1), (1, 2, 2), (1, 3, 3)]
    assert {p.shards for p in got.values()} == {4}
    assert [replica_shards(1, 4, over) for over in (True, False)] == [4, 1]
    assert [replica_shards(2, 4, over) for over in (True, False)] == [8, 8]
    assert replica_shards(1, 1, True) == 1


def test_a_resized_sharded_run_keeps_whole_replicas_else_shards_over_everyone():
    assert shard_size(4, 2) == 2 and shard_size(2, 2) == 2  # 2 replicas; 1
    assert shard_size(3, 2) == 3  # part of a replica lost: one replica of 3 (uneven chunks)
    assert shard_size(1, 4) == 1 and shard_size(6, 1) == 1


@pytest.mark.parametrize(("dp", "pp", "cp"), [(1, 2, 2), (2, 2, 2), (3, 2, 1), (1, 3, 4)])
def test_a_stage_s_members_are_its_dp_x_cp_ranks(dp, pp, cp):
    """What recovery groups a stage's survivors by: with cp > 1 a stage is dp x cp workers
    (dp 1 x cp 2 x pp 2: [a, b] and [c, d], not [a] and [b])."""
    members = [10 + r for r in range(dp * pp * cp)]
    got = placements(members, dp, pp, cp=cp)
    assert stage_members(members, dp, pp, cp) == [
        [w for w, p in got.items() if p.stage == s] for s in range(pp)]
