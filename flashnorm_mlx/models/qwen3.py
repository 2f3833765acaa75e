"""FlashNorm Qwen3: Llama's FlashNorm blocks with Qwen3's QK-norm.

Qwen3 normalizes each head of q and k (RMSNorm over head_dim, gains shared by
the heads) before RoPE, as OpenELM does, so the block's deferred 1/RMS cancels
there: q' = RoPE(gq * q / sqrt(mean(q^2) + eps * ms)) / sqrt(h) with q = x @ Wq*,
k' likewise, v' = (x @ Wv*) * s. `kernels.qkv_epilogue` does it in one pass with
the gains (and 1/sqrt(h)) in the RoPE rotation (models/qk_norm.py). Everything
else is models/llama.py.
"""

import dataclasses

import mlx.core as mx
from mlx_lm.models.qwen3 import ModelArgs  # the config is stock's, field for field

from .. import kernels
from . import llama
from .qk_norm import QKNorm, QKNormGains

ARCH = dataclasses.replace(
    llama.ARCH, qk_norms=("self_attn.q_norm", "self_attn.k_norm")
)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=False, o_bias=False)
        self.q_norm = QKNorm(self.head_dim)
        self.k_norm = QKNorm(self.head_dim)
        self._qk_gains = QKNormGains(self.scale, args.rms_norm_eps)

    def epilogue(self, qkv, ms, offset):
        gains = self._qk_gains(self.q_norm.weight, self.k_norm.weight)
        if self._inv_freq is not None:
            heads = (self.n_heads, self.n_kv_heads)
            return kernels.qkv_epilogue(
                qkv, ms, offset, self._inv_freq, *heads, **gains
            )
        return self._split_norm_rope(qkv, ms, offset, gains)

    def _split_norm_rope(self, qkv, ms, offset, gains):
        """Unfused QK-norm epilogue, for RoPE variants the kernel does not cover
        (e.g. YaRN, which also scales its input)."""
        B, L, _ = qkv.shape
        dtype = qkv.dtype
        x = qkv.astype(mx.float32).reshape(B, L, -1, self.head_dim)
        x = x.transpose(0, 2, 1, 3)
        q, k, v = mx.split(x, [self.n_heads, self.n_heads + self.n_kv_heads], axis=1)
        # s cancels in the norm; its epsilon scales by 1/s^2 = ms * p^2.
        inv_s2 = ms * kernels.pow2_prescale(ms) ** 2 if kernels.prescaled(dtype) else ms
        inv_s2 = inv_s2[:, None]

        def norm(y, gain, eps):
            return y * mx.rsqrt(mx.mean(y * y, -1, keepdims=True) + eps * inv_s2) * gain

        q = self.rope(norm(q, gains["q_gain"], gains["eps_q"]), offset=offset)
        k = self.rope(norm(k, gains["k_gain"], gains["eps_k"]), offset=offset)
        v = v * kernels.deferred_scale(ms, dtype)[:, None]
        return q.astype(dtype), k.astype(dtype), v.astype(dtype)


class Model(llama.Model):
    attention_cls = Attention
