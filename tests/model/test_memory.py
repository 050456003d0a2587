"""SavedBytes: the bytes autograd keeps for backward, each storage once, weights excluded.
LiveBytes: the peak bytes of the tensors alive at once, each freed one given back."""

import torch

from relaytrain.model.memory import LiveBytes, SavedBytes


def test_counts_each_saved_storage_once_and_skips_the_weights():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    meter = SavedBytes([w])
    with meter.counting():
        y = torch.tanh(x @ w)  # saves x (for w's gradient) and tanh's output
        z = (x @ w).sum()  # x again: the same storage
    assert meter.nbytes == 2 * x.numel() * 4
    meter.add(x[1:])  # a view of a counted storage
    assert meter.nbytes == 2 * x.numel() * 4
    (y.sum() + z).backward()  # the graph was left intact


def test_counts_nothing_outside_counting():
    w = torch.randn(8, 8, requires_grad=True)
    meter = SavedBytes([w])
    torch.tanh(torch.randn(4, 8) @ w)
    assert meter.nbytes == 0


def test_live_bytes_peaks_at_the_most_alive_at_once_and_skips_what_is_held():
    w, x = torch.randn(64, 64), torch.randn(64, 64)
    size = x.numel() * 4
    with LiveBytes([w]) as live:
        a = x @ w
        b = a * 2  # two alive
        del a  # freed: given back
        c = b + 1  # two alive again, not three
        w.add_(1)  # held: not counted
        view = c[1:]  # the same storage
    assert live.peak == 2 * size and live.nbytes == 2 * size
    assert view.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
