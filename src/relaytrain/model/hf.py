"""HF transformers interop: the one name mapping, config translation and `relaytrain convert`.

Vocabulary: HF checkpoints keep `tokenizer_vocab` rows (100278 for Olmo 3); we train with
`vocab_size` rows padded to a multiple of 128 (100352) for matmul efficiency. Import pads the
embedding and head with zero rows, export drops them, so HF -> relay -> HF is bit-identical.

The HF side is a directory with `config.json` and `*.safetensors`; the relay side is a
checkpoint of `relaytrain.checkpoint.store` (a step directory, checkpoints root or run
directory when reading; a new checkpoints root holding step 0 when writing). Outputs are
written to a temporary sibling directory and renamed into place, so a failure leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relaytrain.checkpoint.keys import model_key, model_tensors, rename_parameter
from relaytrain.errors import CheckpointError, UserError
from relaytrain.model.config import FULL, SLIDING, Olmo3Config, pad_vocab

HF_ARCHITECTURE = "Olmo3ForCausalLM"

_GLOBAL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # ours (after "layers.{i}.") -> HF (after "model.layers.{i}.")
    **{f"attn.{p}.weight": f"self_attn.{p}.weight"
       for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
    "attn_norm.weight": "post_attention_layernorm.weight",
    **{f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    "mlp_norm.weight": "post_feedforward_layernorm.weight",
}
_GLOBAL_NAMES_INV = {v: k for k, v in _GLOBAL_NAMES.items()}
_LAYER_NAMES_INV = {v: k for k, v in _LAYER_NAMES.items()}
VOCAB_ROWS = ("embed.weight", "lm_head.weight")  # tensors with one row per vocabulary entry


def ours_to_hf_name(name: str) -> str:
    """`layers.3.attn_norm.weight` -> `model.layers.3.post_attention_layernorm.weight`."""
    return rename_parameter(name, _GLOBAL_NAMES, _LAYER_NAMES, "layers.", "model.layers.", "Olmo 3")


def hf_to_ours_name(name: str) -> str:
    """`model.layers.3.post_attention_layernorm.weight` -> `layers.3.attn_norm.weight`."""
    return rename_parameter(name, _GLOBAL_NAMES_INV, _LAYER_NAMES_INV, "model.layers.", "layers.",
                   "HF Olmo 3")


def ours_to_hf_state(tensors: Mapping[str, Tensor], cfg: Olmo3Config) -> dict[str, Tensor]:
    """Our weights under HF names, vocabulary rows cut to `tokenizer_vocab`."""
    rows = cfg.tokenizer_vocab or cfg.vocab_size
    return {ours_to_hf_name(n): (t[:rows] if n in VOCAB_ROWS else t) for n, t in tensors.items()}


def hf_to_ours_state(tensors: Mapping[str, Tensor], cfg: Olmo3Config) -> dict[str, Tensor]:
    """HF weights under our names, vocabulary rows zero-padded to `vocab_size`."""
    out = {}
    for name, t in tensors.items():
        try:
            ours = hf_to_ours_name(name)
        except ValueError as e:
            raise CheckpointError(f"unexpected tensor {name!r} in the HF checkpoint: "
                                  "expected Olmo 3 weights only") from e
        if ours in VOCAB_ROWS and t.ndim == 2 and t.shape[0] < cfg.vocab_size:
            t = torch.cat([t, t.new_zeros(cfg.vocab_size - t.shape[0], t.shape[1])])
        out[ours] = t
    return out


def check_state(tensors: Mapping[str, Tensor], cfg: Olmo3Config, source: str) -> None:
    """Every parameter of the model present with the model's shape, nothing else."""
    from relaytrain.model.olmo3 import Olmo3

    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in Olmo3(cfg).named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{source} lacks {len(missing)} tensor(s) of the model, e.g. "
                              f"{missing[0]!r}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{source} has tensor(s) the config does not describe, e.g. "
                              f"{extra[0]!r}")
    for n, shape in expected.items():
        if tuple(tensors[n].shape) != shape:
            raise CheckpointError(f"{source}: tensor {n!r} has shape "
                                  f"{tuple(tensors[n].shape)}, the config implies {shape}")


