"""QK-norm (a per-head RMSNorm on q and k before RoPE: OpenELM, Qwen3) in FlashNorm.

The block's deferred 1/RMS cancels inside it (docs/design.md section 2d):
rms_norm(s * y, eps) = y * rsqrt(mean(y^2) + eps * ms), so only the epsilon
changes, and the gains (1/sqrt(h) folded into q's) ride with RoPE's cos and sin
inside `kernels.qkv_epilogue`. The norm modules keep only their gains.
"""

import mlx.core as mx
import mlx.nn as nn


class QKNorm(nn.Module):
    """A QK-norm's gain, under the checkpoint's name (e.g. self_attn.q_norm.weight);
    the norm itself runs inside the qkv epilogue."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.weight = mx.ones((head_dim,))


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
