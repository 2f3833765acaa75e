"""FlashNorm Llama: mlx-lm's Llama with folded norm gains and deferred 1/RMS.

Runs on weights folded by `flashnorm_mlx.fold.fold_norms`, or with
`norm_gains` on a checkpoint's own (e.g. quantized) weights, the gains then
applied in the kernels (models/blocks.py). Per block, with s the
per-token rsqrt(mean(x^2) + eps) in float32 (docs/design.md sections 2a and 2b):
    q' = RoPE(x @ Wq*) * s / sqrt(h),  k' = RoPE(x @ Wk*) * s,  v' = (x @ Wv*) * s
    ffn = down(silu(s * (x @ Wg*)) * (x @ Wu*)) * s
so no normalized copy of x is ever materialized. Attention runs with scale 1.

A decode step launches 11 primitives per block (docs/design.md section 3a):
    qkv matmul -> qkv_epilogue (split, RoPE, s) -> 2 cache writes -> attention
    -> o_proj -> residual (h = x + a, ms of h) -> gate|up matmul
    -> deferred_glu -> down matmul -> residual (h + s * y, ms for the next block)
Blocks hand each other (x, ms, xs) as models/blocks.py describes; the last
block's residual is the final norm, so the head needs no scaling after.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import (  # noqa: F401 (stock's config, field for field)
    ModelArgs,
)
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from .arch import Architecture, Gguf, NormPair
from .blocks import FusedAttention
from .decoder import Decoder, DecoderBlock

ARCH = Architecture(
    layers_key="num_hidden_layers",
    layer="model.layers.{i}",
    pairs=(
        NormPair(
            "input_layernorm",
            "self_attn.qkv_proj",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ),
        NormPair(
            "post_attention_layernorm",
            "mlp.gate_up_proj",
            ("mlp.gate_proj", "mlp.up_proj"),
        ),
    ),
    final_norm="model.norm",
    embed="model.embed_tokens",
    head="lm_head",
    tie_key="tie_word_embeddings",
    width_key="hidden_size",
    # llama.cpp's Llama names are loading/gguf.py's; its Q/K rows are permuted.
    gguf=Gguf("llama", "LlamaForCausalLM", permuted=True),
)


class Attention(FusedAttention):
    """q|k|v in one matmul, then one `qkv_epilogue` pass: heads out, RoPE, s and
    1/sqrt(h) on q, s on k and v, and a q|k|v bias after the scaling if any."""

    def __init__(self, args, qkv_bias: Optional[bool] = None, o_bias=None):
        super().__init__()
        qkv_bias = args.attention_bias if qkv_bias is None else qkv_bias
        o_bias = args.attention_bias if o_bias is None else o_bias
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        h = getattr(args, "head_dim", None) or args.hidden_size // self.n_heads
        self.head_dim = h
        self.scale = h**-0.5
        out = (self.n_heads + 2 * self.n_kv_heads) * h
        # Fused q|k|v rows; the bias (if any) is added after the deferred scaling.
        self.qkv_proj = nn.Linear(args.hidden_size, out, bias=False)
        if qkv_bias:
            self.qkv_bias = mx.zeros((out,))
        self.o_proj = nn.Linear(self.n_heads * h, args.hidden_size, bias=o_bias)
        self.rope = self.make_rope(args, h)
        # RoPE angles, rotated dims and input factor for the fused epilogue ("_":
        # not a parameter); None where it cannot reproduce this RoPE kind.
        self._angles = kernels.rope_angles(self.rope, h)

    def make_rope(self, args, h: int) -> nn.Module:
        """mlx-lm's RoPE module for this attention (a family's own choice where
        its stock class makes another, e.g. Phi-3's)."""
        return initialize_rope(
            h,
            args.rope_theta,
            getattr(args, "rope_traditional", False),
            args.rope_scaling,
            args.max_position_embeddings,
        )

    def epilogue_args(self) -> kernels.Epilogue:
        """The qkv epilogue's settings: heads, RoPE, 1/sqrt(h), the bias if any."""
        bias = self.qkv_bias if "qkv_bias" in self else None
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(
            *heads, self._angles, self.rope, scale=self.scale, bias=bias
        )


class TransformerBlock(DecoderBlock):
    ARCH = ARCH


class Model(Decoder):
    ARCH = ARCH
    # Architectures that differ from Llama only in attention (Qwen2's biases,
    # Qwen3's QK-norm) subclass this with their own attention class.
    Block = TransformerBlock
    attention_cls = Attention
