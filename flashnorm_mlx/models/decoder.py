"""The decoder every Llama-shaped family fills in from its `Architecture`.

One skeleton (docs/design.md section 2h): embeddings (times sqrt(width) where
`embed_scale`), the blocks' FlashNorm hand-off (models/blocks.py), the final
norm run by the last block, a tied or untied head; `sanitize` (the pairs' parts
stacked into their fused linears, as `pairs` names them), caches (rotating on
sliding-window layers), `shard`. A family file holds its `ARCH`, `ModelArgs`,
its attention and a `Model(Decoder)` naming them; where it differs in one
thing it overrides one hook (`attention`, `is_sliding`, `sanitize`).
Post-norms (`post_norms`) close a block with `kernels.post_residual`, the
GLU's activation is `activation`, every gain `gain_offset + w`.
"""

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .. import kernels
from ..parallel import sharding
from .arch import Architecture
from .blocks import Block, run_blocks
from .gains import Gain


class MLP(nn.Module):
    """gate|up in one matmul, the deferred GLU, down: (xs, ms) -> (y, ms_y)."""

    def __init__(self, args, activation: str = "silu"):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        bias = getattr(args, "mlp_bias", False)
        self.activation = activation
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        if bias:
            self.gate_up_bias = mx.zeros((2 * hidden,))
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, xs, ms):
        """(y, ms_y): the block output is y * deferred_scale(ms_y) (ms_y None: y).

        xs: (B, L, D) as the matmuls read it; ms: mean(x^2) + eps of x (B, L, 1)."""
        gu = self.gate_up_proj(xs)
        if "gate_up_bias" in self:
            # A bias on up stops the deferral past down: scale both before the GLU.
            s = kernels.deferred_scale(ms, gu.dtype)
            gate, up = mx.split((gu * s).astype(gu.dtype) + self.gate_up_bias, 2, -1)
            return self.down_proj(nn.silu(gate) * up), None
        return self.down_proj(kernels.deferred_glu(gu, ms, self.activation)), ms


class DecoderBlock(Block):
    """A block under its family's names (subclasses set `ARCH`): attention and
    feed-forward, the post-norms' gains where it has them (never folded: each
    sits before a residual add, not a linear layer)."""

    def __init__(self, args, attention, ffn, norm_gains=False, use_sliding=False):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.use_sliding = use_sliding
        setattr(self, self.ATTENTION, attention)
        setattr(self, self.FEED_FORWARD, ffn)
        width = getattr(args, self.ARCH.width_key)
        for name in self.POST_NORMS:
            setattr(self, name, Gain(width))
        if norm_gains:
            self.keep_gains(width)

    def post_gain(self, i: int) -> mx.array:
        return self[self.POST_NORMS[i]].gain(self.GAIN_OFFSET)

    def close(self, x, a, out_gain, final: bool, ms_a=None):
        if not self.POST_NORMS:
            return super().close(x, a, out_gain, final, ms_a)
        # Post-norm, residual, pre-FFN statistics; FFN; post-norm, residual.
        h, ms_h, hs = kernels.post_residual(
            x, a, ms_a, self.post_gain(0), self.eps, self.gain(1)
        )
        y, ms_y = self[self.FEED_FORWARD](hs, ms_h)
        post = self.post_gain(1)
        if final:
            return kernels.post_residual_norm(h, y, ms_y, post, self.eps, out_gain)
        return kernels.post_residual(h, y, ms_y, post, self.eps, out_gain)


class DecoderModel(nn.Module):
    """Embeddings -> blocks -> the final norm (in the last block)."""

    # mlx-lm's Gemma 3 rounds sqrt(width) to bfloat16 first; Gemma 4 does not.
    ROUND_EMBED_SCALE = True
    # The dtype stock's first norm promotes the embeddings to (loading sets it
    # on stored weights: docs/design.md section 1); None: the embeddings'.
    act_dtype = None

    def __init__(self, args, arch: Architecture, layers: List[Block], norm_gains):
        super().__init__()
        self.args, self.arch = args, arch
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        # Folded into an untied head, so kept only for a tied one or unfolded.
        if args.tie_word_embeddings or norm_gains:
            self.norm = Gain(args.hidden_size)
        # The first full, sliding and recurrent layer: whose caches the masks read.
        attends = [i for i, l in enumerate(layers) if not l.RECURRENT]
        self.fa_idx = next((i for i in attends if not layers[i].use_sliding), 0)
        self.swa_idx = next((i for i in attends if layers[i].use_sliding), None)
        self.ssm_idx = next((i for i, l in enumerate(layers) if l.RECURRENT), None)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = self.embed(inputs, input_embeddings)
        cache = cache or [None] * len(self.layers)
        masks = self.masks(h, cache)
        gain = self.final_gain()
        return run_blocks(self.layers, h, self.args.rms_norm_eps, masks, cache, gain)

    def embed(self, inputs, input_embeddings=None):
        """The first block's input (B, L, D): embeddings, scaled where `embed_scale`."""
        h = (
            input_embeddings
            if input_embeddings is not None
            else self.embed_tokens(inputs)
        )
        if self.arch.embed_scale:  # as mlx-lm's Gemma 3: rounded to bfloat16 first
            scale = self.arch.embedding_scale(vars(self.args))
            if self.ROUND_EMBED_SCALE:
                scale = mx.array(scale, mx.bfloat16).astype(h.dtype)
            h = h * scale
        if self.act_dtype is not None and h.dtype != self.act_dtype:
            h = h.astype(self.act_dtype)
        return h

    def final_gain(self):
        """The final norm's gain, None where it is folded into an untied head."""
        return self.norm.gain(self.arch.gain_offset) if "norm" in self else None

    def masks(self, h, cache) -> list:
        """Each layer's mask: full, sliding-window or recurrent, each made once
        from the first such layer's cache."""
        fa_mask = create_attention_mask(h, cache[self.fa_idx])
        swa_mask = None
        if self.swa_idx is not None:
            swa_mask = create_attention_mask(
                h, cache[self.swa_idx], window_size=self.args.sliding_window
            )
        ssm_mask = None
        if self.ssm_idx is not None:  # recurrent mixers' padding mask (mlx-lm's)
            ssm_mask = create_ssm_mask(h, cache[self.ssm_idx])
        return [
            ssm_mask if l.RECURRENT else swa_mask if l.use_sliding else fa_mask
            for l in self.layers
        ]


