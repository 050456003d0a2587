"""The long-context bench's exchange counts: a sliding layer fetches only the window's keys,
within the issue's target of window / (seq / cp) of gathering every key."""

import pytest

from relaytrain.bench.long_context import activation_bytes, exchange_bytes, fetched_tokens


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
    one = activation_bytes(512, 1)
    for cp in (2, 4):
        assert activation_bytes(512, cp) <= 1.2 * one / cp
