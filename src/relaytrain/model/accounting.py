"""Parameter count and training FLOPs per token, computed from the config alone.

The FLOPs feed MFU and the pipeline partition. Convention: a multiply-add is 2 FLOPs and
training costs 3x the forward (forward + two backward matmuls), hence `6 * N` for the weight
matmuls and `12 * n_heads * head_dim * context` per layer for attention scores and values,
where the context is the average number of keys a query actually sees (causal, windowed).
"""

from __future__ import annotations

from relaytrain.model.config import SLIDING, Olmo3Config


def _vocab(cfg: Olmo3Config) -> int:
    if cfg.vocab_size is None:
        raise ValueError("Olmo3Config.vocab_size is None: set it (cfg.with_vocab(n)) first")
    return cfg.vocab_size


def layer_matmul_params(cfg: Olmo3Config) -> int:
    """Weights of one block's linear layers (attention projections and SwiGLU MLP)."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = cfg.d_model * (2 * q_dim + 2 * kv_dim)  # q, o and k, v
    return attn + 3 * cfg.d_model * cfg.mlp_hidden


def layer_params(cfg: Olmo3Config) -> int:
    """All parameters of one block: linear weights, QK-norms and the two sublayer norms."""
    return (layer_matmul_params(cfg) + (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim
            + 2 * cfg.d_model)


def param_count(cfg: Olmo3Config, include_embedding: bool = True) -> int:
    """Parameters of the model as built (padded `vocab_size` rows in embedding and head)."""
    v = _vocab(cfg)
    embed = v * cfg.d_model if include_embedding else 0
    return embed + cfg.n_layers * layer_params(cfg) + cfg.d_model + v * cfg.d_model


def attention_context(seq_len: int, window: int | None) -> float:
    """Average number of keys visible to a query: min(q + 1, window) averaged over q < T."""
    if window is None or seq_len <= window:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def layer_flops_per_token(cfg: Olmo3Config, layer: int, seq_len: int) -> float:
    """Training FLOPs per token of block `layer`: its matmuls plus its attention."""
    window = cfg.sliding_window if cfg.layer_types[layer] == SLIDING else None
    ctx = attention_context(seq_len, window)
    return 6.0 * layer_matmul_params(cfg) + 12.0 * cfg.n_heads * cfg.head_dim * ctx


def head_flops_per_token(cfg: Olmo3Config) -> float:
    """Training FLOPs per token of the LM head (padded rows included: they are computed)."""
    return 6.0 * _vocab(cfg) * cfg.d_model


def flops_per_token(cfg: Olmo3Config, seq_len: int) -> float:
    """Training FLOPs per token; the embedding lookup is free, norms are negligible."""
    return (sum(layer_flops_per_token(cfg, i, seq_len) for i in range(cfg.n_layers))
            + head_flops_per_token(cfg))
