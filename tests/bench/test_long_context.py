"""The long-context bench's exchange counts: a sliding layer fetches only the window's keys,
within the issue's target of window / (seq / cp) of gathering every key, in the plan and on the
wire; a cp worker's activation memory is its share of cp 1's; and the cost of bit identity
across cp degrees is measured on every weight-gradient product of the model."""

import pytest

from relaytrain.bench.long_context import (
    chunked_weight_grads,
    exchange_bytes,
    fetched_tokens,
    longest_sequence,
    step_memory,
    weight_shapes,
)
from relaytrain.model.config import PRESETS, SLIDING


def test_sliding_layers_fetch_the_window_not_the_whole_sequence():
    # Olmo 3's stage 3: two chunks of 4,096 per rank, each with the 4,095 keys before it
    assert fetched_tokens(65_536, 8, 4_096) == 8_190
    assert fetched_tokens(65_536, 8, None) == 65_536 - 8_192  # the late chunk sees everything
    assert 8_190 / 57_344 <= 4_096 / (65_536 / 8)
    for cp in (2, 4):  # the bench's shape: blocks of 128, twice the small preset's window
        assert fetched_tokens(2_048, cp, 64) == {2: 63, 4: 126}[cp]  # 63 before a chunk
        assert fetched_tokens(2_048, cp, 64) / (2_048 - 2_048 // cp) <= 64 / (2_048 / cp)


def test_exact_mode_returns_limbs_four_times_float32_s_bytes():
    kv = 2 * 10 * 8 * 4  # K and V of 10 tokens, 8 values each
    assert exchange_bytes(10, 8, exact=False) == 3 * kv
    assert exchange_bytes(10, 8, exact=True) == 6 * kv


@pytest.mark.timeout(180)
def test_a_cp_worker_holds_its_share_of_the_activations_and_receives_the_window_s_keys():
    """The issue's targets, on gloo ranks: a worker at cp 2 and 4 saves for backward, and holds
    in tensors at its step's peak, at most 1.2 x cp 1's / cp (its own keys and values saved:
    fetched ones are fetched again); its sliding layers' exchanges, measured as handed to
    gloo, move the plan's keys (the window's before each chunk), within window / (seq / cp) of
    gathering every key."""
    one = step_memory(512, 1, resident=False)  # the resident size: the bench's, not here
    width = PRESETS["small"].n_kv_heads * PRESETS["small"].head_dim
    sliding = sum(t == SLIDING for t in PRESETS["small"].layer_types)
    assert one["wire"] == {}
    for cp in (2, 4):
        got = step_memory(512, cp, resident=False)
        assert got["saved"] <= 1.2 * one["saved"] / cp
        assert got["live"] <= 1.2 * one["live"] / cp, (cp, got["live"], one["live"])
        per_layer = got["wire"]["64"] / sliding
        assert per_layer == exchange_bytes(fetched_tokens(512, cp, 64), width, exact=False)
        assert per_layer / exchange_bytes(512 - 512 // cp, width, exact=False) <= 64 / (512 / cp)


def test_the_bench_runs_at_the_longest_power_of_two_that_fits_half_the_memory_within_its_cap():
    """A worker's state plus its step's bytes a token: a budget that holds only the probe's
    length gives the probe's; one that holds 4,096 tokens gives 4,096, or the cap below it."""
    state = 16 * 4_460_800  # the small preset's parameters at the bench's vocabulary
    assert longest_sequence(0, 1_000)["seq_len"] == 256
    fits = 2 * (state + 1_000 * 4_096)
    assert longest_sequence(fits, 1_000, cap=8_192)["seq_len"] == 4_096
    assert longest_sequence(fits - 2, 1_000, cap=8_192)["seq_len"] == 2_048
    got = longest_sequence(fits, 1_000, cap=1_024)
    assert (got["holds"], got["seq_len"], got["state"]) == (4_096, 1_024, state)


def test_the_chunked_gradient_cost_covers_every_linear_weight_of_the_model():
    """What bit identity across cp degrees would chunk: the product dY^T X of every linear
    layer's weight, the head's included (the model's own shapes, in any order); each chunk
    count is timed against one product and one fold."""
    cfg = PRESETS["tiny"].with_vocab(64)
    d, h, kv = cfg.d_model, cfg.mlp_hidden, cfg.n_kv_heads * cfg.head_dim
    q = cfg.n_heads * cfg.head_dim  # q, k, v, o; the MLP's gate, up and down; the head
    block = [(q, d), (kv, d), (kv, d), (d, q), (h, d), (h, d), (d, h)]
    assert sorted(weight_shapes(cfg)) == sorted(block * cfg.n_layers + [(cfg.vocab_size, d)])
    got = chunked_weight_grads(cfg, 32, chunks=(2, 4), repeats=1)
    assert sorted(got["chunks"]) == ["2", "4"]
    assert all(v["s"] > 0 and v["ratio"] == v["s"] / got["exact_s"]
               for v in got["chunks"].values())