class Decoder(nn.Module):
    """The outer model. Subclasses set `ARCH` (their family's contract, the one
    the registry reads), `Block` (a `DecoderBlock`) and `attention_cls` (called
    as attention_cls(args)), or
    override `attention(args, i)`, `feed_forward(args, i)` or `block(args, i)`
    (the block class) where layers differ; each layer is built once."""

    ARCH: Architecture
    Block: type
    attention_cls: type
    Inner = DecoderModel  # the embeddings-blocks-norm module (`model`)

    def __init__(self, args, norm_gains: bool = False):
        """norm_gains: the weights are unfolded (a quantized checkpoint as stored)
        and the RMSNorm gains are applied in the kernels (models/blocks.py)."""
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.norm_gains = norm_gains  # read by mixers that hold a gain of their own
        arch = self.ARCH
        layers = [
            self.block(args, i)(
                args,
                self.attention(args, i),
                self.feed_forward(args, i),
                norm_gains,
                self.is_sliding(args, i),
            )
            for i in range(getattr(args, arch.layers_key))
        ]
        self.model = self.Inner(args, arch, layers, norm_gains)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def attention(self, args, i: int) -> nn.Module:
        return self.attention_cls(args)

    def feed_forward(self, args, i: int) -> nn.Module:
        """Layer i's feed-forward, (xs, ms) -> (y, ms_y): the deferred GLU."""
        return MLP(args, self.ARCH.activation)

    def block(self, args, i: int) -> type:
        """Layer i's block class (a hybrid family's differ by mixer)."""
        return self.Block

    def is_sliding(self, args, i: int) -> bool:
        """mlx-lm's Llama and Mistral: `layer_types` says, else every layer is full."""
        types = getattr(args, "layer_types", None)
        return bool(types) and types[i] == "sliding_attention"

    def __call__(self, inputs, cache=None, input_embeddings=None):
        # The final norm ran in the last block (its gain folded into an untied head).
        h = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights):
        """Hugging Face (folded or not) names -> this class's fused layout, as
        `ARCH.pairs` names it (applied once, at load)."""
        arch = self.ARCH
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop(f"{arch.head}.weight", None)
        return fuse_pairs(weights, arch, vars(self.args))

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism as mlx-lm's Llama shards (`mlx_lm.utils.sharded_load`
        calls it): each block's attention and feed-forward split over `group`;
        embedding, head and the residual stream (post-norms too) stay whole."""
        group = group or mx.distributed.init()
        sharding.shard_layers(self.layers, group, self.ARCH)

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        window = getattr(self.args, "sliding_window", None)
        return [
            RotatingKVCache(max_size=window) if l.use_sliding else KVCache()
            for l in self.layers
        ]


def fuse_pairs(weights, arch: Architecture, config: dict) -> dict:
    """Every layer's pairs (`arch.layer_pairs`: a hybrid family's by mixer)
    stacked into their fused linears."""
    for i, p in enumerate(arch.layer_prefixes(config)):
        for pair in arch.layer_pairs(config, i):
            if pair.parts != (pair.fused,):
                parts = [f"{p}.{part}" for part in pair.parts]
                fused = f"{p}.{pair.fused}"
                weights = fuse(weights, parts, fused, f"{p}.{pair.fused_bias}")
    return weights


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
                raise ValueError(  # loading/stacks.py gives a stack one setting first
                    f"{', '.join(parts)} reached the stack at different settings"
                )
            weights[f"{fused}.{suffix}"] = mx.concatenate(tensors, axis=0)
    biases = [weights.pop(f"{p}.bias", None) for p in parts]
    if all(b is not None for b in biases):
        weights[fused_bias] = mx.concatenate(biases, axis=0)
    return weights
