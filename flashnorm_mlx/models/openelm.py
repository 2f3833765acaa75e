"""FlashNorm OpenELM: mlx-lm's OpenELM with folded norm gains and deferred 1/RMS.

Runs on weights folded by `flashnorm_mlx.fold.fold_norms` (attn_norm -> qkv_proj,
ffn_norm -> proj_1). Per block, with ms = mean(x^2) + eps in float32 and
s = rsqrt(ms) (DESIGN.md section 2):
    q, k, v = split(x @ Wqkv*)                      x is never normalized
    q' = RoPE(gq * q / sqrt(mean(q^2) + eps*ms)) / sqrt(h)   (exact QK-norm of s*q)
    k' = RoPE(gk * k / sqrt(mean(k^2) + eps*ms)),   v' = v * s
    ffn = proj_2(silu(s * gate) * up) * s
The QK-norm gains (and 1/sqrt(h)) live in per-layer RoPE tables, so attention
runs with scale 1 and nothing multiplies q or k by a gain at run time.
"""

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import (
    BaseModelArgs,
    create_attention_mask,
    scaled_dot_product_attention,
)
from mlx_lm.models.cache import KVCache
from mlx_lm.models.openelm import make_divisible

from .. import kernels

# Positions the RoPE tables hold at first use; they double when a longer context comes.
MIN_TABLE_POSITIONS = 256


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    head_dim: int
    num_transformer_layers: int
    model_dim: int
    vocab_size: int
    ffn_dim_divisor: int
    num_query_heads: List
    num_kv_heads: List
    ffn_multipliers: List
    ffn_with_glu: bool = True
    normalize_qk_projections: bool = True
    share_input_output_layers: bool = True
    rms_norm_eps: float = 1e-6
    rope_freq_constant: float = 10000
    # Apple's precomputed RoPE length; informational here (the tables grow on demand).
    rope_max_length: Optional[int] = None


# --- pure helpers (unit-tested on their own) ---------------------------------


def swap_halves(x: mx.array) -> mx.array:
    """[x1, x2] -> [x2, x1] over the last axis (half-split RoPE layout)."""
    half = x.shape[-1] // 2
    return mx.concatenate([x[..., half:], x[..., :half]], axis=-1)


def rope_tables(
    gain: Optional[mx.array],
    head_dim: int,
    base: float,
    positions: mx.array,
    scale: float = 1.0,
) -> Tuple[mx.array, mx.array]:
    """(cos_t, sin_t), each positions.shape + (head_dim,) float32, gain fused in.

    For y (..., P, head_dim):  apply_rope_tables(y, cos_t, sin_t) equals
    mx.fast.rope(y * gain, head_dim, traditional=False, base=base) * scale.
    Half-split identity: RoPE(y*g) = y*(g*cos) + rotate_half(y)*(swap_halves(g)*sin)
    with rotate_half(y) = [-y2, y1] = swap_halves(y) * [-1, 1]; that sign is
    stored in sin_t, so sin_t = [-g2*sin, g1*sin] and no negation runs per token.
    """
    half = head_dim // 2
    # mx.fast.rope's own float32 formula, so angles match it bit for bit on CPU.
    inv_freq = mx.exp(mx.arange(half, dtype=mx.float32) * (-math.log(base) / half))
    angles = positions.astype(mx.float32)[..., None] * inv_freq  # (..., half)
    cos, sin = mx.cos(angles), mx.sin(angles)
    g = mx.ones((head_dim,), mx.float32) if gain is None else gain.astype(mx.float32)
    g1, g2 = g[:half] * scale, g[half:] * scale
    cos_t = mx.concatenate([cos * g1, cos * g2], axis=-1)
    sin_t = mx.concatenate([-sin * g2, sin * g1], axis=-1)
    return cos_t, sin_t


def apply_rope_tables(y: mx.array, cos_t: mx.array, sin_t: mx.array) -> mx.array:
    """y * cos_t + swap_halves(y) * sin_t (tables broadcast over batch and heads)."""
    return y * cos_t + swap_halves(y) * sin_t


def qk_norm_adjusted(y: mx.array, eps_ms: mx.array) -> mx.array:
    """The weightless QK-norm of s*y from y alone, in float32.

    rms_norm(s*y, eps) = y * rsqrt(mean(y^2) + eps/s^2) and 1/s^2 = ms, so
    eps_ms = eps * ms makes it exact. y (B, H, L, h); eps_ms (B, 1, L, 1).
    """
    y = y.astype(mx.float32)
    return y * mx.rsqrt(mx.mean(y * y, axis=-1, keepdims=True) + eps_ms)


# --- blocks --------------------------------------------------------------------


