"""FlashNorm Qwen3: Llama's FlashNorm blocks with Qwen3's QK-norm.

Qwen3 normalizes each head of q and k (RMSNorm over head_dim, gains shared by
the heads) before RoPE, as OpenELM does, so the block's deferred 1/RMS cancels
there: q' = RoPE(gq * q / sqrt(mean(q^2) + eps * ms)) / sqrt(h) with q = x @ Wq*,
k' likewise, v' = (x @ Wv*) * s. `kernels.qkv_epilogue` does it in one pass with
the gains (and 1/sqrt(h)) in the RoPE rotation (models/gains.py), YaRN's
input factor and partial rotary dims included, or through the model's own
RoPE module for kinds the fused pass does not reproduce (docs/design.md
section 3d). Everything else is models/llama.py.
"""

import dataclasses

from mlx_lm.models.qwen3 import ModelArgs  # the config is stock's, field for field

from .. import kernels
from . import llama
from .arch import Gguf
from .gains import QKNorm, QKNormGains

# llama.cpp's names of the QK-norm gains.
QK_NORMS = (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"))
ARCH = dataclasses.replace(
    llama.ARCH,
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    gguf=Gguf("qwen3", "Qwen3ForCausalLM", names=QK_NORMS),
)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=False, o_bias=False)
        self.q_norm = QKNorm(self.head_dim)
        self.k_norm = QKNorm(self.head_dim)
        self._qk_gains = QKNormGains(self.scale, args.rms_norm_eps)

    def epilogue_args(self) -> kernels.Epilogue:
        """QK-norm form: the gains (1/sqrt(h) in q's) and epsilons, no scale."""
        gains = self._qk_gains(self.q_norm.weight, self.k_norm.weight)
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(*heads, self._angles, self.rope, **gains)


class Model(llama.Model):
    ARCH = ARCH
    attention_cls = Attention
