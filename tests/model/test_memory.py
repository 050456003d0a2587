"""SavedBytes: the bytes autograd keeps for backward, each storage once, weights excluded."""

import torch

from relaytrain.model.memory import SavedBytes


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
