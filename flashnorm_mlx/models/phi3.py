"""FlashNorm Phi-3 (and Phi-4-mini): Llama's blocks on Phi-3's checkpoint.

What differs from Llama, each in one place:
- the checkpoint holds q|k|v and gate|up fused already (`qkv_proj`,
  `gate_up_proj`): `ARCH`'s pairs say so, so nothing is stacked at load and
  `convert` writes the names stock's class reads;
- RoPE as mlx-lm's Phi-3 makes it (`make_rope`): partial rotary dims
  (`partial_rotary_factor`), linear scaling, and su/longrope scaling
  (`SuScaledRoPE`, which also scales the rotated dims of its input). The fused
  epilogue takes all of them (`kernels.rope_angles`: the rotated dims and that
  input factor, docs/design.md sections 2e and 3d), one launch as for Llama;
- a config without `tie_word_embeddings` has an untied head (stock's default).
Everything else (GLU deferral, residual kernels, caches, shard) is
models/decoder.py.
"""

from mlx.nn import RoPE
from mlx_lm.models.phi3 import ModelArgs  # the config is stock's, field for field
from mlx_lm.models.rope_utils import SuScaledRoPE

from . import llama
from .arch import Architecture, Gguf, NormPair
from .decoder import Decoder, DecoderBlock

ARCH = Architecture(
    layers_key="num_hidden_layers",
    layer="model.layers.{i}",
    pairs=(
        NormPair("input_layernorm", "self_attn.qkv_proj", ("self_attn.qkv_proj",)),
        NormPair("post_attention_layernorm", "mlp.gate_up_proj", ("mlp.gate_up_proj",)),
    ),
    final_norm="model.norm",
    embed="model.embed_tokens",
    head="lm_head",
    tie_key="tie_word_embeddings",
    width_key="hidden_size",
    tie_default=False,
    gguf=Gguf("phi3", "Phi3ForCausalLM", reader="gguf_phi3"),
)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=False, o_bias=False)

    def make_rope(self, args: ModelArgs, h: int):
        """mlx-lm's Phi-3 choice: SuScaledRoPE for su/longrope (always its long
        factors, as stock), else nn.RoPE, over the first h * factor dims."""
        dims = int(h * args.partial_rotary_factor)
        scaling = args.rope_scaling or {}
        if scaling.get("type") in ("longrope", "su"):
            return SuScaledRoPE(
                dims,
                base=args.rope_theta,
                max_position_embeddings=args.max_position_embeddings,
                original_max_position_embeddings=args.original_max_position_embeddings,
                short_factor=scaling["short_factor"],
                long_factor=scaling["long_factor"],
            )
        scale = 1 / scaling["factor"] if scaling.get("type") == "linear" else 1.0
        return RoPE(dims, args.rope_traditional, args.rope_theta, scale)


class TransformerBlock(DecoderBlock):
    ARCH = ARCH


class Model(Decoder):
    ARCH = ARCH
    Block = TransformerBlock
    attention_cls = Attention
