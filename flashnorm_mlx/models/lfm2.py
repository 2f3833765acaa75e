"""FlashNorm LFM2 and LFM2.5 (LiquidAI): short gated convolutions beside attention.

mlx-lm's `lfm2`: layer i attends where it is in `full_attn_idxs` (else from
`layer_types`), otherwise it mixes tokens with a short gated convolution; every
layer's feed-forward is a GLU (w1 gate, w3 up, w2 down). With s the block
input's deferred 1/RMS (docs/design.md section 2l):
- attention: the operator norm's gain folded into q|k|v, one matmul through
  Qwen3's QK-norm epilogue (q_layernorm, k_layernorm: s cancels in q and k,
  v takes it);
- short conv: the operator norm's gain folded into in_proj; s applied to its
  output B | C | x before the gated product B * x that feeds the convolution
  over tokens (each token's own s: it cannot pass the convolution), C taking
  its own s for the product with the convolution's output;
- the GLU as Llama's; the head is always the embedding (stock's class has no
  lm_head), so the last block's residual is the final norm (embedding_norm)
  with its gain.
`canonical` reads a checkpoint as mlx-lm's `sanitize` leaves it (the Conv1d
layout of Hugging Face's files moved to MLX's).
"""

import types
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import lfm2
from mlx_lm.models.cache import ArraysCache, KVCache

from .. import kernels
from ..kernels._common import prescaled
from ..parallel import sharding
from . import qwen3
from .arch import Architecture, Gguf, Mixer, NormPair
from .decoder import MLP, Decoder, DecoderBlock, fuse_pairs

ATTENTION = NormPair(
    "operator_norm",
    "self_attn.qkv_proj",
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
)
CONV = NormPair("operator_norm", "conv.in_proj", ("conv.in_proj",))
FFN = NormPair(
    "ffn_norm", "feed_forward.gate_up_proj", ("feed_forward.w1", "feed_forward.w3")
)
# Our names of modules the checkpoint names otherwise (the rest are its own).
_OURS = {
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".feed_forward.w2.": ".feed_forward.down_proj.",
    "model.embedding_norm.": "model.norm.",
}


def attention_layers(config: dict) -> list:
    """mlx-lm's ModelArgs: `full_attn_idxs`, else the full_attention layer_types."""
    if config.get("full_attn_idxs") is not None:
        return list(config["full_attn_idxs"])
    types_ = config.get("layer_types") or []
    return [i for i, t in enumerate(types_) if t == "full_attention"]


def layer_kind(config: dict, i: int) -> str:
    return "attention" if i in attention_layers(config) else "short_conv"


def make_arch(ffn: NormPair, **more) -> Architecture:
    """LFM2's contract with the feed-forward pair `ffn` (lfm2_moe's dense one
    is named as Llama's)."""
    return Architecture(
        layers_key="num_hidden_layers",
        layer="model.layers.{i}",
        pairs=(ATTENTION, ffn),
        final_norm="model.embedding_norm",
        embed="model.embed_tokens",
        head="lm_head",
        # Stock's class has no lm_head whatever its config says: no key that a
        # checkpoint holds unties it.
        tie_key="flashnorm_lfm2_tied",
        width_key="hidden_size",
        qk_norms=("self_attn.q_layernorm", "self_attn.k_layernorm"),
        mixers=(Mixer("attention", ATTENTION), Mixer("short_conv", CONV)),
        layer_kind=layer_kind,
        cannot=(
            (
                "nonorm",
                "mlx-lm's class always reads its head from the embedding, so the "
                "final norm's constant has no linear of its own to fold into",
            ),
        ),
        **more,
    )


# llama.cpp's lfm2 files: loading/gguf_lfm2.py.
ARCH = make_arch(FFN, gguf=Gguf("lfm2", "Lfm2ForCausalLM", reader="gguf_lfm2"))


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as mlx-lm's `sanitize` leaves them (lazily): a Conv1d weight in
    Hugging Face's (C, 1, K) moved to MLX's (C, K, 1), by stock's own test."""
    out = {}
    for k, v in weights.items():
        if "conv.weight" in k and v.shape[-1] > v.shape[1]:
            v = v.transpose(0, 2, 1)
        out[k] = v
    return out


@dataclass
class ModelArgs(lfm2.ModelArgs):
    """Stock's config, field for field, under the names the decoder reads."""

    tie_word_embeddings = True  # not a field: stock always ties
    rope_scaling = None  # not a field: stock's RoPE is plain, whatever is set

    @property
    def rms_norm_eps(self) -> float:
        return self.norm_eps


