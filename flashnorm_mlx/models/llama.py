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
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.llama import ModelArgs  # the config is stock's, field for field
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..parallel import sharding
from .arch import Architecture, NormPair
from .blocks import Block, FusedAttention, run_blocks

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
        self.rope = initialize_rope(
            h,
            args.rope_theta,
            getattr(args, "rope_traditional", False),
            args.rope_scaling,
            args.max_position_embeddings,
        )
        # RoPE angles per position for the fused epilogue ("_": not a parameter);
        # None where the epilogue cannot reproduce this RoPE variant.
        self._inv_freq = kernels.rope_inv_freq(self.rope, h)

    def epilogue_args(self) -> kernels.Epilogue:
        """The qkv epilogue's settings: heads, RoPE, 1/sqrt(h), the bias if any."""
        bias = self.qkv_bias if "qkv_bias" in self else None
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(
            *heads, self._inv_freq, self.rope, scale=self.scale, bias=bias
        )


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        if getattr(args, "mlp_bias", False):
            self.gate_up_bias = mx.zeros((2 * hidden,))
        self.down_proj = nn.Linear(hidden, dim, bias=getattr(args, "mlp_bias", False))

    def __call__(self, xs, ms):
        """(y, ms_y): the block output is y * deferred_scale(ms_y) (ms_y None: y).

        xs: (B, L, D) as the matmuls read it; ms: mean(x^2) + eps of x (B, L, 1)."""
        gu = self.gate_up_proj(xs)
        if "gate_up_bias" in self:
            # A bias on up stops the deferral past down: scale both before the GLU.
            s = kernels.deferred_scale(ms, gu.dtype)
            gate, up = mx.split((gu * s).astype(gu.dtype) + self.gate_up_bias, 2, -1)
            return self.down_proj(nn.silu(gate) * up), None
        return self.down_proj(kernels.deferred_glu(gu, ms)), ms


class TransformerBlock(Block):
    NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, args, attention: nn.Module, use_sliding=False, norm_gains=False):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.use_sliding = use_sliding
        self.self_attn = attention
        self.mlp = MLP(args)
        if norm_gains:
            self.keep_gains(args.hidden_size)


class LlamaModel(nn.Module):
    def __init__(self, args, attention_cls=Attention, norm_gains=False):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        layer_types = getattr(args, "layer_types", None)
        layer_types = layer_types or ["full_attention"] * args.num_hidden_layers
        self.layers = [
            TransformerBlock(
                args, attention_cls(args), t == "sliding_attention", norm_gains
            )
            for t in layer_types
        ]
        # Folded into an untied head, so kept only for a tied one or unfolded.
        if args.tie_word_embeddings or norm_gains:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.fa_idx = layer_types.index("full_attention")
        self.swa_idx = next(
            (i for i, l in enumerate(self.layers) if l.use_sliding), None
        )

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = (
            input_embeddings
            if input_embeddings is not None
            else self.embed_tokens(inputs)
        )
        cache = cache or [None] * len(self.layers)
        fa_mask = create_attention_mask(h, cache[self.fa_idx])
        swa_mask = None
        if self.swa_idx is not None:
            swa_mask = create_attention_mask(
                h, cache[self.swa_idx], window_size=self.args.sliding_window
            )
        masks = [swa_mask if l.use_sliding else fa_mask for l in self.layers]
        gain = self.norm.weight if "norm" in self else None
        return run_blocks(self.layers, h, self.args.rms_norm_eps, masks, cache, gain)


class Model(nn.Module):
    # Architectures that differ from Llama only in attention (Qwen2's biases,
    # Qwen3's QK-norm) subclass this with their own attention class.
    attention_cls = Attention

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        """norm_gains: the weights are unfolded (a quantized checkpoint as stored)
        and the RMSNorm gains are applied in the kernels (models/blocks.py)."""
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args, self.attention_cls, norm_gains)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        # The final norm ran in the last block (its gain folded into an untied head).
        h = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights):
        """Folded Hugging Face names -> this class's fused layout (applied once, at load)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i in range(self.args.num_hidden_layers):
            p = f"model.layers.{i}"
            weights = fuse(
                weights,
                [f"{p}.self_attn.{n}_proj" for n in "qkv"],
                f"{p}.self_attn.qkv_proj",
                f"{p}.self_attn.qkv_bias",
            )
            weights = fuse(
                weights,
                [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"],
                f"{p}.mlp.gate_up_proj",
                f"{p}.mlp.gate_up_bias",
            )
        return weights

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism as mlx-lm's Llama shards (`mlx_lm.utils.sharded_load`
        calls it): each block's attention and MLP split over `group`; embedding,
        head and the residual stream stay whole on every rank."""
        sharding.shard_layers(self.layers, group or mx.distributed.init())

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return [
            (
                RotatingKVCache(max_size=self.args.sliding_window)
                if l.use_sliding
                else KVCache()
            )
            for l in self.layers
        ]


def fuse(weights, parts, fused, fused_bias):
    """Stack the rows of linear layers that read the same input into one matmul.

    Exact for quantized layers too: quantization groups run along the input axis.
    """
    if f"{parts[0]}.weight" not in weights:
        return weights
    weights = dict(weights)
    for suffix in ("weight", "scales", "biases"):
        tensors = [weights.pop(f"{p}.{suffix}", None) for p in parts]
        if all(t is not None for t in tensors):
            if len({t.shape[1:] for t in tensors}) > 1:
                raise ValueError(
                    f"{', '.join(parts)} are stored with different quantization "
                    "settings and cannot be fused; dequantize the checkpoint first"
                )
            weights[f"{fused}.{suffix}"] = mx.concatenate(tensors, axis=0)
    biases = [weights.pop(f"{p}.bias", None) for p in parts]
    if all(b is not None for b in biases):
        weights[fused_bias] = mx.concatenate(biases, axis=0)
    return weights
