"""Weighted mixtures: how many tokens each file contributes, as OLMo-core's source mixtures
(olmo_core.data.source_mixture.SourceMixtureDatasetConfig.build) compute it.

Each source has a target ratio of the requested tokens, a repetition limit (a source may be
taken up to max_repetition_ratio times over) and a cap on the fraction of it used. The ratios
must sum to 1. The requested tokens are rounded up to whole global batches of whole instances,
shared out per file in proportion and completed by Hamilton's method (largest remainders), as
OLMo-core does. A file contributing t tokens contributes its first t // seq_len instances, as
in OLMo-core's NumpyFSLDatasetMixture (mix_index.py indexes that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from relaytrain.errors import DataError


@dataclass(frozen=True)
class Source:
    """One source of a mixture (OLMo-core's SourceMixtureConfig fields)."""

    name: str
    target_ratio: float
    paths: tuple[str, ...]
    max_repetition_ratio: float = 1.0
    max_source_fraction: float = 1.0


def check_sources(sources: Sequence[Source], where: str) -> None:
    """One DataError naming `where` and the source for a mixture OLMo-core would refuse."""
    if not sources:
        raise DataError(f"{where}: no sources; expected sources with target ratios summing to 1")
    for s in sources:
        problem = ("has no paths" if not s.paths
                   else f"target_ratio {s.target_ratio} is not in (0, 1]"
                   if not 0 < s.target_ratio <= 1
                   else f"max_repetition_ratio {s.max_repetition_ratio} is below 1"
                   if s.max_repetition_ratio < 1
                   else f"max_source_fraction {s.max_source_fraction} is not in (0, 1]"
                   if not 0 < s.max_source_fraction <= 1 else "")
        if problem:
            raise DataError(f"{where}: source {s.name!r} {problem}")
    total = float(np.sum([s.target_ratio for s in sources]))
    if not np.allclose(total, 1.0):
        raise DataError(f"{where}: the target ratios sum to {total:g}, not 1 ("
                        + ", ".join(f"{s.name} {s.target_ratio:g}" for s in sources) + ")")


def _path_tokens(source: Source, needed: int, available: int,
                 file_tokens: Mapping[str, int]) -> list[tuple[str, int, int]]:
    """(path, tokens wanted, tokens it has) per pass over the source's files."""
    take = needed / available
    passes = []
    while take > 0:  # OLMo-core's float arithmetic, pass by pass
        passes.append(min(1.0, take))
        take -= passes[-1]
    return [(p, int(math.ceil(file_tokens[p] * r)), file_tokens[p])
            for r in passes for p in source.paths]


def allocate(sources: Sequence[Source], file_tokens: Mapping[str, int], *,
             requested_tokens: int, global_batch_tokens: int, seq_len: int,
             where: str = "mixture") -> list[tuple[str, int]]:
    """(path, tokens) per file and pass, in source order: what each contributes."""
    check_sources(sources, where)
    if requested_tokens <= 0 or global_batch_tokens % seq_len:
        raise DataError(f"{where}: requested tokens must be > 0 and the global batch a whole "
                        "number of instances")
    rows: list[tuple[str, int, int]] = []
    for s in sources:
        available = sum(file_tokens[p] for p in s.paths)
        needed = int(requested_tokens * s.target_ratio)
        most = int((available * s.max_source_fraction) * s.max_repetition_ratio)
        if most < needed:
            raise DataError(f"{where}: source {s.name!r} needs {needed} tokens at ratio "
                            f"{s.target_ratio:g} but has at most {most} ({available} tokens x "
                            f"max_source_fraction x max_repetition_ratio)")
        rows += _path_tokens(s, needed, available, file_tokens)
    per_batch = global_batch_tokens // seq_len
    want = math.ceil(requested_tokens / global_batch_tokens) * per_batch
    caps = [most // seq_len for _, _, most in rows]
    counts = [min(tokens // seq_len, cap) for (_, tokens, _), cap in zip(rows, caps, strict=True)]
    remainders = [(tokens % seq_len) / seq_len if c < cap else 0.0
                  for (_, tokens, _), c, cap in zip(rows, counts, caps, strict=True)]
    extra = want - sum(counts)
    eligible = [i for i in range(len(rows)) if counts[i] < caps[i]]
    if extra > 0 and eligible:
        base = extra // len(eligible)
        for i in eligible if base else ():
            counts[i] += min(base, caps[i] - counts[i])
        extra = want - sum(counts)
        if extra > 0:
            ranked = sorted(((remainders[i], i) for i in eligible if counts[i] < caps[i]),
                            reverse=True)
            for _, i in ranked[:extra]:
                counts[i] += 1
    return [(path, c * seq_len) for (path, _, _), c in zip(rows, counts, strict=True)]
