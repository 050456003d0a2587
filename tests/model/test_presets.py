"""The Olmo 3 presets against ai2-olmo-core's own builders (`TransformerConfig.olmo3_7B`,
`olmo3_32B`, as the official scripts call them): every value read off OLMo-core's objects (the
config, and the module it builds on the meta device), none retyped here."""

import dataclasses

import pytest
import torch

pytest.importorskip("olmo_core")

from olmo_core.data import TokenizerConfig  # noqa: E402
from olmo_core.nn.attention.backend import TorchAttentionBackend  # noqa: E402
from olmo_core.nn.transformer import TransformerConfig  # noqa: E402

from relaytrain.model.accounting import param_count  # noqa: E402
from relaytrain.model.config import FULL, PRESETS, SLIDING, Olmo3Config  # noqa: E402
from relaytrain.model.olmo3 import Olmo3, sliding_window_mask  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Backend is set to flash_2")
BUILDERS = {"olmo3-7b": TransformerConfig.olmo3_7B, "olmo3-32b": TransformerConfig.olmo3_32B}


def olmo_core_model(builder) -> tuple[TransformerConfig, torch.nn.Module, TokenizerConfig]:
    """OLMo-core's config and model (meta device) as its official Olmo 3 scripts build them."""
    tokenizer = TokenizerConfig.dolma2()
    config = builder(vocab_size=tokenizer.padded_vocab_size())
    return config, config.build(init_device="meta"), tokenizer


def olmo_core_dims(config, model, tokenizer) -> dict:
    """Our `Olmo3Config`'s fields as OLMo-core's built objects hold them."""
    blocks = list(model.blocks.values())
    attn, windows = blocks[0].attention, [b.attention.window_size for b in blocks]
    norms = {m.eps for m in model.modules() if type(m).__name__ == "RMSNorm"}
    assert len(norms) == 1  # one epsilon for every norm, as our config has
    assert len(set(windows) - {None}) == 1  # one window size for every sliding layer
    return {
        "d_model": config.d_model, "n_layers": len(blocks), "n_heads": attn.n_heads,
        "n_kv_heads": attn.n_kv_heads, "head_dim": attn.head_dim,
        "mlp_hidden": blocks[0].feed_forward.w1.out_features,
        "vocab_size": model.embeddings.num_embeddings, "tokenizer_vocab": tokenizer.vocab_size,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        "rms_eps": norms.pop(), "rope_theta": attn.rope.theta, "rope_scaling": attn.rope.scaling,
        "sliding_window": max(w for w in windows if w is not None),
        "layer_types": tuple(FULL if w is None else SLIDING for w in windows),
        "init_std": config.init_std,
    }


def ours(cfg: Olmo3Config, keys) -> dict:
    return {k: getattr(cfg, k) for k in keys}


@pytest.mark.parametrize("preset", sorted(BUILDERS))
def test_preset_dimensions_are_olmo_cores(preset):
    config, model, tokenizer = olmo_core_model(BUILDERS[preset])
    theirs = olmo_core_dims(config, model, tokenizer)
    cfg = PRESETS[preset]
    assert ours(cfg, theirs) == theirs
    # The architecture our model implements, as OLMo-core's flags for it say.
    attn = model.blocks["0"].attention
    assert type(model.blocks["0"]).__name__ == "ReorderedNormTransformerBlock"  # post-norm
    assert not attn.use_head_qk_norm and attn.q_norm is not None  # QK-norm on the projection
    assert attn.clip_qkv is None and attn.rope.full_precision and not config.tie_word_embeddings
    # Every weight: the same count and the same shapes (names differ, shapes need not).
    with torch.device("meta"):
        mine = Olmo3(cfg)
    shapes = sorted(tuple(p.shape) for p in model.parameters())
    assert sorted(tuple(p.shape) for p in mine.parameters()) == shapes
    assert param_count(cfg) == config.num_params == sum(p.numel() for p in model.parameters())


def test_a_sliding_window_sees_as_many_keys_in_both():
    """OLMo-core's window w lets a query see w keys (itself included), as ours does."""
    _, model, _ = olmo_core_model(TransformerConfig.olmo3_7B)
    w = model.blocks["0"].attention.window_size
    t = w + 8
    theirs = TorchAttentionBackend._build_sliding_window_mask(
        t, t, torch.device("cpu"), model.blocks["0"].attention.backend.window_size)
    assert torch.equal(theirs, sliding_window_mask(t, PRESETS["olmo3-7b"].sliding_window,
                                                   torch.device("cpu")))


def test_the_32b_preset_is_grouped_query_attention():
    cfg = PRESETS["olmo3-32b"]
    assert cfg.n_kv_heads < cfg.n_heads and cfg.n_heads % cfg.n_kv_heads == 0


def test_a_changed_dimension_is_caught():
    """Control: one value off, and the comparison above fails."""
    config, model, tokenizer = olmo_core_model(TransformerConfig.olmo3_32B)
    theirs = olmo_core_dims(config, model, tokenizer)
    broken = dataclasses.replace(PRESETS["olmo3-32b"], n_kv_heads=PRESETS["olmo3-32b"].n_heads)
    assert ours(broken, theirs) != theirs
