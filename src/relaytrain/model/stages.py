"""Cutting the model into pipeline stages of contiguous layers.

The partition balances training FLOPs: the last stage also carries the LM head, whose matmul
costs as much as several blocks at a large vocabulary; the first carries the embedding, whose
lookup is free. A DP over split points minimises the cost of the most expensive stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from relaytrain.errors import ConfigError
from relaytrain.model.accounting import head_flops_per_token, layer_flops_per_token
from relaytrain.model.config import Olmo3Config
from relaytrain.model.olmo3 import Olmo3


def check_layout(n_layers: int, n_stages: int, stage_layers: Sequence[int] | None) -> None:
    """Raise ConfigError unless `n_stages` (parallel.pp) stages of at least one layer each fit,
    with `stage_layers` (if given) positive counts per stage summing to `n_layers`."""
    if not 1 <= n_stages <= n_layers:
        raise ConfigError(f"config key 'parallel.pp': got {n_stages}, expected 1 .. model "
                          f"n_layers={n_layers}")
    if stage_layers is not None and (len(stage_layers) != n_stages or min(stage_layers) < 1
                                     or sum(stage_layers) != n_layers):
        raise ConfigError(f"config key 'parallel.stage_layers': got {list(stage_layers)}, "
                          f"expected {n_stages} positive counts summing to n_layers={n_layers}")


def partition_layers(cfg: Olmo3Config, n_stages: int, stage_layers: Sequence[int] | None = None,
                     seq_len: int | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage, each non-empty.

    `stage_layers` (layers per stage) overrides the balancing. Costs use `seq_len`, by default
    `cfg.max_seq_len`. Among partitions with the same maximum, the DP keeps the first found.
    """
    check_layout(cfg.n_layers, n_stages, stage_layers)
    counts = list(stage_layers) if stage_layers is not None else \
        _balanced_counts(cfg, n_stages, seq_len or cfg.max_seq_len)
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def _balanced_counts(cfg: Olmo3Config, n_stages: int, seq_len: int) -> list[int]:
    n = cfg.n_layers
    cost = [layer_flops_per_token(cfg, i, seq_len) for i in range(n)]
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    head = head_flops_per_token(cfg)

    def span(i: int, j: int) -> float:  # cost of a stage holding layers i..j-1
        return prefix[j] - prefix[i] + (head if j == n else 0.0)

    # best[s][j]: minimal max-cost splitting layers 0..j-1 into s stages; cut[s][j]: last start.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                c = max(best[s - 1][i], span(i, j))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    counts, j = [], n
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def rank_chunks(ranges: Sequence[range], rank: int, n_ranks: int) -> list[range]:
    """The layer ranges pipeline rank `rank` of `n_ranks` holds when the model is cut into
    `len(ranges)` = n_ranks x V virtual stages: virtual stages rank, rank + n_ranks, ... (the
    interleaved schedule's placement; one range when V = 1)."""
    if len(ranges) % n_ranks or not 0 <= rank < n_ranks:
        raise ValueError(f"rank {rank} of {n_ranks} with {len(ranges)} ranges")
    return list(ranges[rank::n_ranks])


def build_stage(cfg: Olmo3Config, stage: int, n_stages: int, ranges: Sequence[range]) -> Olmo3:
    """The module of pipeline rank `stage`: the layers of its chunks (`rank_chunks`; one with
    a plain schedule), plus the embedding (first) or head (last)."""
    chunks = rank_chunks(ranges, stage, n_stages)
    return Olmo3(cfg, layers=[i for r in chunks for i in r], first=stage == 0,
                 last=stage == n_stages - 1)
