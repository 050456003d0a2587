"""`relaytrain parity hf`: numerical parity with HF transformers' Olmo 3, as a table."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    par = sub.add_parser("parity", help="numerical parity with reference implementations")
    psub = par.add_subparsers(dest="parity_command", required=True)
    phf = psub.add_parser("hf", help="against HF transformers' Olmo3ForCausalLM")
    phf.add_argument("--model", default="tiny", help="preset name (default: tiny)")
    phf.add_argument("--steps", type=int, default=20)
    phf.add_argument("--seq-len", type=int, default=None)
    phf.add_argument("--matmul", choices=["aten", "onednn", "auto"], default="aten",
                     help="our model's GEMMs (model.matmul): aten, HF's own, compares bit for "
                          "bit; onednn is what CPU training runs where it measures faster "
                          "(default: aten)")
    phf.add_argument("--kernels", choices=["torch", "fused", "auto"], default="torch",
                     help="our model's RMSNorm, SwiGLU, RoPE and softmax (model.kernels): "
                          "torch, HF's ops; fused, what CPU training runs by default "
                          "(default: torch)")
    phf.add_argument("--json", action="store_true")
    phf.set_defaults(handler=run_parity_hf)


def run_parity_hf(args: argparse.Namespace) -> int:
    """A table, optionally a JSON line; exit 0 within the bars, else 1."""
    from relaytrain.parity.hf import BARS, run_parity

    r = run_parity(args.model, steps=args.steps, seq_len=args.seq_len, matmul=args.matmul,
                   kernels=args.kernels)
    yes = {True: "ok", False: "FAIL"}
    print(f"HF parity, preset {r['preset']}: layers {', '.join(r['layer_types'])}, window "
          f"{r['sliding_window']}, seq_len {r['seq_len']}, vocab {r['tokenizer_vocab']} "
          f"(padded {r['vocab_size']}), {r['dtype']} {r['device']}, HF attention "
          f"{r['hf_attn_implementation']}, our GEMMs {r['matmul']}, our elementwise kernels "
          f"{r['kernels']}, our attention {r['attention']}")
    rows = [
        ("logits max |diff|", r["logits_max_abs_diff"], BARS["logits"], r["ok"]["logits"]),
        ("loss |diff|", r["loss_abs_diff"], BARS["loss"], r["ok"]["loss"]),
        ("grad max rel diff", r["grad_max_rel_diff"], BARS["grad"], r["ok"]["grad"]),
        (f"train loss max |diff| ({r['steps']} steps)", r["train_loss_max_abs_diff"],
         BARS["train_loss"], r["ok"]["train_loss"]),
        ("padded-row grad max", r["padded_rows_max_grad"], 0.0, r["ok"]["padded_rows_inert"]),
    ]
    print(f"{'metric':<36}{'value':>12}{'bar':>10}  ok")
    for name, value, bar, ok in rows:
        print(f"{name:<36}{value:>12.3e}{bar:>10.0e}  {yes[ok]}")
    print(f"loss ours {r['loss_ours']:.6f}, HF {r['loss_hf']:.6f} (HF's own loss "
          f"{r['loss_hf_native']:.6f}); worst gradient: {r['grad_worst_param']}")
    if r["steps"]:
        print(f"training loss {r['train_loss_ours'][0]:.4f} -> {r['train_loss_ours'][-1]:.4f}")
    print("PASS" if r["pass"] else "FAIL")
    if args.json:
        print(json.dumps(r))
    return 0 if r["pass"] else 1
