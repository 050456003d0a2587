"""optim.skip_spikes: the steps our rule skips on a recorded loss / gradient-norm series with
spikes are those ai2-olmo-core's own `SkipStepAdamW` skips (driven here as its train module
drives it), a skipped step leaves the weights and AdamW's state as OLMo-core's does, and the
window the controller keeps survives a checkpoint's manifest."""

from __future__ import annotations

import math
import random

import pytest
import torch

from relaytrain.parallel.reduce import GradReducer
from relaytrain.train.optim import AdamW
from relaytrain.train.skip_step import SkipCheck, SkipHistory, SkipRule, SkipWindow
from relaytrain.train.step import train_step

olmo_optim = pytest.importorskip("olmo_core.optim")
pytestmark = pytest.mark.timeout(60)


def recorded_series(steps: int, seed: int = 3) -> list[tuple[float, float]]:
    """A training run's (CE loss, gradient norm) per step, as float32 values (what OLMo-core's
    tensors hold): a decaying loss with noise, loss spikes, norm spikes, and a burst of both
    that the window then holds."""
    r = random.Random(seed)
    out = []
    for s in range(steps):
        loss = 3.0 + 0.5 * math.exp(-s / 200) + r.gauss(0, 0.03)
        norm = 0.4 + 0.3 * math.exp(-s / 200) + abs(r.gauss(0, 0.05))
        if s in (70, 131, 200, 201, 202):
            loss += 1.5
        if s in (90, 160, 201, 240):
            norm *= 8
        if s == 95:  # a dip: never a skip
            loss -= 0.5
        out.append((float(torch.tensor(loss)), float(torch.tensor(norm))))
    return out


def olmo_core_skipped(series: list[tuple[float, float]], window: int, sigma: int,
                      use_norm: bool) -> tuple[list[int], bool]:
    """The steps OLMo-core's SkipStepAdamW skips on `series`, fed as TransformerTrainModule feeds
    it (the reduced CE loss, then with clipping the total norm, then step()); and whether on
    every skipped step its parameter and state stayed as they were."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = olmo_optim.SkipStepAdamW([p], lr=1e-2, weight_decay=0.1,
                                   rolling_interval_length=window, sigma_factor=sigma)
    skipped, untouched = [], True
    for s, (loss, norm) in enumerate(series):
        p.grad = torch.full((4,), 0.1 * (s % 7 - 3))
        opt.latest_loss = torch.tensor(loss)
        if use_norm:
            opt.latest_grad_norm = torch.tensor(norm)
        before = [t.clone() for t in (p.detach(), *opt.state[p].values())]
        opt.step()
        if opt.step_skipped.item() == 1.0:
            skipped.append(s)
            after = [p.detach(), *opt.state[p].values()]
            untouched &= all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return skipped, untouched


def our_skipped(series: list[tuple[float, float]], rule: SkipRule) -> list[int]:
    check = SkipCheck(rule, SkipHistory())
    return [s for s, (loss, norm) in enumerate(series) if check(loss, norm)]


@pytest.mark.parametrize(("window", "sigma", "use_norm"), [
    (128, 6, True),  # OLMo-core's defaults (and ours)
    (20, 3, True),
    (20, 3, False),  # no clipping: OLMo-core never sees a norm
    (7, 2, True),
])
def test_the_steps_skipped_are_olmo_cores(window, sigma, use_norm):
    series = recorded_series(300)
    theirs, untouched = olmo_core_skipped(series, window, sigma, use_norm)
    ours = our_skipped(series, SkipRule(window, float(sigma), use_norm))
    assert ours == theirs
    assert theirs and untouched  # it skipped something, and left the state alone doing so
    if window == 128:  # the spikes, not noise (a loss burst's later steps are in the window)
        assert set(theirs) >= {70, 131, 200, 90, 160, 240} and 95 not in theirs


def test_the_rule_waits_for_half_a_window_and_compares_with_the_steps_before():
    rule = SkipRule(window=8, sigma=1.0)
    quiet = SkipHistory((1.0, 1.1), (1.0, 1.0))
    assert not rule.skips(quiet, 100.0, 1.0)  # 2 earlier + this one < 8 // 2
    history = rule.then(quiet, 1.0, 1.0)
    assert rule.skips(history, 100.0, 1.0) and rule.skips(history, 1.0, 1.5)
    assert not rule.skips(history, 0.5, 1.0)
    assert not SkipRule(8, 1.0, use_norm=False).skips(SkipHistory(history.losses), 1.0, 99.0)
    for _ in range(20):
        history = rule.then(history, 2.0, 1.0)
    assert history.losses == (2.0,) * 8 and len(history.grad_norms) == 8


def test_the_window_survives_a_manifest_and_drops_only_what_no_restore_needs():
    import json

    rule = SkipRule(window=6, sigma=1.0)
    window = SkipWindow(rule)
    records = [{"ce_loss": 5.0 - 0.1 * s, "grad_norm": 1.0 + s / 3} for s in range(1, 13)]
    window.take(1, records, oldest=12)
    assert min(window.values) == 7  # step 12's window: 7 .. 12
    saved = json.loads(json.dumps(window.saved(12)))
    again = SkipWindow(rule, saved)
    assert again.history(12) == window.history(12) and len(again.history(12).losses) == 6
    assert again.history(12).losses[-1] == records[-1]["ce_loss"]
    assert SkipWindow(rule, None).history(12) == SkipHistory()  # a checkpoint holding none


def _tiny_step(skip):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = AdamW([{"params": model.parameters(), "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8)

    class Loss(torch.nn.Module):  # the model's forward returns (total, ce, z)
        def forward(self, x, labels, z_loss):
            ce = model(x.float()).pow(2).mean()
            return ce, ce.detach(), (ce * 0).detach()

    wrapped = Loss()
    reducer = GradReducer(list(model.parameters()), None, exact=True, total_micro_batches=2)
    batches = [(i, torch.arange(5 * (i + 1), 5 * (i + 2)).view(1, 5) % 3) for i in range(2)]
    out = [train_step(wrapped, opt, reducer, batches, 2, 0.0, 1.0, torch.device("cpu"), None)]
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              [t.clone() for s in opt.state.values() for t in s.values()])
    seen = []
    out.append(train_step(wrapped, opt, reducer, batches, 2, 0.0, 1.0, torch.device("cpu"),
                          lambda loss, norm: seen.append((loss, norm)) or skip))
    after = (model.state_dict(), [t for s in opt.state.values() for t in s.values()])
    return out, seen, before, after


@pytest.mark.parametrize("skip", [True, False])
def test_a_skipped_step_leaves_the_weights_and_adamw_state_as_they_were(skip):
    out, seen, before, after = _tiny_step(skip)
    same = all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and all(
        torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))
    assert same == skip and out[1].skipped == skip and not out[0].skipped
    # the rule saw the global CE loss (fsum over micro-batches / M) and the pre-clip norm
    assert seen == [(math.fsum(v[1] for v in out[1].losses.values()) / 2, out[1].grad_norm)]
