"""Olmo 3 architecture hyper-parameters and the named presets.

The dimensions of `olmo3-7b` and `olmo3-32b` are OLMo-core's (`TransformerConfig.olmo3_7B`,
`olmo3_32B`, with the dolma2 tokenizer padded to 128: tests/model/test_presets.py builds them
with OLMo-core's own code); `olmo3-1b` is the 1.48B config used by the GPU benchmark (issue 9),
`olmo3-190m` follows OLMo-core's 190M class, and `small`/`tiny` are for CPU training and tests
(`tiny-gqa`: `tiny` with grouped-query attention, 2 kv heads for 4 query heads, for the HF
parity check). `vocab_size=None` means "take it from the prepared data".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
VOCAB_MULTIPLE = 128


def pad_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Embedding rows used for training: the tokenizer's vocabulary padded to `multiple`."""
    return -(-n // multiple) * multiple


def olmo3_layer_types(n_layers: int, full_every: int = 4) -> tuple[str, ...]:
    """Olmo 3's pattern: three sliding-window layers then one full layer; the last is full."""
    types = [FULL if (i + 1) % full_every == 0 else SLIDING for i in range(n_layers)]
    types[-1] = FULL
    return tuple(types)


@dataclass(frozen=True)
class Olmo3Config:
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab_size: int | None = None  # padded embedding rows; None: from the data
    tokenizer_vocab: int | None = None  # rows HF keeps (unpadded); None: == vocab_size
    # The rows the loss's softmax normalises over: the tokenizer's (`tokenizer_vocab`), or every
    # (padded) embedding row as OLMo-core's loss does (docs/CONTRACTS.md#init-from)
    softmax_rows: Literal["tokenizer", "padded"] = "tokenizer"
    rms_eps: float = 1e-6
    rope_theta: float = 500_000.0
    max_seq_len: int = 8192
    sliding_window: int = 4096
    layer_types: tuple[str, ...] = ()
    # YaRN on full-attention layers: {"factor", "original_max_position_embeddings",
    # "beta_fast", "beta_slow", "attention_factor"(optional)}; None disables it.
    rope_scaling: dict[str, float] | None = None
    init_std: float = 0.02
    eos_token_id: int = 0
    pad_token_id: int = 1

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", olmo3_layer_types(self.n_layers))
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    def with_vocab(self, tokenizer_vocab: int) -> Olmo3Config:
        """This config sized for a tokenizer of `tokenizer_vocab` tokens."""
        return dataclasses.replace(
            self, tokenizer_vocab=tokenizer_vocab, vocab_size=pad_vocab(tokenizer_vocab)
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Olmo3Config:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if k == "layer_types" else v) for k, v in d.items()
                      if k in names})


PRESETS: dict[str, Olmo3Config] = {
    "olmo3-7b": Olmo3Config(
        d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128, mlp_hidden=11008,
        vocab_size=100352, tokenizer_vocab=100278, max_seq_len=8192, sliding_window=4096,
        eos_token_id=100257, pad_token_id=100277,
    ),
    "olmo3-32b": Olmo3Config(
        d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8, head_dim=128, mlp_hidden=27648,
        vocab_size=100352, tokenizer_vocab=100278, max_seq_len=8192, sliding_window=4096,
        eos_token_id=100257, pad_token_id=100277,
    ),
    "olmo3-1b": Olmo3Config(
        d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=128, mlp_hidden=8192,
        vocab_size=100352, tokenizer_vocab=100278, max_seq_len=4096, sliding_window=4096,
        eos_token_id=100257, pad_token_id=100277,
    ),
    "olmo3-190m": Olmo3Config(
        d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, mlp_hidden=3072,
        vocab_size=100352, tokenizer_vocab=100278, max_seq_len=4096, sliding_window=4096,
        eos_token_id=100257, pad_token_id=100277,
    ),
    "small": Olmo3Config(
        d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, mlp_hidden=768,
        max_seq_len=256, sliding_window=64, rope_theta=10_000.0,
    ),
    "tiny": Olmo3Config(
        d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, mlp_hidden=192,
        max_seq_len=64, sliding_window=16, rope_theta=10_000.0,
    ),
}
PRESETS["tiny-gqa"] = dataclasses.replace(PRESETS["tiny"], n_kv_heads=2)