def ff_dim(args: ModelArgs) -> int:
    """The GLU's hidden width, as mlx-lm's LFM2 MLP computes it."""
    dim = args.block_ff_dim
    if args.block_auto_adjust_ff_dim:
        dim = int(2 * dim / 3)
        if args.block_ffn_dim_multiplier is not None:
            dim = int(args.block_ffn_dim_multiplier * dim)
        m = args.block_multiple_of
        dim = m * ((dim + m - 1) // m)
    return dim


class ShortConv(nn.Module):
    """mlx-lm's ShortConv on (xs, ms): in_proj's output times s, then stock's
    gated product, convolution and cache, C's product and out_proj."""

    def __init__(self, args):
        super().__init__()
        D, self.L_cache = args.hidden_size, args.conv_L_cache
        self.conv = nn.Conv1d(D, D, self.L_cache, groups=D, bias=args.conv_bias)
        self.in_proj = nn.Linear(D, 3 * D, bias=False)
        if args.conv_bias:  # added after s: s * (x @ W*) + b is in_proj(RMSNorm(x))
            self.in_bias = mx.zeros((3 * D,))
        self.out_proj = nn.Linear(D, D, bias=args.conv_bias)

    def gated(self, y, ms):
        """(B * x, C, ms_C) of in_proj's output y (B, L, 3D): B * x carrying s^2
        before the convolution over tokens, each token's own (2l). With a bias,
        s * (B | C | x) + b first and C whole (ms_C None); without, C's s is owed
        to the block's residual (ms_C = ms), which applies it in its one launch."""
        if "in_bias" in self:
            y = (y * kernels.deferred_scale(ms, y.dtype)).astype(y.dtype)
            B, C, x = mx.split(y + self.in_bias, 3, axis=-1)
            return B * x, C, None
        B, C, x = mx.split(y, 3, axis=-1)
        if prescaled(y.dtype):  # s / p of x * p rows, squared
            s = kernels.deferred_scale(ms, mx.float16)
            return (B * x * (s * s)).astype(y.dtype), C, ms
        return ((B * x) / ms).astype(y.dtype), C, ms  # s^2 = 1 / ms

    def __call__(self, xs, ms, mask=None, cache=None):
        """(y, ms_y): the mixer's output owes deferred_scale(ms_y) (None: none)."""
        Bx, C, ms_c = self.gated(self.in_proj(xs), ms)
        if mask is not None:
            Bx = mx.where(mask[..., None], Bx, 0)
        n_keep = self.L_cache - 1
        if cache is not None:
            state = cache[0]
            if state is None:
                state = mx.zeros((Bx.shape[0], n_keep, Bx.shape[-1]), Bx.dtype)
            Bx = mx.concatenate([state, Bx], axis=1)
            t = C.shape[1]
            if cache.lengths is not None:
                ends = mx.clip(cache.lengths, 0, t)
                positions = (ends[:, None] + mx.arange(n_keep))[..., None]
                cache[0] = mx.take_along_axis(Bx, positions, axis=1)
            else:
                cache[0] = Bx[:, -n_keep:, :]
            cache.advance(t)
        else:
            Bx = mx.pad(Bx, [(0, 0), (n_keep, 0), (0, 0)])
        return self.out_proj(C * self.conv(Bx)), ms_c


class AttentionBlock(DecoderBlock):
    ARCH = ARCH


class ConvBlock(AttentionBlock):
    ATTENTION = "conv"
    RECURRENT = True
    PARTS = False  # no heads/project_out around a KV cache to compile apart

    def __call__(self, x, ms, xs, mask, cache, out_gain, final: bool):
        a, ms_a = self.conv(xs, ms, mask, cache)
        return self.close(x, a, out_gain, final, ms_a)


class Model(Decoder):
    ARCH = ARCH  # the family's contract (lfm2_moe's names its experts)
    Block = AttentionBlock
    attention_cls = qwen3.Attention

    def block(self, args, i: int) -> type:
        conv = layer_kind(vars(args), i) == "short_conv"
        return ConvBlock if conv else AttentionBlock

    def attention(self, args, i: int) -> nn.Module:
        if self.block(args, i) is ConvBlock:
            return ShortConv(args)
        return self.attention_cls(args)

    def feed_forward(self, args, i: int) -> nn.Module:
        shape = types.SimpleNamespace(
            hidden_size=args.hidden_size, intermediate_size=ff_dim(args)
        )
        return MLP(shape)

    def make_cache(self):
        return [ArraysCache(size=1) if l.RECURRENT else KVCache() for l in self.layers]

    def sanitize(self, weights):
        """Canonical weights (`canonical`), each layer's pairs stacked into one
        matmul (rows: exact for quantized ones too), then our module names."""
        arch = self.ARCH
        config = vars(self.args)
        weights = fuse_pairs(canonical(config, weights), arch, config)
        return {_ours(k): v for k, v in weights.items()}

    @property
    def cast_predicate(self):
        return lambda path: "expert_bias" not in path  # as stock: kept float32

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism (`sharding.shard_layers`): attention by GQA groups,
        each short conv by channels, each GLU by hidden columns; embedding,
        head and residual whole."""
        sharding.shard_layers(self.layers, group or mx.distributed.init(), self.ARCH)


def _ours(key: str) -> str:
    if key.endswith(".conv.in_proj.bias"):  # added after s (2l)
        return key.removesuffix("_proj.bias") + "_bias"
    for theirs, ours in _OURS.items():
        if theirs in key:
            return key.replace(theirs, ours, 1)
    return key
