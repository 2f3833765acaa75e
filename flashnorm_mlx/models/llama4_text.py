"""FlashNorm `llama4_text`, as mlx-lm's own `llama4_text` class runs it: the
dense Llama 4 text model (MobileLLM-R1's), Llama's blocks with
(docs/design.md section 2q):
- no RoPE on the layers `no_rope_layers` marks 0: zero angles, so the fused
  epilogue applies only s and 1/sqrt(h), as SmolLM3's NoPE layers (2e);
- with `use_qk_norm`, a weightless QK-norm before RoPE on every layer, eps
  `rms_norm_eps`: s cancels there and the epsilon becomes eps * ms (2d),
  the gains ones;
- mlx-lm's interleaved (traditional) RoPE as the fused epilogue's half-split
  one: each head's q and k rows are reordered at load (even dims, then odd),
  the same permutation on q and k, so every score q . k is stock's (2q);
- the GLU `intermediate_size_mlp` wide under `feed_forward`, the untied head
  `output`, as stock names them.
The multimodal `llama4` wrapper (routed experts, chunked attention) is
models/llama4.py, on this file's attention pieces.
"""

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama4_text import ModelArgs  # noqa: F401 (stock's config)
from mlx_lm.models.smollm3 import NoPE  # stock's identity RoPE

from .. import kernels
from . import llama
from .arch import NormPair
from .decoder import MLP
from .gains import QKNormGains

ARCH = dataclasses.replace(
    llama.ARCH,
    pairs=(
        # q and k rows reordered per head at load (`half_split`).
        dataclasses.replace(llama.ARCH.pairs[0], in_order=False),
        NormPair(
            "post_attention_layernorm",
            "feed_forward.gate_up_proj",
            ("feed_forward.gate_proj", "feed_forward.up_proj"),
        ),
    ),
    head="output",  # stock's name for the untied head
    gguf=None,
    cannot=(("gguf", "llama.cpp's llama4 files are not read yet"),),
)


class Attention(llama.Attention):
    """q|k|v in one matmul, no biases; the weightless QK-norm's epilogue form
    where `use_qk_norm`; RoPE or none as `no_rope_layers` says."""

    def __init__(self, args: ModelArgs, use_rope: bool):
        super().__init__(args, qkv_bias=False, o_bias=False)
        if not use_rope:  # zero angles: cos 1, sin 0, exactly (2e)
            self.rope = NoPE()
            h = self.head_dim
            self._angles = kernels.RopeAngles(mx.zeros((h // 2,), mx.float32), h)
        if args.use_qk_norm:  # no weight: gains of one ("_": not parameters)
            self._unit = mx.ones((self.head_dim,))
            self._qk_gains = QKNormGains(self.scale, args.rms_norm_eps)

    def make_rope(self, args: ModelArgs, h: int) -> nn.Module:
        # Stock's interleaved pairs (2i, 2i + 1) are (i, i + h/2) once q's and
        # k's rows are reordered (`half_split`): same angles, no scaling.
        return nn.RoPE(h, traditional=False, base=args.rope_theta)

    def epilogue_args(self) -> kernels.Epilogue:
        if "_qk_gains" not in self.__dict__:
            return super().epilogue_args()
        gains = self._qk_gains(self._unit, self._unit)
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(*heads, self._angles, self.rope, **gains)


def half_split(w: mx.array, heads: int) -> mx.array:
    """Rows of q_proj or k_proj (weight, or a quantized one's scales and
    biases: rows are independent) reordered in each head: dims 0, 2, 4, ...
    then 1, 3, 5, ..., so interleaved RoPE becomes half-split RoPE (2q)."""
    h = w.shape[0] // heads
    order = mx.concatenate([mx.arange(0, h, 2), mx.arange(1, h, 2)])
    return w.reshape(heads, h, *w.shape[1:])[:, order].reshape(w.shape)


class TransformerBlock(llama.TransformerBlock):
    ARCH = ARCH


class Model(llama.Model):
    ARCH = ARCH
    Block = TransformerBlock

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__(args, norm_gains)
        if "lm_head" in self:  # stock's untied head is `output`
            self.output = self.lm_head
            del self["lm_head"]

    def attention(self, args: ModelArgs, i: int) -> Attention:
        return Attention(args, bool(args.no_rope_layers[i]))

    def feed_forward(self, args: ModelArgs, i: int) -> MLP:
        wide = SimpleNamespace(
            hidden_size=args.hidden_size, intermediate_size=args.intermediate_size_mlp
        )
        return MLP(wide, ARCH.activation)

    def sanitize(self, weights):
        """q's and k's rows reordered per head (`half_split`), then Llama's
        fusing; a checkpoint always holds the parts, as stock reads them."""
        args, weights = self.args, dict(weights)
        heads = {"q_proj": args.num_attention_heads, "k_proj": args.num_key_value_heads}
        for p in ARCH.layer_prefixes(vars(args)):
            for proj, n in heads.items():
                for suffix in ("weight", "scales", "biases"):
                    key = f"{p}.self_attn.{proj}.{suffix}"
                    if key in weights:
                        weights[key] = half_split(weights[key], n)
        return super().sanitize(weights)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.output(h)