# ---------------------------------------------------------------------------------------------
# Configs


def to_hf_config(cfg: Olmo3Config) -> Any:
    """The `transformers.Olmo3Config` of the same model (YaRN on full-attention layers only)."""
    import transformers

    if cfg.vocab_size is None:
        raise ValueError("Olmo3Config.vocab_size is None: set it (cfg.with_vocab(n)) first")
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        full = {**full, "rope_type": "yarn", **cfg.rope_scaling}
    return transformers.Olmo3Config(
        vocab_size=cfg.tokenizer_vocab or cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.rms_eps,
        pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=False,
        attention_bias=False,
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types),
        rope_parameters={"sliding_attention": {"rope_type": "default",
                                               "rope_theta": cfg.rope_theta},
                         "full_attention": full},
        architectures=[HF_ARCHITECTURE],
    )


_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "attention_factor")


def _rope_from_hf(d: Mapping[str, Any]) -> tuple[float, dict[str, float] | None]:
    """(theta, YaRN parameters or None) from `rope_parameters` (transformers >= 5, one entry
    per layer type) or the older top-level `rope_theta` + `rope_scaling` (full layers only)."""
    rp = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", 500_000.0)
    full = rp.get(FULL) or {"rope_theta": theta, **(d.get("rope_scaling") or {})}
    sliding = rp.get(SLIDING) or {"rope_theta": theta}
    theta = full.get("rope_theta", theta)
    kinds = {k: p.get("rope_type", p.get("type", "default")) for k, p in
             ((FULL, full), (SLIDING, sliding))}
    if sliding.get("rope_theta", theta) != theta or kinds[SLIDING] != "default" or \
            kinds[FULL] not in ("default", "yarn"):
        raise CheckpointError(f"unsupported RoPE settings in config.json ({dict(rp) or full}): "
                              "expected one rope_theta, default RoPE on sliding layers and "
                              "default or yarn on full layers")
    if kinds[FULL] == "default":
        return float(theta), None
    return float(theta), {k: full[k] for k in _YARN_KEYS if full.get(k) is not None}


def from_hf_config(d: Mapping[str, Any]) -> Olmo3Config:
    """Our config from an HF `config.json` dict; raises CheckpointError if it is not Olmo 3."""
    arch = d.get("architectures") or []
    if d.get("model_type") != "olmo3" or (arch and HF_ARCHITECTURE not in arch):
        raise CheckpointError(f"config.json describes model_type={d.get('model_type')!r} "
                              f"architectures={arch}; expected model_type 'olmo3' "
                              f"({HF_ARCHITECTURE})")
    if d.get("tie_word_embeddings") or d.get("attention_bias") or \
            d.get("hidden_act", "silu") != "silu":
        raise CheckpointError("config.json asks for tied embeddings, attention biases or a "
                              "non-SiLU activation; Olmo 3 has none of these")
    try:
        vocab, heads, n_layers = d["vocab_size"], d["num_attention_heads"], d["num_hidden_layers"]
        theta, scaling = _rope_from_hf(d)
        layer_types = d.get("layer_types") or [
            FULL if (i + 1) % 4 == 0 else SLIDING for i in range(n_layers)]
        eos, pad = d.get("eos_token_id"), d.get("pad_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        ids = {k: v for k, v in (("eos_token_id", eos), ("pad_token_id", pad)) if v is not None}
        return Olmo3Config(
            d_model=d["hidden_size"], n_layers=n_layers, n_heads=heads,
            n_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            mlp_hidden=d["intermediate_size"], vocab_size=pad_vocab(vocab),
            tokenizer_vocab=vocab, rms_eps=d.get("rms_norm_eps", 1e-5), rope_theta=theta,
            max_seq_len=d.get("max_position_embeddings", 2048),
            sliding_window=d.get("sliding_window") or 4096, layer_types=tuple(layer_types),
            rope_scaling=scaling, init_std=d.get("initializer_range", 0.02), **ids)
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the key {e.args[0]!r} of an Olmo 3 "
                              "config") from e


# ---------------------------------------------------------------------------------------------
# relaytrain convert


