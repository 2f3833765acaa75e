"""The FlashNorm block hand-off every architecture uses.

Blocks never materialize a normalized row. Each hands the next three arrays:
x (B, L, D), the residual; ms (B, L, 1) float32, mean(x^2) + eps; and xs, the
row the next matmuls read: x * p in float16 (p an exact power of two near
1/RMS), else x itself, times the next RMSNorm's gain where that gain is not
folded into the weights. One `kernels.residual` launch makes all three, so a
norm gain costs no launch wherever it lives. The last block's residual is the
final RMSNorm itself (`kernels.residual_norm`), so the head reads a normalized
row and needs no scaling after it.

Where the gains live (a model's `norm_gains`):
- folded (float checkpoints, `convert`'s output): W* = W diag(g) in the weights,
  the norm tensors dropped, and xs carries no gain;
- in the kernels (a quantized checkpoint run as stored, whose weights cannot
  be folded without requantizing): the weights are the checkpoint's, the gains
  stay under their checkpoint names and `residual` writes xs = x * g (* p).
Both are stock's function: (x * g) @ W^T * s = RMSNorm(x) @ W^T.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from .arch import Architecture
from .gains import Gain


class Block(nn.Module):
    """A pre-norm transformer block in FlashNorm form.

    Subclasses set `ARCH` (their family's `Architecture`), from which the norm
    names (`NORMS`, `POST_NORMS`), the attention and feed-forward modules' names
    and the gain offset are read once, and `self.eps`. The attention is called
    as (xs, ms, mask, cache) -> its output; the feed-forward as (xs, ms) ->
    (y, ms_y), y owing the deferred scale of ms_y (None: none)."""

    ARCH: Architecture
    NORMS: Tuple[str, ...]  # the attention and FFN norms' checkpoint names
    POST_NORMS: Tuple[str, ...] = ()  # norms on a sublayer's output (Gemma)
    ATTENTION = "self_attn"  # the attention module's checkpoint name
    FEED_FORWARD = "mlp"
    GAIN_OFFSET = 0.0  # the architecture's `gain_offset` (Gemma: 1)
    # A recurrent mixer (gated DeltaNet, short convolution): an ArraysCache and
    # mlx-lm's ssm mask.
    RECURRENT = False
    # The engine may compile the mixer's `heads` and `project_out` + `close`
    # apart around the cache (engine.py `_parts_class`): a FusedAttention
    # called as those two alone.
    PARTS = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        arch = cls.__dict__.get("ARCH")
        if arch is not None:
            cls.NORMS, cls.GAIN_OFFSET = arch.norms, arch.gain_offset
            cls.ATTENTION, cls.FEED_FORWARD = arch.attention, arch.feed_forward
            cls.POST_NORMS = tuple(p.norm for p in arch.post_norms)

    def keep_gains(self, dims: int) -> None:
        """Hold both norms' gains (the unfolded form): the kernels apply them."""
        for name in self.NORMS:
            setattr(self, name, Gain(dims))

    def gain(self, i: int) -> Optional[mx.array]:
        """Gain of norm i (0: attention input, 1: FFN input), None if folded."""
        name = self.NORMS[i]
        return self[name].gain(self.GAIN_OFFSET) if name in self else None

    def __call__(self, x, ms, xs, mask, cache, out_gain, final: bool):
        """(x, ms, xs) of the next block, or with `final` the final RMSNorm of
        this block's output. out_gain: the next norm's gain (None: folded)."""
        a = self[self.ATTENTION](xs, ms, mask, cache)
        return self.close(x, a, out_gain, final)

    def close(self, x, a, out_gain, final: bool, ms_a=None):
        """Everything after attention: residual, feed-forward, residual. ms_a:
        the mixer's output owes deferred_scale(ms_a) (None: nothing)."""
        h, ms_h, hs = kernels.residual(x, a, ms_a, self.eps, self.gain(1))
        y, ms_y = self[self.FEED_FORWARD](hs, ms_h)
        if final:
            return kernels.residual_norm(h, y, ms_y, self.eps, out_gain)
        return kernels.residual(h, y, ms_y, self.eps, out_gain)


def attend_cached(q, k, v, mask, cache):
    """KV cache update, then attention with scale 1 (1/sqrt(h) rode in q'): the
    call mlx-lm's classes make on the compiled engine too
    (`kernels.scaled_dot_product_attention`).
    q (B, Hq, L, h), k and v (B, Hkv, L, h) -> (B, Hq, L, h)."""
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    return kernels.scaled_dot_product_attention(q, k, v, cache, 1.0, mask)


class FusedAttention(nn.Module):
    """A FlashNorm attention: q|k|v matmul -> `kernels.qkv_epilogue` (heads out,
    RoPE, the deferred scale; QK-norm and gains where the epilogue has them) ->
    KV cache -> attention with scale 1 -> out projection.

    Subclasses hold `qkv_proj` and the out projection under the checkpoint's
    name (`OUT`), and define `epilogue_args()`."""

    OUT = "o_proj"

    def __call__(self, xs, ms, mask=None, cache=None):
        """xs: (B, L, D) block input as the matmuls read it; ms: mean(x^2) + eps
        of the block input x, (B, L, 1) float32."""
        offset = cache.offset if cache is not None else 0
        q, k, v = self.heads(xs, ms, offset)
        return self.project_out(self.attend(q, k, v, mask, cache))

    def attend(self, q, k, v, mask, cache):
        """The KV cache update and attention (engine.py's compiled parts call it
        too); an attention with more inputs (gpt-oss's sinks) overrides it."""
        return attend_cached(q, k, v, mask, cache)

    def heads(self, xs, ms, offset):
        """q', k', v' (B, H, L, h) of the block input, RoPE at `offset`."""
        return kernels.qkv_epilogue(self.qkv_proj(xs), ms, offset, self.epilogue())

    def project_out(self, o):
        B, _, L, _ = o.shape
        return self[self.OUT](o.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def epilogue(self) -> kernels.Epilogue:
        """`epilogue_args()`, built once and again only when what it holds is
        replaced (loading, a dtype cast, sharding), not at every call."""
        heads, arrays = (self.n_heads, self.n_kv_heads), tuple(self._epilogue_arrays())
        built = self.__dict__.get("_epilogue")
        if (
            built is None
            or built[0] != heads
            or any(a is not b for a, b in zip(built[1], arrays))
        ):
            built = self.__dict__["_epilogue"] = (heads, arrays, self.epilogue_args())
        return built[2]

    def _epilogue_arrays(self):
        # Every array an epilogue holds comes from these (None where absent).
        yield self.get("qkv_bias")
        for norm in ("q_norm", "k_norm"):
            yield self[norm].weight if norm in self else None


def run_blocks(
    layers: List[Block],
    h: mx.array,
    eps: float,
    masks: Sequence,
    caches: Sequence,
    final_gain: Optional[mx.array],
) -> mx.array:
    """Embeddings h (B, L, D) -> the final RMSNorm of the last block's output.

    masks, caches: one per layer; final_gain: the final norm's gain, None where
    it is folded into an untied head."""
    # Statistics (and the gained row) of the first block's input.
    _, ms, xs = kernels.residual(h, None, None, eps, layers[0].gain(0))
    last = len(layers) - 1
    for i, (layer, mask, cache) in enumerate(zip(layers, masks, caches)):
        out_gain = final_gain if i == last else layers[i + 1].gain(0)
        out = layer(h, ms, xs, mask, cache, out_gain, i == last)
        if i < last:
            h, ms, xs = out
    return out
