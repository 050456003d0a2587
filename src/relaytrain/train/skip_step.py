"""OLMo-core's skip-step rule (`optim.skip_spikes`): a step whose loss or gradient norm lies
more than `sigma` standard deviations above the mean of the previous steps' is not applied.

Read from ai2-olmo-core's `SkipStepOptimizer.get_step_factor` (olmo_core/optim/
skip_step_optimizer.py) and its use in `TransformerTrainModule`:
- the window holds the last `window` steps' global CE loss (z-loss excluded) and pre-clip
  global gradient norm, skipped steps included (every step's values are appended);
- the rule applies once the window and the current step hold max(2, window // 2) values;
- mean and standard deviation (Bessel-corrected, torch.std_mean) of the window, not counting the
  current step; skip unless `x - mean <= sigma * std` for the loss and the norm (NaN: skip);
- the gradient norm takes part only with clipping on (OLMo-core records it in clipping);
- a skip multiplies the update by 0: weights, both moments and AdamW's step count stay as they
  were, while the learning-rate schedule (the trainer's step) moves on.

Here the sums are exact (`math.fsum`) in float64 on the host, so every layout and host decides
alike; OLMo-core sums float32 on the device, so a value within float32 rounding of the threshold
could decide differently there. Unlike OLMo-core (whose window starts empty after every
restart), the window is kept by the controller, written into each checkpoint's manifest and
passed to the workers with each dispatch (`SkipHistory`), so a resumed or recovered run skips
the steps an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from relaytrain.config.sections import RunConfig


@dataclass(frozen=True)
class SkipHistory:
    """The previous steps' global CE losses and gradient norms (oldest first, at most the
    window): what a step is compared with; crosses from the controller to the workers."""

    losses: tuple[float, ...] = ()
    grad_norms: tuple[float, ...] = ()  # empty when the norm takes no part (clipping off)


@dataclass(frozen=True)
class SkipRule:
    """The rule's parameters, and its decision as a pure function of a history and a step."""

    window: int = 128  # OLMo-core's rolling_interval_length
    sigma: float = 6.0  # OLMo-core's sigma_factor
    use_norm: bool = True  # OLMo-core feeds the norm only when it clips

    @classmethod
    def from_config(cls, cfg: RunConfig) -> SkipRule | None:
        """The run's rule; None when `optim.skip_spikes` is off."""
        o = cfg.optim
        if not o.skip_spikes:
            return None
        return cls(o.skip_window, o.skip_sigma, cfg.train.clip > 0)

    def skips(self, history: SkipHistory, loss: float, grad_norm: float) -> bool:
        """Whether the step with global CE `loss` and `grad_norm` is skipped after `history`."""
        if len(history.losses) + 1 < max(2, self.window // 2):
            return False
        return above(history.losses, loss, self.sigma) or (
            self.use_norm and above(history.grad_norms, grad_norm, self.sigma))

    def then(self, history: SkipHistory, loss: float, grad_norm: float) -> SkipHistory:
        """`history` with one more step (skipped or not), cut to the window."""
        norms = (*history.grad_norms, grad_norm)[-self.window:] if self.use_norm else ()
        return SkipHistory((*history.losses, loss)[-self.window:], norms)


class SkipCheck:
    """A span's steps checked in order: each step's decision, then its values appended."""

    def __init__(self, rule: SkipRule, history: SkipHistory):
        self.rule, self.history = rule, history

    def __call__(self, loss: float, grad_norm: float) -> bool:
        skip = self.rule.skips(self.history, loss, grad_norm)
        self.history = self.rule.then(self.history, loss, grad_norm)
        return skip


def above(previous: Sequence[float], x: float, sigma: float) -> bool:
    """Whether `x` is not within `sigma` sample standard deviations above `previous`' mean
    (NaN, as of a single previous value, counts as above: torch.std_mean's and OLMo-core's)."""
    n = len(previous)
    mean = math.fsum(previous) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in previous) / (n - 1)) if n > 1 \
        else math.nan
    return not (x - mean <= sigma * std)


def global_ce(losses: dict[int, tuple[float, float, float]], micro_batches: int,
              group: dist.ProcessGroup | None, device: torch.device,
              pipe: dist.ProcessGroup | None = None) -> float:
    """The step's CE loss over every DP rank's micro-batches, as the reporter computes it (fsum
    in global micro-batch index order / M): one slot per micro-batch, each filled by the one
    rank that computed it, summed over the replica's pipeline group `pipe` (a pipeline stage:
    only the last stage holds losses) and then the DP group (x + 0.0 is exact), so the value
    does not depend on the layout. A collective on every rank of `pipe` and `group`."""
    values = [0.0] * micro_batches
    for index, (_, ce, _) in losses.items():
        values[index] = ce
    slots = torch.tensor(values, dtype=torch.float64, device=device)
    for g in (pipe, group):
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(slots, group=g)
    return math.fsum(slots.tolist()) / micro_batches


class SkipWindow:
    """The controller's record of every recent step's (global CE, gradient norm), by step: the
    history each dispatch carries, and each checkpoint's manifest holds. Steps redone after a
    restore overwrite their entries."""

    def __init__(self, rule: SkipRule, saved: dict[str, Any] | None = None):
        self.rule = rule
        self.values: dict[int, tuple[float, float]] = {}
        if saved:  # a manifest's `skip_window`
            for i, loss in enumerate(saved["losses"]):
                norms = saved["grad_norms"]
                self.values[saved["first_step"] + i] = (loss, norms[i] if norms else math.nan)

    def take(self, first: int, records: list[dict[str, Any]], oldest: int) -> None:
        """Steps first, first+1, ... as the reporter recorded them (`ce_loss`, `grad_norm`);
        then drops what no restore to `oldest` or after needs."""
        for i, rec in enumerate(records):
            self.values[first + i] = (rec["ce_loss"], rec["grad_norm"])
        for s in [s for s in self.values if s <= oldest - self.rule.window]:
            del self.values[s]

    def history(self, step: int) -> SkipHistory:
        """What step `step + 1` is compared with: the known steps of the window ending at
        `step` (fewer after a resume from a checkpoint that holds none)."""
        history = SkipHistory()
        for s in range(step - self.rule.window + 1, step + 1):
            if s in self.values:
                history = self.rule.then(history, *self.values[s])
        return history

    def saved(self, step: int) -> dict[str, Any]:
        """The window ending at `step`, for its checkpoint's manifest."""
        history = self.history(step)
        return {"first_step": step - len(history.losses) + 1, "losses": list(history.losses),
                "grad_norms": list(history.grad_norms)}
