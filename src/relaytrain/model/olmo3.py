"""The Olmo 3 decoder, written out from scratch and proven equal to HF's `Olmo3ForCausalLM`.

Architecture (OLMo 2 lineage): token embedding; per layer a "reordered norm" block,
`h = x + norm(attn(x))`, `out = h + norm(mlp(h))`, whose attention applies RMSNorm to the whole
q and k projections (QK-norm) before splitting heads, rotate-half RoPE, and a causal or
sliding-window mask by layer type; SwiGLU MLP; final norm; untied LM head. No biases.

Numerics follow HF exactly: RMSNorm and RoPE are computed in fp32 and cast back to the input
dtype, so the model runs under bf16 autocast with fp32 normalisation and rotary math. Both are
autograd functions whose forward rounds exactly as HF's ops (the logits are bit-identical on the
CPU) and whose backward is written out in a few fused passes instead of autograd's many small
ones (gradients agree with HF's to float rounding; `relaytrain parity hf`). With
`model.kernels: fused` (the CPU default), RMSNorm, SwiGLU and RoPE run as one pass each way
through `model.cpu_kernels` (and so does the LM head's softmax); RMSNorm and the softmax then
agree with HF's to float rounding only.

One class serves both the whole model and a pipeline stage: a stage holds a contiguous range of
layers (keyed by their *global* index, so parameter names are the same in every layout), the
embedding only if it is the first stage and the final norm + head only if it is the last. A
rank of an interleaved pipeline holds several such chunks in one module (the same names again)
and runs one at a time (`forward`'s `chunk`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from relaytrain.model import cpu_kernels
from relaytrain.model.backend_choice import choose_matmul
from relaytrain.model.config import FULL, LAYER_TYPES, SLIDING, Olmo3Config
from relaytrain.model.documents import (
    Documents,
    document_block_mask,
    document_positions,
    document_spans,
)
from relaytrain.model.loss import lm_head_loss
from relaytrain.model.matmul import MATMUL_BACKENDS, Linear, deferring
from relaytrain.model.prediction import embedded, predicted
from relaytrain.model.sliding_chunks import Window, sliding_attention


class _RMSNormFunction(torch.autograd.Function):
    """HF's RMSNorm forward, op for op (so bit-identical), with a closed-form backward.

    With `x_hat = x r`, `r = rsqrt(mean(x^2) + eps)` and `y = w x_hat`:
    `dw = sum_rows(g x_hat)` and `dx = r (g w - x_hat mean(g w x_hat))`, where the row means
    reuse `g x_hat` (`(g x_hat) @ w / D`, a matrix-vector product): six ops where autograd
    through the forward's six takes about twelve.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        x_hat = xf * r
        ctx.save_for_backward(x_hat, r, weight)
        ctx.dtype = x.dtype
        return (weight * x_hat).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x_hat, r, weight = ctx.saved_tensors
        g, weight = grad.float(), weight.float()  # a bf16 weight (FSDP2's bf16 gathers) too
        d = weight.shape[0]
        g_x_hat = g * x_hat
        grad_w = grad_x = None
        if ctx.needs_input_grad[1]:
            grad_w = g_x_hat.sum(tuple(range(g.dim() - 1)))  # as autograd sums it
        if ctx.needs_input_grad[0]:
            mean = torch.mv(g_x_hat.reshape(-1, d), weight).div_(d).view(r.shape)
            grad_x = (g * weight).addcmul_(x_hat, mean, value=-1.0).mul_(r).to(ctx.dtype)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """RMSNorm in fp32, weight applied in fp32, result cast back (as HF `Olmo3RMSNorm`);
    one fused kernel each way where `self.fused` (set by `Olmo3.configure`) applies."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: Tensor) -> Tensor:
        weight = predicted(self.weight)
        if self.fused and cpu_kernels.cpu_fp32(x, weight):
            return cpu_kernels.rms_norm(x, weight, self.eps)
        return _RMSNormFunction.apply(x, weight, self.eps)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding


def rope_inv_freq(cfg: Olmo3Config, yarn: bool, device: torch.device | None = None,
                  ) -> tuple[Tensor, float]:
    """Inverse frequencies theta^(-2i/d) in fp32 and the cos/sin scale.

    With `yarn`, HF's YaRN (`_compute_yarn_parameters`, truncated correction range): low
    frequencies are interpolated by `factor`, high ones kept, a linear ramp in between, and
    cos/sin are scaled by `attention_factor` (default 0.1 ln(factor) + 1).
    """
    dim, base = cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    if not yarn:
        return 1.0 / pos_freqs, 1.0
    rs = cfg.rope_scaling
    if rs is None:
        raise ValueError("YaRN frequencies asked for, but cfg.rope_scaling is None")
    factor = float(rs["factor"])
    original = rs.get("original_max_position_embeddings", cfg.max_seq_len)
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def rope_cos_sin(cfg: Olmo3Config, yarn: bool, seq_len: int, device: torch.device,
                 ) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin tables [seq_len, head_dim] for positions 0..seq_len-1.

    Recomputed each forward (a few thousand flops) instead of kept in buffers, so a model
    built on the meta device and materialised with `to_empty` needs no special handling.
    """
    inv_freq, scale = rope_inv_freq(cfg, yarn, device)
    freqs = torch.arange(seq_len, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class _RopeFunction(torch.autograd.Function):
    """`x * cos + rotate_half(x) * sin` (rotate_half(x) = [-x2, x1]) in fp32, cast back,
    without materialising the rotation.

    Written half by half, `x1 c1 - x2 s1` and `x2 c2 + x1 s2`, which rounds exactly as the
    rotate-half form (negation is exact), in three passes instead of five; the backward, the
    transposed rotation `g c + [g2 s2, -g1 s1]`, is also exact.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        xf = x.float()
        half = xf.shape[-1] // 2
        out = xf * cos
        out[..., :half].sub_(xf[..., half:] * sin[..., :half])
        out[..., half:].add_(xf[..., :half] * sin[..., half:])
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        g = grad.float()
        half = g.shape[-1] // 2
        gs = g * sin
        gx = g * cos
        gx[..., :half].add_(gs[..., half:])
        gx[..., half:].sub_(gs[..., :half])
        return gx.to(ctx.dtype), None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, fused: bool = False) -> Tensor:
    """Rotate [B, H, T, hd] by position, in fp32, cast back to x's dtype; in one fused pass
    each way with `fused` where the kernel applies (the same rounding)."""
    if fused and cpu_kernels.cpu_fp32(x, cos, sin):
        return cpu_kernels.rope(x, cos, sin)
    return _RopeFunction.apply(x, cos, sin)


# ---------------------------------------------------------------------------------------------
# Attention masks


ATTENTION_BACKENDS = ("auto", "sdpa", "chunks", "flex")
Mask = Tensor | BlockMask | Window | Documents | None  # what a layer's attention is given
CHECKPOINTING = ("none", "selective", "full")
FLEX_BLOCK = 128  # FlexAttention's tile (its default): block masks are per 128 x 128 tile


def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> Tensor:
    """Boolean [T, T] mask, True where query q may see key k: q - window < k <= q.

    The `sdpa` backend's mask (exact against HF on the CPU; also what compiled blocks and bf16
    take where `chunks` would run): built once per forward and shared by every sliding layer of
    the module, T^2 bytes (64 MiB at T = 8192), never an fp32 mask per layer. Full layers, and
    sliding ones when T <= window, take no mask at all (`is_causal`, flash kernels).
    """
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    return (k <= q) & (k > q - window)


@functools.lru_cache(maxsize=8)
def sliding_block_mask(seq_len: int, window: int, device: torch.device,
                       block: int = FLEX_BLOCK) -> BlockMask:
    """The same window as a FlexAttention block mask, built from tile arithmetic alone.

    For query tile i and key tile j it lists the tiles the window touches, split into full
    tiles (every pair visible: no mask evaluated) and partial ones (the diagonal and the
    window's far edge, where `mask_mod` decides per element); untouched tiles are skipped, so
    a sliding layer costs O(T * window). Nothing of size T^2 is ever built (`create_block_mask`
    would evaluate the mask densely first): (T / 128)^2 small integers. Cached because it is
    a pure function of its arguments and the same for every forward of that length.
    """
    n = -(-seq_len // block)
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    q_lo, q_hi = i * block, torch.clamp((i + 1) * block, max=seq_len) - 1
    k_lo, k_hi = j * block, (j + 1) * block - 1
    touched = (k_lo <= q_hi) & (k_hi > q_lo - window)
    full = (k_hi <= q_lo) & (k_lo > q_hi - window) & (k_hi < seq_len)

    def rows(tiles: Tensor) -> tuple[Tensor, Tensor]:
        """Per query tile: how many key tiles, and their indices first (stable order)."""
        count = tiles.sum(-1, dtype=torch.int32)
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[None, None], order[None, None]

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (k <= q) & (k > q - window)

    partial_count, partial_idx = rows(touched & ~full)
    full_count, full_idx = rows(full)
    return BlockMask.from_kv_blocks(partial_count, partial_idx, full_count, full_idx,
                                    BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))


@functools.cache
def _compiled_flex_attention() -> Any:
    """FlexAttention for CUDA: compiled, since its eager form is a reference implementation
    that materialises every score. Inside compiled blocks the call is traced in place."""
    return torch.compile(flex_attention, dynamic=False)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, Hkv, T, hd] -> [B, Hkv * n_rep, T, hd], each kv head serving n_rep query heads."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class SequenceShard(Protocol):
    """This rank's part of a sequence split over ranks (`parallel.cp`; parallel/context.py's
    `ContextGroup`): the global positions of its tokens, and attention across the split."""

    def positions(self) -> Tensor:
        """Positions of this rank's tokens, in its local order: [T/N] in the sequence, or
        [B, T/N] within their documents."""

    def within(self, doc_lens: Tensor) -> SequenceShard:
        """The same part of sequences of these documents (`doc_lens` [B, D]): attention and
        positions within documents."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None, scale: float
               ) -> Tensor:
        """Attention of this rank's queries over every key they see (all earlier ones, or
        those in the `window`), wherever the keys are held."""


