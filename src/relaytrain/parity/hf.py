"""Numerical parity of our Olmo 3 with HF transformers' `Olmo3ForCausalLM`.

Both models get the same weights (through the one name mapping in `relaytrain.model.hf`),
run in fp32 on the CPU, and are compared on logits, loss, the gradient of every parameter and
the loss of every step of a short AdamW training run on identical random batches. The default
preset mixes sliding-window and full layers and the sequence is longer than the window, so the
window mask is exercised; the vocabulary is padded (500 -> 512) so padding is exercised too.
`tiny-gqa` is the same with grouped-query attention (2 kv heads serving 4 query heads), as
`olmo3-32b` has.

HF runs with `attn_implementation="sdpa"`, the kernels we call, and the two then agree bit for
bit on the CPU (with "eager" they differ by float reassociation, ~1e-6, within the bars). Both
losses are our `lm_loss` (z-loss off) applied to each model's logits with the same
already-shifted labels, so only the models differ; HF's own loss function on its logits is
reported as well. Tokens never include `pad_token_id`: HF's embedding freezes that row's
gradient (`padding_idx`), an inference convention that pre-training (and our model) does not
follow.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from relaytrain.errors import UserError
from relaytrain.model.config import PRESETS, SLIDING, Olmo3Config
from relaytrain.model.hf import VOCAB_ROWS, ours_to_hf_name, ours_to_hf_state, to_hf_config
from relaytrain.model.init import derive_seed, init_weights
from relaytrain.model.loss import lm_loss
from relaytrain.model.olmo3 import Olmo3

BARS = {"logits": 1e-5, "loss": 1e-5, "grad": 1e-5, "train_loss": 1e-5}
PARITY_VOCAB = 500  # tokenizer size used when the preset leaves the vocabulary to the data
BATCH = 2
TRAIN_BATCHES = 4


def _batch(gen: torch.Generator, cfg: Olmo3Config, seq_len: int) -> tuple[Tensor, Tensor]:
    """Random inputs and next-token labels over the tokenizer vocabulary minus the pad id."""
    n = (cfg.tokenizer_vocab or cfg.vocab_size) - 1
    tokens = torch.randint(0, n, (BATCH, seq_len + 1), generator=gen)
    tokens += (tokens >= cfg.pad_token_id).long()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _grad_rel_diffs(ours: Olmo3, hf: torch.nn.Module, cfg: Olmo3Config,
                    ) -> tuple[dict[str, float], float]:
    """Per parameter ||g_ours - g_hf|| / ||g_hf||, and the largest gradient on padded rows."""
    hf_params = dict(hf.named_parameters())
    rows = cfg.tokenizer_vocab or cfg.vocab_size
    rel, padded = {}, 0.0
    for name, p in ours.named_parameters():
        g = p.grad
        if name in VOCAB_ROWS:
            padded = max(padded, g[rows:].abs().max().item() if g.shape[0] > rows else 0.0)
            g = g[:rows]
        g_hf = hf_params[ours_to_hf_name(name)].grad
        rel[name] = ((g - g_hf).norm() / g_hf.norm().clamp(min=1e-30)).item()
    return rel, padded


def hf_twin(model: Olmo3) -> torch.nn.Module:
    """HF's `Olmo3ForCausalLM` (SDPA attention) holding a copy of `model`'s weights."""
    import transformers

    hf = transformers.Olmo3ForCausalLM(to_hf_config(model.cfg))
    hf.set_attn_implementation("sdpa")
    hf.load_state_dict(ours_to_hf_state(model.state_dict(), model.cfg), strict=True)
    return hf


def _train_curves(ours: Olmo3, hf: torch.nn.Module, pool: list[tuple[Tensor, Tensor]],
                  steps: int) -> tuple[list[float], list[float]]:
    """Both models' losses over a short training run, identical optimizers and batches. The
    batches are revisited so the loss falls (random tokens cannot be learned, but memorised)."""
    def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                 weight_decay=0.1, foreach=False)

    opt_ours, opt_hf = adamw(ours), adamw(hf)
    curve_ours, curve_hf = [], []
    for step in range(steps):
        opt_ours.zero_grad(set_to_none=True)
        opt_hf.zero_grad(set_to_none=True)
        inputs, labels = pool[step % len(pool)]
        a = lm_loss(ours(inputs), labels, 0.0)[0]
        b = lm_loss(hf(input_ids=inputs).logits, labels, 0.0)[0]
        a.backward()
        b.backward()
        opt_ours.step()
        opt_hf.step()
        curve_ours.append(a.item())
        curve_hf.append(b.item())
    return curve_ours, curve_hf


def run_parity(preset: str = "tiny", steps: int = 20, seq_len: int | None = None,
               seed: int = 0, matmul: str = "aten", kernels: str = "torch") -> dict[str, Any]:
    """Compare our model with HF's on `preset`; a dict of differences, bars and verdicts.

    `matmul` is our model's GEMM backend (`model.matmul`): `aten`, HF's own, for the
    bit-for-bit comparison; `onednn` differs from it in the products' last bits only, well
    within the bars. `kernels`: `torch`, HF's own ops and its dense-mask SDPA for the sliding
    layers; `fused`, what CPU training runs under `auto`: the fused kernels (`model.kernels`)
    and sliding layers through `model.attention: chunks` (the fused window kernel where it
    takes the head dim), which round differently."""
    if preset not in PRESETS:
        raise UserError(f"unknown model preset {preset!r}; known: {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    if cfg.vocab_size is None:
        cfg = cfg.with_vocab(PARITY_VOCAB)
    seq_len = seq_len or cfg.max_seq_len
    if seq_len < 2 or steps < 0:
        raise UserError(f"need --seq-len >= 2 and --steps >= 0, got {seq_len} and {steps}")

    ours = Olmo3(cfg)
    init_weights(ours, seed)
    hf = hf_twin(ours)
    try:
        ours.configure(attention="sdpa" if kernels == "torch" else "auto", matmul=matmul,
                       kernels=kernels)
    except ValueError as e:
        raise UserError(f"parity hf: {e}") from e
    ours.train()
    hf.train()
    gen = torch.Generator().manual_seed(derive_seed(seed, "parity", preset))

    # One forward/backward: logits, loss and every gradient.
    inputs, labels = _batch(gen, cfg, seq_len)
    logits_ours = ours(inputs)
    logits_hf = hf(input_ids=inputs).logits
    loss_ours = lm_loss(logits_ours, labels, 0.0)[0]
    loss_hf = lm_loss(logits_hf, labels, 0.0)[0]
    loss_hf_native = hf.loss_function(logits=logits_hf, labels=None, shift_labels=labels,
                                      vocab_size=logits_hf.shape[-1])
    loss_ours.backward()
    loss_hf.backward()
    rel, padded_grad = _grad_rel_diffs(ours, hf, cfg)
    worst = max(rel, key=rel.get)

    pool = [_batch(gen, cfg, seq_len) for _ in range(TRAIN_BATCHES)]
    curve_ours, curve_hf = _train_curves(ours, hf, pool, steps)

    diffs = {
        "logits": (logits_ours - logits_hf).abs().max().item(),
        "loss": abs(loss_ours.item() - loss_hf.item()),
        "grad": rel[worst],
        "train_loss": max((abs(x - y) for x, y in zip(curve_ours, curve_hf, strict=True)),
                          default=0.0),
    }
    ok = {k: math.isfinite(v) and v <= BARS[k] for k, v in diffs.items()}
    ok["padded_rows_inert"] = padded_grad == 0.0
    return {
        "preset": preset, "seq_len": seq_len, "steps": steps, "seed": seed, "batch": BATCH,
        "tokenizer_vocab": cfg.tokenizer_vocab, "vocab_size": cfg.vocab_size,
        "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
        "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
        "window_exercised": SLIDING in cfg.layer_types and seq_len > cfg.sliding_window,
        "hf_attn_implementation": "sdpa", "dtype": "float32", "device": "cpu",
        "matmul": ours.matmul, "kernels": "fused" if ours.fused else "torch",
        "attention": ours.attention,
        "logits_max_abs_diff": diffs["logits"],
        "loss_ours": loss_ours.item(), "loss_hf": loss_hf.item(),
        "loss_hf_native": loss_hf_native.item(), "loss_abs_diff": diffs["loss"],
        "grad_max_rel_diff": diffs["grad"], "grad_worst_param": worst,
        "padded_rows_max_grad": padded_grad,
        "train_loss_max_abs_diff": diffs["train_loss"],
        "train_loss_ours": curve_ours, "train_loss_hf": curve_hf,
        "bars": BARS, "ok": ok, "pass": all(ok.values()),
    }