class QKNormRope(nn.Module):
    """QK-norm (weight = its gain, as checkpoints name it) fused with RoPE.

    The gain and the output scale live in (positions, head_dim) float32 tables,
    built from `weight` at first use, then re-built (doubling) only when a
    longer context or new weights arrive; int offsets slice them. Without
    QK-norm (normalize=False) it is plain RoPE that applies the deferred s.
    """

    def __init__(
        self, head_dim: int, base: float, eps: float, scale: float, normalize: bool
    ):
        super().__init__()
        if normalize:
            self.weight = mx.ones((head_dim,))
        self.head_dim, self.base, self.eps, self.scale = head_dim, base, eps, scale
        self._cos = self._sin = self._built_from = None  # "_": not parameters

    def _tables(self, gain: Optional[mx.array], end: int):
        if (
            self._cos is None
            or self._cos.shape[0] < end
            or self._built_from is not gain
        ):
            size = MIN_TABLE_POSITIONS if self._cos is None else self._cos.shape[0]
            while size < end:
                size *= 2
            self._cos, self._sin = rope_tables(
                gain, self.head_dim, self.base, mx.arange(size), self.scale
            )
            self._built_from = gain
        return self._cos, self._sin

    def __call__(self, y, ms, offset: Union[int, mx.array] = 0):
        # y (B, H, L, h) matmul output; ms (B, 1, L, 1) float32 = 1/s^2 for this y.
        L = y.shape[2]
        gain = self.weight if "weight" in self else None
        if isinstance(offset, int):
            cos_t, sin_t = self._tables(gain, offset + L)
            cos_t, sin_t = cos_t[offset : offset + L], sin_t[offset : offset + L]
        else:
            # Array offsets (batched generation, (B,) or scalar): build just these
            # rows from the gain, which needs no host sync to size a table.
            pos = offset[..., None] + mx.arange(L)  # (L,) or (B, L)
            cos_t, sin_t = rope_tables(gain, self.head_dim, self.base, pos, self.scale)
            if pos.ndim == 2:
                cos_t, sin_t = cos_t[:, None], sin_t[:, None]  # (B, 1, L, h)
        if gain is not None:
            y_hat = qk_norm_adjusted(y, self.eps * ms)
        else:
            y_hat = y.astype(mx.float32) * mx.rsqrt(ms)
        return apply_rope_tables(y_hat, cos_t, sin_t).astype(y.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.head_dim = h = args.head_dim
        self.n_heads = args.num_query_heads[layer_id]
        self.n_kv_heads = args.num_kv_heads[layer_id]
        op_size = (self.n_heads + 2 * self.n_kv_heads) * h
        self.qkv_proj = nn.Linear(args.model_dim, op_size, bias=False)
        self.out_proj = nn.Linear(self.n_heads * h, args.model_dim, bias=False)
        norm = args.normalize_qk_projections
        eps, base = args.rms_norm_eps, args.rope_freq_constant
        self.q_norm = QKNormRope(h, base, eps, h**-0.5, norm)
        self.k_norm = QKNormRope(h, base, eps, 1.0, norm)

    def __call__(self, x, ms, s, mask=None, cache=None):
        # x: (B, L, D) residual, possibly pre-scaled by a power of two p;
        # ms: (B, L, 1) = 1/(s/p)^2 and s: (B, L, 1) = s/p, both float32.
        B, L, _ = x.shape
        qkv = self.qkv_proj(x).reshape(B, L, self.n_heads + 2 * self.n_kv_heads, -1)
        qkv = qkv.transpose(0, 2, 1, 3)
        q, k, v = mx.split(qkv, [self.n_heads, self.n_heads + self.n_kv_heads], axis=1)

        # Q and K go straight into their QK-norm (s cancels, eps absorbs ms); V gets s.
        offset = cache.offset if cache is not None else 0
        q = self.q_norm(q, ms[:, None], offset)
        k = self.k_norm(k, ms[:, None], offset)
        v = (v * s[:, None]).astype(x.dtype)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)

        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=1.0, mask=mask)
        return self.out_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        dim = args.model_dim
        hidden = int(
            make_divisible(
                args.ffn_multipliers[layer_id] * dim, divisor=args.ffn_dim_divisor
            )
        )
        self.proj_1 = nn.Linear(dim, 2 * hidden, bias=False)  # gate | up
        self.proj_2 = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x, s):
        """proj_2(silu(s*gate) * up); the caller applies the other s to the output."""
        return self.proj_2(kernels.deferred_glu(self.proj_1(x), s))


def _scaled(x, eps):
    """(x * p, ms_eff, s_eff): p = 2^k near s for float16 (else 1), s_eff = s/p.

    ms_eff = ms * p^2 = 1/s_eff^2 exactly (p is a power of two)."""
    ms = kernels.mean_square(x, eps)
    p, s = kernels.pow2_prescale(ms, x.dtype)
    if p is None:
        return x, ms, s
    return (x * p).astype(x.dtype), (ms * p) * p, s


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.attn = Attention(args, layer_id)
        self.ffn = MLP(args, layer_id)

    def __call__(self, x, mask=None, cache=None):
        xs, ms, s = _scaled(x, self.eps)
        h = x + self.attn(xs, ms, s, mask, cache)
        hs, _, s = _scaled(h, self.eps)
        return kernels.deferred_residual(h, self.ffn(hs, s), s)


class OpenELMModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.token_embeddings = nn.Embedding(args.vocab_size, args.model_dim)
        self.layers = [
            TransformerBlock(args, layer_id=i)
            for i in range(args.num_transformer_layers)
        ]
        # Kept only when the head is the embedding (nothing to fold into).
        if args.share_input_output_layers:
            self.norm = nn.RMSNorm(args.model_dim, eps=args.rms_norm_eps)

    def __call__(self, inputs, cache=None):
        h = self.token_embeddings(inputs)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return h


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.transformer = OpenELMModel(args)
        if not args.share_input_output_layers:
            self.lm_head = nn.Linear(args.model_dim, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None):
        h = self.transformer(inputs, cache)
        if self.args.share_input_output_layers:
            embed = self.transformer.token_embeddings
            return embed.as_linear(self.transformer.norm(h))
        # Final norm folded into lm_head: one scalar per token after the matmul.
        hs, _, s = _scaled(h, self.args.rms_norm_eps)
        out = self.lm_head(hs)
        return (out * s).astype(out.dtype)

    def sanitize(self, weights):
        """Drop what this class does not hold (applied once, at load)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
        if self.args.share_input_output_layers:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def layers(self):
        return self.transformer.layers

    def make_cache(self) -> List[Any]:
        return [KVCache() for _ in self.layers]
