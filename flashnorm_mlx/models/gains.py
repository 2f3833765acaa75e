"""The norm-gain holders: what is left of an RMSNorm once FlashNorm defers it.

A norm whose gain cannot fold into the weights keeps only its gain, under the
checkpoint's name, and the kernels apply it (docs/design.md section 3b):
- `Gain`: a block norm (e.g. input_layernorm.weight), read by `kernels.residual`
  and `kernels.post_residual` as offset + weight (Gemma's 1 + w, section 2h);
- `QKNorm`: a QK-norm (a per-head RMSNorm on q and k before RoPE: OpenELM,
  Qwen3, Gemma 3), whose norm runs inside `kernels.qkv_epilogue`. The block's
  deferred 1/RMS cancels there (section 2d): rms_norm(s * y, eps) =
  y * rsqrt(mean(y^2) + eps * ms), so only the epsilon changes, and the gains
  (1/sqrt(h) folded into q's) ride with RoPE's cos and sin (section 2e);
  `QKNormGains` builds the epilogue's keywords from the two norms' weights.
"""

import mlx.core as mx
import mlx.nn as nn

from .. import kernels


class Gain(nn.Module):
    """A norm's gain under the checkpoint's name (e.g. input_layernorm.weight);
    the normalization itself is deferred, so only the gain is kept."""

    def __init__(self, dims: int):
        super().__init__()
        self.weight = mx.ones((dims,))

    def gain(self, offset: float = 0.0) -> mx.array:
        """offset + weight (`Architecture.gain`; Gemma's 1 + w), made once per
        weight object, evaluated outside any trace, so no step pays the add."""
        if not offset:
            return self.weight
        hit = self.__dict__.get("_gain")
        if hit is not None and hit[0] is self.weight:
            return hit[1]
        g = offset + self.weight
        if not kernels.is_tracing():  # a trace must never evaluate
            mx.eval(g)
            self.__dict__["_gain"] = (self.weight, g)
        return g


class QKNorm(Gain):
    """A QK-norm's gain, under the checkpoint's name (e.g. self_attn.q_norm.weight),
    head_dim wide; the norm itself runs inside the qkv epilogue, whose gains
    `QKNormGains` builds."""


class QKNormGains:
    """The epilogue's QK-norm keywords: float32 gains (1/sqrt(h) in q's) and the
    epsilons, built once and again only when a norm weight object is replaced
    (loading, dtype casts), not at every call."""

    def __init__(self, scale: float, eps: float, offset: float = 0.0):
        # offset: the architecture's gain offset (Gemma's QK-norm gain is 1 + w).
        self.scale, self.eps, self.offset = scale, eps, offset
        self._built = self._from = None

    def __call__(self, q_weight: mx.array, k_weight: mx.array) -> dict:
        if (
            self._from is None
            or self._from[0] is not q_weight
            or self._from[1] is not k_weight
        ):
            # offset + w in the weight's dtype, as mlx-lm computes Gemma's gain.
            gq, gk = (
                (self.offset + w if self.offset else w).astype(mx.float32)
                for w in (q_weight, k_weight)
            )
            self._built = dict(
                q_gain=gq * self.scale, k_gain=gk, eps_q=self.eps, eps_k=self.eps
            )
            self._from = (q_weight, k_weight)
        return self._built
