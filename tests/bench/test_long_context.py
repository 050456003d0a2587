"""The long-context bench's exchange counts: a sliding layer fetches only the window's keys,
within the issue's target of window / (seq / cp) of gathering every key."""

import pytest

from relaytrain.bench.long_context import (
    exchange_bytes,
    fetched_tokens,
    longest_sequence,
    step_memory,
)


def test_sliding_layers_fetch_the_window_not_the_whole_sequence():
    # Olmo 3's stage 3: two chunks of 4,096 per rank, each with the 4,096 keys before it
    assert fetched_tokens(65_536, 8, 4_096) == 8_192
    assert fetched_tokens(65_536, 8, None) == 65_536 - 8_192  # the late chunk sees everything
    assert 8_192 / 57_344 <= 4_096 / (65_536 / 8)
    for cp in (2, 4):  # the bench's own shape: blocks of 64 = the small preset's window
        assert fetched_tokens(1_024, cp, 64) / (1_024 - 1_024 // cp) <= 64 / (1_024 / cp)


def test_exact_mode_returns_limbs_four_times_float32_s_bytes():
    kv = 2 * 10 * 8 * 4  # K and V of 10 tokens, 8 values each
    assert exchange_bytes(10, 8, exact=False) == 3 * kv
    assert exchange_bytes(10, 8, exact=True) == 6 * kv


@pytest.mark.timeout(180)
def test_a_cp_worker_saves_its_share_of_the_activations():
    """The issue's target, on gloo ranks: a worker at cp 2 and 4 saves for backward at most
    1.2 x cp 1's / cp (its own keys and values only: fetched ones are fetched again)."""
    one = step_memory(512, 1)
    for cp in (2, 4):
        assert step_memory(512, cp)["saved"] <= 1.2 * one["saved"] / cp


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
