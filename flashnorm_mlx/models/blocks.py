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
from mlx_lm.models.base import scaled_dot_product_attention

from .. import kernels


class Gain(nn.Module):
    """A norm's gain under the checkpoint's name (e.g. input_layernorm.weight);
    the normalization itself is deferred, so only the gain is kept."""

    def __init__(self, dims: int):
        super().__init__()
        self.weight = mx.ones((dims,))


class Block(nn.Module):
    """A pre-norm transformer block in FlashNorm form.

    Subclasses set `NORMS` (the attention and FFN norms' checkpoint names),
    `self.eps`, and define `attend(xs, ms, mask, cache)` -> the attention output
    and `feed_forward(xs, ms)` -> (y, ms_y), the FFN output owing the deferred
    scale of ms_y (None: owing none)."""

    NORMS: Tuple[str, str]

    def keep_gains(self, dims: int) -> None:
        """Hold both norms' gains (the unfolded form): the kernels apply them."""
        for name in self.NORMS:
            setattr(self, name, Gain(dims))

    def gain(self, i: int) -> Optional[mx.array]:
        """Gain of norm i (0: attention input, 1: FFN input), None if folded."""
        name = self.NORMS[i]
        return self[name].weight if name in self else None

    def __call__(self, x, ms, xs, mask, cache, out_gain, final: bool):
        """(x, ms, xs) of the next block, or with `final` the final RMSNorm of
        this block's output. out_gain: the next norm's gain (None: folded)."""
        h, ms_h, hs = kernels.residual(
            x, self.attend(xs, ms, mask, cache), None, self.eps, self.gain(1)
        )
        y, ms_y = self.feed_forward(hs, ms_h)
        if final:
            return kernels.residual_norm(h, y, ms_y, self.eps, out_gain)
        return kernels.residual(h, y, ms_y, self.eps, out_gain)


def attention(qkv_proj, out_proj, epilogue, xs, ms, mask=None, cache=None):
    """A FlashNorm attention: q|k|v matmul -> `kernels.qkv_epilogue` (heads out,
    RoPE, the deferred scale; QK-norm and gains where `epilogue` has them) ->
    KV cache -> attention with scale 1 (1/sqrt(h) rode in q') -> out projection.

    xs: (B, L, D) block input as the matmuls read it; ms: mean(x^2) + eps of the
    block input x, (B, L, 1) float32."""
    qkv = qkv_proj(xs)
    offset = cache.offset if cache is not None else 0
    q, k, v = kernels.qkv_epilogue(qkv, ms, offset, epilogue)
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    o = scaled_dot_product_attention(q, k, v, cache=cache, scale=1.0, mask=mask)
    B, L, _ = xs.shape
    return out_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


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
