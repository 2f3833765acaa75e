"""FlashNorm SmolLM3: Llama with no RoPE on every fourth layer (NoPE).

mlx-lm's SmolLM3 reads `no_rope_layers` (1: RoPE, 0: none; by default every
`no_rope_layer_interval`-th layer has none) and swaps those layers' RoPE for
the identity. Ours gives those layers zero angles: cos 0 = 1 and sin 0 = 0
exactly, so the fused epilogue applies only the deferred scale (and 1/sqrt(h)
on q), with no extra launch and no second path. Everything else is Llama's.
"""

import dataclasses

import mlx.core as mx
from mlx_lm.models.smollm3 import ModelArgs, NoPE  # stock's config and identity

from .. import kernels
from . import llama

# Llama's names, norms and head.
ARCH = dataclasses.replace(
    llama.ARCH,
    cannot=(("gguf", "llama.cpp's smollm3 files are not read yet"),),
    gguf=None,  # not Llama's
)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, use_rope: bool):
        super().__init__(args)
        if not use_rope:
            self.rope = NoPE()  # what the model's own module path would apply
            h = self.head_dim
            self._angles = kernels.RopeAngles(mx.zeros((h // 2,), mx.float32), h)


class Model(llama.Model):
    ARCH = ARCH

    def attention(self, args: ModelArgs, i: int) -> Attention:
        return Attention(args, bool(args.no_rope_layers[i]))
