"""The checkpoint benchmark: model-shaped state, and ratios against the raw disk."""

from __future__ import annotations

import math

import pytest

from relaytrain.bench.checkpoint import bench_checkpoint_local, format_report, param_shapes
from relaytrain.errors import UserError
from relaytrain.model.accounting import param_count
from relaytrain.model.config import PRESETS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_state_has_the_parameter_count_of_the_preset(preset):
    cfg = PRESETS[preset]
    if cfg.vocab_size is None:
        cfg = cfg.with_vocab(50257)
    shapes = param_shapes(cfg)
    assert sum(math.prod(s) for s in shapes.values()) == param_count(cfg)
    assert {"embed.weight", "norm.weight", "lm_head.weight",
            "layers.0.attn.q_norm.weight", "layers.0.mlp.down_proj.weight"} <= shapes.keys()


def test_quick_bench_reports_bandwidth_next_to_the_raw_disk(tmp_path):
    result = bench_checkpoint_local(["tiny"], quick=True, directory=str(tmp_path))
    r = result["sizes"]["tiny"]
    assert r["bytes"] > 3 * 4 * r["params"] - 1
    for key in ("save_GBps", "restore_GBps", "raw_write_GBps", "raw_read_GBps",
                "save_vs_raw", "restore_vs_raw"):
        assert r[key] > 0, key
    assert "x raw" in format_report(result)
    assert list(tmp_path.iterdir()) == []  # cleans up after itself


def test_unknown_preset_is_a_one_line_user_error():
    with pytest.raises(UserError, match="unknown model preset 'huge'"):
        bench_checkpoint_local(["huge"])

