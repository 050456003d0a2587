"""Pipeline partition: contiguous, complete, balanced by cost; stages compose to the model."""

import dataclasses

import pytest
import torch

from relaytrain.errors import ConfigError
from relaytrain.model.accounting import head_flops_per_token, layer_flops_per_token
from relaytrain.model.config import PRESETS
from relaytrain.model.init import init_weights
from relaytrain.model.olmo3 import Olmo3
from relaytrain.model.stages import build_stage, partition_layers, rank_chunks

torch.set_num_threads(1)
TINY = PRESETS["tiny"].with_vocab(500)


def cfg_with(n_layers, **kw):
    return dataclasses.replace(TINY, n_layers=n_layers, layer_types=(), **kw)


@pytest.mark.parametrize("n_layers", range(1, 9))
def test_every_partition_is_contiguous_complete_and_non_empty(n_layers):
    cfg = cfg_with(n_layers)
    for n_stages in range(1, n_layers + 1):
        ranges = partition_layers(cfg, n_stages)
        assert len(ranges) == n_stages
        assert all(len(r) >= 1 and r.step == 1 for r in ranges)
        assert [i for r in ranges for i in r] == list(range(n_layers))


def stage_costs(cfg, ranges):
    costs = [sum(layer_flops_per_token(cfg, i, cfg.max_seq_len) for i in r) for r in ranges]
    costs[-1] += head_flops_per_token(cfg)
    return costs


def test_partition_minimises_the_most_expensive_stage():
    """Brute force over all cut points agrees with the DP on the maximum stage cost."""
    from itertools import combinations

    cfg = cfg_with(7)
    for n_stages in range(1, 8):
        best = min(
            max(stage_costs(cfg, [range(a, b) for a, b in zip((0, *cuts), (*cuts, 7),
                                                              strict=True)]))
            for cuts in combinations(range(1, 7), n_stages - 1))
        assert max(stage_costs(cfg, partition_layers(cfg, n_stages))) == pytest.approx(best)


def test_the_head_makes_the_last_stage_lighter_in_layers():
    ranges = partition_layers(PRESETS["olmo3-7b"], 4)
    assert len(ranges[-1]) < len(ranges[0])
    assert sum(map(len, ranges)) == 32


def test_explicit_layer_counts_override_the_balance():
    assert partition_layers(cfg_with(6), 3, [1, 2, 3]) == [range(0, 1), range(1, 3), range(3, 6)]
    for bad in ([1, 2], [0, 3, 3], [2, 2, 3]):
        with pytest.raises(ConfigError, match="stage_layers"):
            partition_layers(cfg_with(6), 3, bad)
    with pytest.raises(ConfigError, match="parallel.pp"):
        partition_layers(cfg_with(2), 3)


@pytest.mark.parametrize("counts", [[4], [1, 3], [2, 2], [3, 1], [1, 1, 2], [1, 1, 1, 1]])
def test_stages_compose_to_exactly_the_full_model(counts):
    cfg = cfg_with(4)
    full = Olmo3(cfg)
    init_weights(full, 3)
    ranges = partition_layers(cfg, len(counts), counts)
    stages = [build_stage(cfg, s, len(counts), ranges) for s in range(len(counts))]
    for s in stages:
        init_weights(s, 3)  # same seed: same weights under the same global names
    x = torch.randint(0, 500, (2, 40))
    h = x
    for s in stages:
        h = s(h)
    assert torch.equal(h, full(x))


@pytest.mark.parametrize(("ranks", "chunks"), [(2, 2), (2, 3), (3, 2)])
def test_interleaved_ranks_hold_every_ranks_th_virtual_stage_and_compose_to_the_model(ranks,
                                                                                      chunks):
    """S x V virtual stages; rank r holds r, r + S, ...: one module with the global names, run a
    chunk at a time round the ranks, is the model (the embedding only with the first chunk of
    rank 0, the head only with the last of rank S - 1)."""
    cfg = cfg_with(ranks * chunks)
    full = Olmo3(cfg)
    init_weights(full, 3)
    ranges = partition_layers(cfg, ranks * chunks)
    assert rank_chunks(ranges, 1, ranks) == ranges[1::ranks]
    stages = [build_stage(cfg, r, ranks, ranges) for r in range(ranks)]
    assert sorted(n for s in stages for n, _ in s.named_parameters()) == sorted(
        n for n, _ in full.named_parameters())
    for s in stages:
        init_weights(s, 3)
    x = torch.randint(0, 500, (2, 40))
    h = x
    for v, layers in enumerate(ranges):
        h = stages[v % ranks](h, chunk=layers)
    assert torch.equal(h, full(x))
    with pytest.raises(ValueError, match="several chunks"):
        stages[0](x)
