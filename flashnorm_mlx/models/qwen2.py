"""FlashNorm Qwen2: Llama's FlashNorm blocks with Qwen2's q/k/v biases.

Qwen2 is Llama with a bias on q, k and v (none on o_proj). A bias stops the
deferred 1/RMS from riding past RoPE, so `kernels.qkv_epilogue` applies it
where the unfolded model had it: q' = RoPE((x @ Wq*) * s + bq) / sqrt(h),
k' likewise, v' = (x @ Wv*) * s + bv, still in one pass (docs/design.md section 2c).
Everything else (GLU deferral, residual kernels, final norm) is models/llama.py.
"""

import dataclasses

from mlx_lm.models.qwen2 import ModelArgs  # the config is stock's, field for field

from . import llama
from .arch import Gguf

# The same weight names, norms and head as Llama; every layer's q/k/v has a bias.
ARCH = dataclasses.replace(
    llama.ARCH,
    gguf=Gguf(
        "qwen2",
        "Qwen2ForCausalLM",
        biases=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ),
)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=True, o_bias=False)


class Model(llama.Model):
    ARCH = ARCH
    attention_cls = Attention