def read_hf(src: Path, meta: bool = False) -> tuple[Olmo3Config, dict[str, Tensor]]:
    """Config and our-named weights of an HF Olmo 3 directory (all `*.safetensors` in it),
    checked against the config; with `meta`, tensors on the meta device of the stored shapes,
    from the files' headers alone (`init.from` checks a source before any worker loads it)."""

    if not src.is_dir():
        raise CheckpointError(f"HF model directory {str(src)!r} does not exist; expected a "
                              "directory with config.json and *.safetensors")
    try:
        cfg = from_hf_config(json.loads((src / "config.json").read_text()))
    except FileNotFoundError as e:
        raise CheckpointError(f"{str(src)!r} has no config.json; expected an HF model "
                              "directory (save_pretrained)") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(src / 'config.json')!r} is not valid JSON: {e}") from e
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{str(src)!r} has no *.safetensors weights")
    hf: dict[str, Tensor] = {}
    for f in files:
        hf.update(_safetensors_shapes(f) if meta else _load_file(f))
    tensors = hf_to_ours_state(hf, cfg)
    check_state(tensors, cfg, f"HF checkpoint {str(src)!r}")
    return cfg, tensors


def _load_file(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _safetensors_shapes(path: Path) -> dict[str, Tensor]:
    """A safetensors file's tensors as meta tensors of their shapes (its header only)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}  # noqa: SIM118


def read_relay(src: str) -> tuple[Olmo3Config, dict[str, Tensor]]:
    """Config and model weights of one of our checkpoints (optimizer state is left out)."""
    from relaytrain.checkpoint.store import open_checkpoint

    if "://" not in src and not Path(src).exists():
        raise CheckpointError(f"checkpoint {src!r} does not exist; expected a run directory, "
                              "a checkpoints root or a step directory")
    manifest, tensors = open_checkpoint(src)
    if not isinstance(manifest.get("model"), dict):
        raise CheckpointError(f"checkpoint {src!r} has no model config in its manifest")
    try:
        cfg = Olmo3Config.from_dict(manifest["model"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {src!r}: bad model config in its manifest ({e})") from e
    model = model_tensors(tensors)
    check_state(model, cfg, f"checkpoint {src!r}")
    return cfg, model


def write_hf(cfg: Olmo3Config, tensors: Mapping[str, Tensor], out: Path) -> None:
    """`config.json` + `model.safetensors` loadable by `Olmo3ForCausalLM.from_pretrained`."""
    from safetensors.torch import save_file

    try:
        hf_cfg = to_hf_config(cfg)
    except ImportError as e:
        raise UserError("relay-to-hf needs transformers: pip install 'relaytrain[parity]'") from e
    hf_cfg.dtype = tensors["embed.weight"].dtype  # what from_pretrained(dtype="auto") loads
    hf_cfg.save_pretrained(out)
    save_file({n: t.contiguous() for n, t in ours_to_hf_state(tensors, cfg).items()},
              out / "model.safetensors", metadata={"format": "pt"})


def write_relay(cfg: Olmo3Config, tensors: Mapping[str, Tensor], out: Path) -> None:
    """A checkpoints root holding step 0: part "model", keys `model.<name>`."""
    from relaytrain.checkpoint.store import CheckpointStore

    store = CheckpointStore(str(out))
    info = store.write_part(0, "model", {model_key(n): t for n, t in tensors.items()})
    store.commit(0, {"model": info}, {"model": cfg.to_dict(), "config": None, "source": "hf"})


def convert(direction: str, src: str, dst: str | Path) -> Mapping[str, Tensor]:
    """Convert `src` into the new local directory `dst` ("hf-to-relay" or "relay-to-hf"), written
    to a temporary sibling and renamed into place so a failure leaves nothing; the tensors."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"destination {str(dst)!r} exists and is not an empty directory; "
                              "give a new path")
    if direction == "hf-to-relay":
        cfg, tensors = read_hf(Path(src))
        write = write_relay
    else:
        cfg, tensors = read_relay(src)
        write = write_hf
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        write(cfg, tensors, tmp)
        if dst.exists():
            dst.rmdir()
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tensors
