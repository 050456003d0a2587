"""`relaytrain plot RUN_DIR`: one PNG with the curves a person checks first."""

from __future__ import annotations

from typing import Any

from relaytrain.data.eval_sets import OWN_EVAL_SET
from relaytrain.runlog import RunLog, series


def plot_run(log: RunLog, out: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_step, ax_tok), (ax_lr, ax_tps) = axes
    steps, loss = series(log.steps, "loss")
    tok_steps, tokens = series(log.steps, "tokens")
    ax_step.plot(steps, loss, lw=1, label="training loss")
    ax_tok.plot(tokens, loss, lw=1, label="training loss")
    for label, evals in eval_curves(log.evals):
        for ax, x in ((ax_step, "step"), (ax_tok, "tokens")):
            xs, ys = series(evals, "loss", x)
            ax.plot(xs, ys, "o-", ms=3, label=label)
    ax_step.set_xlabel("step")
    ax_step.set_ylabel("loss (nats)")
    ax_tok.set_xlabel("tokens")
    lr_steps, lr = series(log.steps, "lr")
    ax_lr.plot(lr_steps, lr)
    ax_lr.set_xlabel("step")
    ax_lr.set_ylabel("learning rate")
    tps_steps, tps = series(log.steps, "tokens_per_s")
    ax_tps.plot(tps_steps, tps, lw=1)
    ax_tps.set_xlabel("step")
    ax_tps.set_ylabel("tokens/s")
    marks = {"restart": ("tab:green", "restart"), "recovery": ("tab:red", "recovery")}
    seen: set[str] = set()
    for ev in log.events:
        if ev.get("kind") not in marks:
            continue
        color, label = marks[ev["kind"]]
        for ax in (ax_step, ax_lr, ax_tps):
            ax.axvline(ev["step"], color=color, ls="--", lw=1,
                       label=label if ax is ax_step and label not in seen else None)
        seen.add(label)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    ax_step.legend()
    ax_tok.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def eval_curves(evals: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, records with step, tokens and loss) of each evaluation set, in the order they
    first appear (a log written before named sets: its held-out loss)."""
    curves: dict[str, list[dict[str, Any]]] = {}
    for rec in evals:
        for name, loss in (rec.get("sets") or {OWN_EVAL_SET: rec.get("heldout_loss")}).items():
            curves.setdefault(name, []).append({"step": rec.get("step"),
                                                "tokens": rec.get("tokens"), "loss": loss})
    return [("held-out loss" if name == OWN_EVAL_SET else f"eval set {name}", recs)
            for name, recs in curves.items()]

