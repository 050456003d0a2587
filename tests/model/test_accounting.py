"""Parameter counts and FLOPs per token from the config alone."""

import dataclasses

import pytest
import torch

from relaytrain.model.accounting import (
    attention_context,
    flops_per_token,
    layer_matmul_params,
    param_count,
)
from relaytrain.model.config import FULL, PRESETS, SLIDING
from relaytrain.model.olmo3 import Olmo3


def instantiated(cfg):
    with torch.device("meta"):
        return sum(p.numel() for p in Olmo3(cfg).parameters())


def test_olmo3_7b_has_the_published_7_3b_parameters():
    cfg = PRESETS["olmo3-7b"]
    n = instantiated(cfg)
    assert n == param_count(cfg) == 7_298_617_344
    assert round(n / 1e9, 1) == 7.3


@pytest.mark.parametrize("preset", ["olmo3-1b", "olmo3-190m", "small", "tiny"])
def test_analytic_count_matches_the_module(preset):
    cfg = PRESETS[preset]
    cfg = cfg if cfg.vocab_size else cfg.with_vocab(1000)
    assert param_count(cfg) == instantiated(cfg)
    gqa = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads // 2)
    assert param_count(gqa) == instantiated(gqa)
    assert param_count(cfg, include_embedding=False) == param_count(cfg) - (
        cfg.vocab_size * cfg.d_model)


def test_attention_context_is_the_mean_number_of_visible_keys():
    for t in range(1, 30):
        for w in (None, 1, 4, 7, 29):
            visible = [min(q + 1, w or t) for q in range(t)]
            assert attention_context(t, w) == pytest.approx(sum(visible) / t)


def test_flops_are_6n_plus_windowed_attention():
    cfg = PRESETS["tiny"].with_vocab(500)
    t = 64
    heads = cfg.n_heads * cfg.head_dim
    expected = (6 * (cfg.n_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.d_model)
                + 12 * heads * attention_context(t, cfg.sliding_window)  # layer 0: sliding
                + 12 * heads * (t + 1) / 2)  # layer 1: full causal
    assert flops_per_token(cfg, t) == pytest.approx(expected)
    all_full = dataclasses.replace(cfg, layer_types=(FULL, FULL))
    all_sliding = dataclasses.replace(cfg, layer_types=(SLIDING, SLIDING))
    assert flops_per_token(all_sliding, t) < flops_per_token(cfg, t) < flops_per_token(
        all_full, t)