# ---------------------------------------------------------------------------------------------
# Blocks


class Attention(nn.Module):
    def __init__(self, cfg: Olmo3Config) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.d_model, q_dim)
        self.k_proj = Linear(cfg.d_model, kv_dim)
        self.v_proj = Linear(cfg.d_model, kv_dim)
        self.o_proj = Linear(q_dim, cfg.d_model)
        # QK-norm over the whole projection (all heads together), before the head split.
        self.q_norm = RMSNorm(q_dim, cfg.rms_eps)
        self.k_norm = RMSNorm(kv_dim, cfg.rms_eps)
        self.fused = False  # RoPE's and sliding attention's fused kernels (`Olmo3.configure`)

    @property
    def window_kernel(self) -> bool:
        """Whether a `Window` goes through the fused window kernel (for fp32 CPU tensors): the
        fused kernels are on and take this head dim."""
        return self.fused and self.head_dim % cpu_kernels.WINDOW_HEAD_DIMS == 0

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Mask,
                context: SequenceShard | None = None) -> Tensor:
        """Causal attention when `mask` is None, else attention restricted to `mask`: a dense
        boolean mask through SDPA, a block mask through FlexAttention (GQA native), a
        `Window`: the fused window kernel (`cpu_kernels.window_attention`), else chunk by chunk
        (`model.sliding_chunks`), or `Documents`: each document on its own (its positions
        from 0, `model.documents`). With a `context`, x is this rank's part of the sequence and
        the context attends (None or a `Window` for the mask)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if isinstance(mask, Documents):
            masks = mask.masks or {}
            rows = [torch.cat([self._attend(q[r:r + 1, :, s:s + n], k[r:r + 1, :, s:s + n],
                                            v[r:r + 1, :, s:s + n], cos[:n], sin[:n],
                                            masks.get(n))
                               for row, s, n in mask.spans if row == r], dim=2)
                    for r in range(b)]
            y = torch.cat(rows, dim=0)
        else:
            y = self._attend(q, k, v, cos, sin, mask, context)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                mask: Tensor | BlockMask | Window | None,
                context: SequenceShard | None = None) -> Tensor:
        """RoPE on q and k (per-token tables [B, 1, T, hd] where positions differ by row),
        then attention: [B, H, T, hd]."""
        fused = self.fused and cos.dim() == 2
        q, k = apply_rope(q, cos, sin, fused), apply_rope(k, cos, sin, fused)
        n_rep = self.n_heads // self.n_kv_heads
        scale = self.head_dim**-0.5
        if context is not None:
            return context.attend(q, k, v, mask.size if isinstance(mask, Window) else None,
                                  scale)
        if mask is None:
            # Flash kernels take GQA natively when there is no mask.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=n_rep > 1)
        if isinstance(mask, BlockMask):
            flex = _compiled_flex_attention() if q.is_cuda else flex_attention
            return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=n_rep > 1)
        if isinstance(mask, Window) and cpu_kernels.cpu_fp32(q, k, v):
            if self.window_kernel:
                return cpu_kernels.window_attention(q, k, v, mask.size, scale)  # GQA native
            return sliding_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask.size,
                                     scale)
        if isinstance(mask, Window):  # what the chunks do not take (bf16): the dense mask
            mask = sliding_window_mask(q.shape[2], mask.size, q.device)
        # With a mask, CUDA kernels would fall back to the math path for GQA: expand kv.
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                              attn_mask=mask, scale=scale)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); `silu(g) * u` in one fused pass each way where
    `self.fused` (`Olmo3.configure`) applies (the same rounding)."""

    def __init__(self, cfg: Olmo3Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.d_model, cfg.mlp_hidden)
        self.up_proj = Linear(cfg.d_model, cfg.mlp_hidden)
        self.down_proj = Linear(cfg.mlp_hidden, cfg.d_model)
        self.fused = False

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.fused and cpu_kernels.cpu_fp32(gate, up):
            return self.down_proj(cpu_kernels.swiglu(gate, up))
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Reordered-norm block: the norms are applied to the sublayer outputs, not the inputs.

    With `checkpoint` set, training keeps only the block's input and recomputes the rest in
    the backward (non-reentrant `torch.utils.checkpoint`): the same ops on the same values, so
    losses and gradients are bit-identical to not checkpointing.
    """

    def __init__(self, cfg: Olmo3Config, layer_type: str) -> None:
        super().__init__()
        self.sliding = layer_type == SLIDING
        # YaRN (when configured) applies to full-attention layers only, as in HF Olmo 3.
        self.yarn = layer_type == FULL and cfg.rope_scaling is not None
        self.attn = Attention(cfg)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.mlp = MLP(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps)
        self.checkpoint = False

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Mask,
                context: SequenceShard | None = None) -> Tensor:
        if self.checkpoint and torch.is_grad_enabled():  # its weight gradients never deferred
            compiling = torch.compiler.is_compiling()  # (nor compiled code's: matmul.Linear)
            with contextlib.nullcontext() if compiling else deferring(None):
                return checkpoint(self._forward, x, cos, sin, mask, context,
                                  use_reentrant=False)
        return self._forward(x, cos, sin, mask, context)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Mask,
                 context: SequenceShard | None = None) -> Tensor:
        h = x + self.attn_norm(self.attn(x, cos, sin, mask, context))
        return h + self.mlp_norm(self.mlp(h))


# ---------------------------------------------------------------------------------------------
# The model (or one pipeline stage of it)


def check_config(cfg: Olmo3Config) -> None:
    """Reject configs the model cannot be built from, with the offending field named."""
    if cfg.vocab_size is None:
        raise ValueError("Olmo3Config.vocab_size is None: set it (e.g. cfg.with_vocab(n)) "
                         "before building the model")
    if cfg.tokenizer_vocab is not None and not 0 < cfg.tokenizer_vocab <= cfg.vocab_size:
        raise ValueError(f"tokenizer_vocab={cfg.tokenizer_vocab} must be in "
                         f"1..vocab_size={cfg.vocab_size}")
    if cfg.softmax_rows not in ("tokenizer", "padded"):
        raise ValueError(f"softmax_rows={cfg.softmax_rows!r} must be 'tokenizer' or 'padded'")
    if cfg.n_kv_heads <= 0 or cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"n_kv_heads={cfg.n_kv_heads} must divide n_heads={cfg.n_heads}")
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim={cfg.head_dim} must be even for rotary embeddings")
    if SLIDING in cfg.layer_types and cfg.sliding_window < 1:
        raise ValueError(f"sliding_window={cfg.sliding_window} must be >= 1")
    if cfg.rope_scaling is not None and "factor" not in cfg.rope_scaling:
        raise ValueError(f"rope_scaling={cfg.rope_scaling} lacks the YaRN 'factor'")
    if len(cfg.layer_types) != cfg.n_layers or not set(cfg.layer_types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types must list {cfg.n_layers} entries from {LAYER_TYPES}, "
                         f"got {list(cfg.layer_types)}")


class Olmo3(nn.Module):
    """Olmo 3 causal LM, or the stage of it holding `layers` (global indices).

    `forward` takes token ids [B, T] on the first stage, hidden states [B, T, D] otherwise;
    it returns logits [B, T, tokenizer_vocab] on the last stage, hidden states otherwise.
    Given next-token `labels` [B, T] (last stage only), the last stage returns the loss
    `(total, ce, z)` instead, from the fused head + loss (`model.loss.lm_head_loss`), which
    never holds the whole batch's logits; that is what training calls.
    The head has `vocab_size` (padded) rows; the padded rows are left out of the logits, so
    they get no gradient and never affect the loss, unless `softmax_rows` is `padded` (every
    row in the logits and the softmax, as OLMo-core's model computes them).
    How it executes (attention kernels, activation checkpointing, the GEMM backend, compiled
    blocks) is set by `configure` and `compile_blocks` and never changes parameter names or the
    math.
    """

    def __init__(self, cfg: Olmo3Config, layers: Sequence[int] | None = None, first: bool = True,
                 last: bool = True) -> None:
        super().__init__()
        check_config(cfg)
        layers = range(cfg.n_layers) if layers is None else layers
        if (len(layers) == 0 or list(layers) != sorted(set(layers)) or layers[0] < 0
                or layers[-1] >= cfg.n_layers):
            raise ValueError(f"layers={layers} must be non-empty ascending indices in "
                             f"range({cfg.n_layers})")
        self.cfg = cfg
        self.first, self.last = first, last
        self.n_logits = cfg.vocab_size if cfg.softmax_rows == "padded" else \
            cfg.tokenizer_vocab or cfg.vocab_size
        if first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, cfg.layer_types[i]) for i in layers})
        if last:
            self.norm = RMSNorm(cfg.d_model, cfg.rms_eps)
            self.lm_head = Linear(cfg.d_model, cfg.vocab_size)
        self.attention = "auto"
        self.matmul = "aten"
        self.fused = False
        self.compiled = False

    def configure(self, attention: str = "auto", checkpointing: str = "none",
                  matmul: str = "aten", kernels: str = "torch") -> None:
        """Choose the sliding layers' kernel, which blocks recompute their activations, the
        dense products' backend and the elementwise kernels.

        `attention`: `sdpa` gives sliding layers a dense boolean mask (exact against HF on the
        CPU), `chunks` each query over only the keys in its window (CPU, fp32: the fused window
        kernel, else a chunk of queries at a time, `model.sliding_chunks`), `flex` a
        FlexAttention block mask (no T x T mask; CUDA for training, since FlexAttention has no
        CPU backward), `auto` flex on CUDA and chunks on the CPU (the dense mask in compiled
        blocks). Full layers always take SDPA `is_causal`
        (flash kernels).
        `checkpointing`: `full` checkpoints every block (keeps only block inputs: the least
        memory, the forward computed twice, ~+33% step FLOPs); `selective` every other block
        (even global index): half the blocks' activations for ~+17%. Recomputing only the
        MLPs instead would save about as much (the SwiGLU's hidden-width tensors are about
        half of what a block saves) but recompute more (2/3 to 3/4 of each block's forward
        FLOPs against 1/2 on average). `none` keeps everything.
        `matmul`: `aten` (torch's GEMMs: bit-identical with HF on the CPU) or `onednn` (the
        linear layers and the LM head through oneDNN on the CPU; `model.matmul`); `auto` is
        the faster on the device the parameters are on (`model.backend_choice`: measured once
        per host at this process's thread count).
        `kernels`: `torch` (torch's ops, as HF), `fused` (RMSNorm, SwiGLU, RoPE, the LM head's
        softmax and the `chunks` sliding attention through the fused CPU kernels,
        `model.cpu_kernels`) or `auto` (fused on the CPU where they build).
        A run never passes `auto` for `attention` or `kernels` here: it measures which is
        faster on the host first (`train.auto_backends`); `auto` here is for direct use.
        """
        if (attention not in ATTENTION_BACKENDS or checkpointing not in CHECKPOINTING
                or matmul not in MATMUL_BACKENDS):
            raise ValueError(f"attention={attention!r}, checkpointing={checkpointing!r}, "
                             f"matmul={matmul!r}: expected one of {ATTENTION_BACKENDS}, of "
                             f"{CHECKPOINTING} and of {MATMUL_BACKENDS}")
        self.attention = attention
        device = next(self.parameters()).device
        self.matmul = choose_matmul(matmul, self.cfg, device, torch.get_num_threads()).backend
        self.fused = cpu_kernels.resolve(kernels, device)
        for module in self.modules():
            if isinstance(module, Linear):
                module.matmul = self.matmul
            if isinstance(module, RMSNorm | MLP | Attention):
                module.fused = self.fused
        for i, block in self.layers.items():
            block.checkpoint = checkpointing == "full" or (
                checkpointing == "selective" and int(i) % 2 == 0)

    def compile_blocks(self, backend: str = "inductor") -> None:
        """`torch.compile` each block in place (names unchanged); identical blocks share one
        compiled graph, the embedding, masks and the fused head + loss stay eager. `backend`:
        the tests trace with `aot_eager` (dynamo and AOTAutograd as on CUDA, no codegen)."""
        self.compiled = True  # `auto` then gives sliding layers the dense mask to trace
        for block in self.layers.values():
            for module in block.modules():  # compiled code fuses these ops itself
                if isinstance(module, RMSNorm | MLP | Attention):
                    module.fused = False
            block.compile(dynamic=False, backend=backend)

    def _flex(self, device: torch.device) -> bool:
        return self.attention == "flex" or (self.attention == "auto" and device.type == "cuda")

    def sliding_mask(self, seq_len: int, device: torch.device) -> Tensor | BlockMask | Window:
        """The sliding layers' mask for this forward, in the configured backend's form."""
        window = self.cfg.sliding_window
        auto = self.attention == "auto"
        if self._flex(device):
            return sliding_block_mask(seq_len, window, device)
        if self.attention == "chunks" or (auto and device.type == "cpu" and not self.compiled):
            return Window(window)
        return sliding_window_mask(seq_len, window, device)

    def _layout(self, t: int, device: torch.device, doc_lens: Tensor | None,
                context: SequenceShard | None = None,
                ) -> tuple[dict[bool, tuple[Tensor, Tensor]], Mask, Mask]:
        """(RoPE tables by `yarn`, the sliding layers' mask, the full layers') of a forward of
        `t` tokens, within documents where `doc_lens` [B, D] is given (`model.documents`), at
        this rank's positions of the sequence with a `context` (which attends across it)."""
        yarns = {b.yarn for b in self.layers.values()}
        window = self.cfg.sliding_window
        if context is not None:
            pos = context.positions().to(device)
            tables = {y: rope_cos_sin(self.cfg, y, int(pos.max()) + 1, device) for y in yarns}
            if pos.dim() == 2:  # within documents: per-row tables [B, 1, T/N, hd]
                pos = pos[:, None]
            return ({y: (cos[pos], sin[pos]) for y, (cos, sin) in tables.items()},
                    Window(window), None)
        rope = {yarn: rope_cos_sin(self.cfg, yarn, t, device) for yarn in yarns}
        sliding = any(b.sliding for b in self.layers.values())
        if doc_lens is None:
            # A sliding layer is plain causal attention when the whole sequence fits the window.
            return rope, self.sliding_mask(t, device) if sliding and t > window else None, None
        if self._flex(device):
            lens = doc_lens.to(device)
            pos = document_positions(lens, t)
            rope = {y: (cos[pos][:, None], sin[pos][:, None]) for y, (cos, sin) in rope.items()}
            return (rope, document_block_mask(lens, t, window, FLEX_BLOCK),
                    document_block_mask(lens, t, None, FLEX_BLOCK))
        spans = document_spans(doc_lens, t)
        masks = {n: self.sliding_mask(n, device) for _, _, n in spans if sliding and n > window}
        return rope, Documents(spans, masks), Documents(spans)

    def forward(self, x: Tensor, labels: Tensor | None = None, z_loss: float = 0.0,
                doc_lens: Tensor | None = None, context: SequenceShard | None = None,
                chunk: range | None = None) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """See the class; `doc_lens` [B, D] (OLMo-core's: each row's document lengths,
        zero-padded, summing to T) keeps attention and positions within documents. With a
        `context`, x (and labels) are this rank's part of each sequence (context parallelism):
        positions are the context's, and it attends across the split (both within documents
        given `doc_lens`, `SequenceShard.within`). `chunk` (global layer
        indices, contiguous, all held): run only those layers, with the embedding if the chunk
        starts the model and the head if it ends it; required when the held layers are not
        contiguous (an interleaved pipeline's rank)."""
        held = [int(i) for i in self.layers]
        if chunk is None:
            if held != list(range(held[0], held[-1] + 1)):
                raise ValueError(f"this module holds layers {held} in several chunks: "
                                 "forward runs one (`chunk`)")
            chunk = range(held[0], held[-1] + 1)
        elif not set(chunk) <= set(held) or len(chunk) == 0:
            raise ValueError(f"chunk {chunk} is not among the layers held ({held})")
        first = self.first and chunk.start == held[0]
        last = self.last and chunk.stop == held[-1] + 1
        if labels is not None and not last:
            raise ValueError("labels given to a stage without the LM head (last=False)")
        if doc_lens is not None and context is not None:
            context, doc_lens = context.within(doc_lens), None
        h = embedded(x, self.embed) if first else x
        rope, sliding, full = self._layout(h.shape[1], h.device, doc_lens, context)
        for i in chunk:
            block = self.layers[str(i)]
            cos, sin = rope[block.yarn]
            h = block(h, cos, sin, sliding if block.sliding else full, context)
        if not last:
            return h
        h = self.norm(h)
        if labels is None:
            return self.lm_head(h)[..., : self.n_logits]
        return lm_head_loss(h, predicted(self.lm_head.weight), labels, z_loss, self.n_logits,
                            matmul=self.matmul, fused=self.fused)
