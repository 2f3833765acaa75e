"""FlashNorm Ministral 3 (the text model of Mistral 3): Llama with YaRN RoPE
and a position-dependent query scale.

What differs from Llama (mlx-lm's ministral3), each in one place:
- RoPE from `rope_parameters` (rope_theta and the YaRN scaling in one dict):
  where YaRN's mscale is 1 the fused epilogue takes its angles; where it is
  not, the model's own RoPE module (docs/design.md section 3d), exact both ways;
- q after RoPE times 1 + beta * log(1 + floor(pos / original_max_position_embeddings))
  (Llama 4's attention scale). It is a per-token scalar on q only, and the
  epilogue's q scale is one constant, so it is one multiply on q' after the
  epilogue: one launch more per layer, the scale itself made once per step;
- no biases; a config without `tie_word_embeddings` is tied (stock's default;
  Mistral 3's wrapper sets False, loading/wrappers.py).
Sliding-window layers (`layer_types`, RotatingKVCache) are the decoder's.
"""

import dataclasses

from mlx_lm.models.ministral3 import ModelArgs  # stock's config, field for field
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..mlx_lm_compat import llama4_attn_scale
from . import llama
from .arch import Gguf

# Llama's names, norms and head.
ARCH = dataclasses.replace(
    llama.ARCH,
    # llama.cpp's mistral3 files (its LlamaModel's layout): gguf_ministral3.py.
    gguf=Gguf(
        "mistral3", "Ministral3ForCausalLM", permuted=True, reader="gguf_ministral3"
    ),
)


class _LastScale:
    """The query scale of the last (offset, L): every layer of a step asks for
    the same one. Holds its offset, so a hit is that very offset; never kept
    from inside a trace (a trace must not leave arrays behind)."""

    last = None

    @classmethod
    def get(cls, L, offset, beta: float, original: int, dtype):
        # An int offset is part of the key; an array one is matched by identity.
        key = (L, beta, original, dtype, offset if isinstance(offset, int) else None)
        last = cls.last
        if (
            last is not None
            and last[0] == key
            and (key[-1] is not None or last[1] is offset)
        ):
            return last[2]
        scale = llama4_attn_scale(L, offset, beta, original).astype(dtype)
        if not kernels.is_tracing():
            cls.last = (key, offset, scale)
        return scale


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=False, o_bias=False)
        params = args.rope_parameters
        self.scaling_beta = params["llama_4_scaling_beta"]
        self.original_max_position_embeddings = params[
            "original_max_position_embeddings"
        ]

    def make_rope(self, args: ModelArgs, h: int):
        """mlx-lm's ministral3 choice: its rope_parameters, never interleaved."""
        params = args.rope_parameters
        return initialize_rope(
            h, params["rope_theta"], False, params, args.max_position_embeddings
        )

    def heads(self, xs, ms, offset):
        # Stock multiplies RoPE(q) in the model dtype; q' = RoPE(q) * s / sqrt(h).
        q, k, v = super().heads(xs, ms, offset)
        scale = _LastScale.get(
            q.shape[2],
            offset,
            self.scaling_beta,
            self.original_max_position_embeddings,
            q.dtype,
        )
        return q * scale, k, v


class Model(llama.Model):
    ARCH = ARCH
    attention_cls = Attention
