"""The alarms of a run: the loss-spike detector and the memorisation alarm; the peak FLOP/s a
run's MFU divides by."""

import math

import torch

from relaytrain.train.metrics import MemorisationAlarm, SpikeDetector, run_peak_flops

# --- spike detector: a loss above factor x the mean of the last `window` losses ---------------

def test_a_loss_over_factor_times_the_recent_mean_is_a_spike():
    spikes = SpikeDetector(factor=3.0)
    assert [spikes.check(1.0) for _ in range(5)] == [None] * 5
    assert spikes.check(3.0) is None  # 3x the mean exactly is not above it
    assert spikes.check(4.01) == "loss spike: 4.0100 is 3.0x the recent mean 1.3333"


def test_no_spike_before_five_losses():
    spikes = SpikeDetector(factor=3.0)
    assert [spikes.check(v) for v in (1.0, 1.0, 1.0, 1.0, 100.0)] == [None] * 5
    assert spikes.check(60.0) is None  # 100 is now in the mean (20.8; 3x is 62.4)


def test_the_mean_forgets_losses_older_than_the_window():
    spikes = SpikeDetector(factor=3.0, window=5)
    for v in [100.0] * 5 + [1.0] * 5:
        spikes.check(v)
    assert spikes.check(3.5) is not None  # the 100s are out of the window


def test_a_non_finite_loss_is_always_reported_and_kept_out_of_the_mean():
    spikes = SpikeDetector(factor=3.0)
    assert spikes.check(math.nan) == "loss is nan"
    assert spikes.check(math.inf) == "loss is inf"
    for _ in range(5):
        spikes.check(1.0)
    assert list(spikes.recent) == [1.0] * 5


# --- memorisation alarm: held-out pulling away from training loss -----------------------------

def test_a_gap_above_memo_gap_fires_at_once():
    alarm = MemorisationAlarm(gap=0.5, patience=3)
    assert alarm.update(2.0, 2.5) is None  # exactly the gap is not above it
    message = alarm.update(2.0, 2.6)
    assert message is not None and "exceeds training loss 2.0000 by 0.6000 nats" in message
    assert "eval.memo_gap=0.5" in message


def test_held_out_rising_while_training_falls_for_patience_evaluations_fires():
    alarm = MemorisationAlarm(gap=10.0, patience=3)
    trend = [(3.0, 3.0), (2.9, 3.1), (2.8, 3.2)]
    assert [alarm.update(*p) for p in trend] == [None] * 3  # two rises: not yet three
    message = alarm.update(2.7, 3.3)
    assert message is not None and "over 3 evaluations (3.0000 -> 3.3000 held-out)" in message


def test_one_evaluation_against_the_trend_resets_the_patience():
    alarm = MemorisationAlarm(gap=10.0, patience=2)
    for train, held in [(3.0, 3.0), (2.9, 3.1), (2.8, 3.05), (2.7, 3.1)]:
        assert alarm.update(train, held) is None  # held-out fell once: one rise since
    assert alarm.update(2.6, 3.2) is not None
    flat_train = MemorisationAlarm(gap=10.0, patience=2)
    assert [flat_train.update(3.0, h) for h in (3.0, 3.1, 3.2)] == [None] * 3


# --- MFU's denominator: one measurement per process, device and thread count ----------------


def test_the_runs_of_one_process_share_one_measured_peak():
    cpu = torch.device("cpu")
    first = run_peak_flops(cpu, 1)
    assert first[0] > 0 and "1 thread(s)" in first[1]
    assert run_peak_flops(cpu, 1) is first  # the second run measures nothing
    assert "2 thread(s)" in run_peak_flops(cpu, 2)[1]  # another thread count is its own
