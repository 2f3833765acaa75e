"""FlashNorm Gemma 3 (`gemma3_text`): mlx-lm's class with folded norm gains.

What differs from Llama (docs/design.md section 2h), each read from `ARCH`:
- every gain is 1 + w (`gain_offset`): the pre-attention and pre-FFN norms
  fold W* = W diag(1 + w) and defer their 1/RMS as in Llama;
- QK-norm as in Qwen3 (the deferred scale cancels), gains 1 + w in the RoPE
  tables, the attention scale query_pre_attn_scalar**-0.5 in q's gain;
- sandwich norms: a norm on the attention output and on the FFN output,
  before the residual add (`post_norms`). Those cannot fold: each is one
  `kernels.post_residual` launch (norm, gain, residual add, the next norm's
  statistics), where Llama's `residual` would run anyway;
- a GELU (tanh) GLU (`activation`), the `deferred_glu` kernel's variant;
- embeddings times sqrt(hidden) (`embed_scale`), rounded to bfloat16 first as
  mlx-lm does; a tied head;
- local layers (sliding window, RoPE base rope_local_base_freq) and global
  ones (rope_theta, rope_scaling) in mlx-lm's pattern, with its caches:
  RotatingKVCache on the local layers, so the compiled engine runs the
  blocks' cache-free parts compiled (engine.py), not the whole step.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..parallel import sharding
from .arch import Architecture, NormPair, PostNorm
from .blocks import Block, FusedAttention, run_blocks
from .gains import Gain, QKNorm, QKNormGains
from .llama import fuse

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
            "pre_feedforward_layernorm",
            "mlp.gate_up_proj",
            ("mlp.gate_proj", "mlp.up_proj"),
        ),
    ),
    final_norm="model.norm",
    embed="model.embed_tokens",
    head="lm_head",
    tie_key="tie_word_embeddings",
    width_key="hidden_size",
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    gain_offset=1.0,
    activation="gelu_tanh",
    post_norms=(
        PostNorm("post_attention_layernorm", "self_attn.o_proj"),
        PostNorm("post_feedforward_layernorm", "mlp.down_proj"),
    ),
    embed_scale=True,
)


@dataclass
class ModelArgs(gemma3_text.ModelArgs):
    # Stock ties the head unless the weights hold lm_head; convert's and
    # nonorm's untied outputs say so in the config, as the other families do.
    tie_word_embeddings: bool = True
    # Gemma 3's configs say null (stock's field is typed Dict, default None).
    rope_scaling: Optional[Dict] = None


def is_sliding(args: ModelArgs, i: int) -> bool:
    """mlx-lm's pattern: every sliding_window_pattern-th layer is global."""
    return (i + 1) % args.sliding_window_pattern != 0


class Attention(FusedAttention):
    """q|k|v in one matmul, then one `qkv_epilogue` pass in QK-norm mode."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = h = args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        out = (self.n_heads + 2 * self.n_kv_heads) * h
        self.qkv_proj = nn.Linear(args.hidden_size, out, bias=False)
        self.o_proj = nn.Linear(self.n_heads * h, args.hidden_size, bias=False)
        self.q_norm = QKNorm(h)
        self.k_norm = QKNorm(h)
        self.is_sliding = is_sliding(args, layer_idx)
        if self.is_sliding:
            self.rope = initialize_rope(h, args.rope_local_base_freq, False)
        else:
            self.rope = initialize_rope(
                h,
                args.rope_theta,
                False,
                args.rope_scaling,
                args.max_position_embeddings,
            )
        self._inv_freq = kernels.rope_inv_freq(self.rope, h)
        self._qk_gains = QKNormGains(self.scale, args.rms_norm_eps, ARCH.gain_offset)

    def epilogue_args(self) -> kernels.Epilogue:
        gains = self._qk_gains(self.q_norm.weight, self.k_norm.weight)
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(*heads, self._inv_freq, self.rope, **gains)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, xs, ms):
        """(y, ms): the FFN output is y * deferred_scale(ms)."""
        gu = self.gate_up_proj(xs)
        return self.down_proj(kernels.deferred_glu(gu, ms, ARCH.activation)), ms


class TransformerBlock(Block):
    NORMS = ("input_layernorm", "pre_feedforward_layernorm")
    POST_NORMS = tuple(p.norm for p in ARCH.post_norms)
    GAIN_OFFSET = ARCH.gain_offset

    def __init__(self, args: ModelArgs, layer_idx: int, norm_gains=False):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.self_attn = Attention(args, layer_idx)
        self.use_sliding = self.self_attn.is_sliding
        self.mlp = MLP(args)
        # Never folded: each sits before a residual add, not a linear layer.
        self.post_attention_layernorm = Gain(args.hidden_size)
        self.post_feedforward_layernorm = Gain(args.hidden_size)
        if norm_gains:
            self.keep_gains(args.hidden_size)

    def post_gain(self, i: int) -> mx.array:
        return self[self.POST_NORMS[i]].gain(self.GAIN_OFFSET)

    def close(self, x, a, out_gain, final: bool):
        """Post-norm, residual, pre-FFN statistics; FFN; post-norm, residual."""
        h, ms_h, hs = kernels.post_residual(
            x, a, None, self.post_gain(0), self.eps, self.gain(1)
        )
        y, ms_y = self.mlp(hs, ms_h)
        post = self.post_gain(1)
        if final:
            return kernels.post_residual_norm(h, y, ms_y, post, self.eps, out_gain)
        return kernels.post_residual(h, y, ms_y, post, self.eps, out_gain)


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs, norm_gains=False):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            TransformerBlock(args, i, norm_gains) for i in range(args.num_hidden_layers)
        ]
        # Folded into an untied head, so kept only for a tied one or unfolded.
        if args.tie_word_embeddings or norm_gains:
            self.norm = Gain(args.hidden_size)
        pattern = args.sliding_window_pattern
        self.global_idx = pattern - 1  # the layers whose caches the masks read
        self.local_idx = 0 if pattern > 1 else None

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = (
            input_embeddings
            if input_embeddings is not None
            else self.embed_tokens(inputs)
        )
        # As mlx-lm scales: sqrt(hidden) rounded to bfloat16, then h's dtype.
        scale = ARCH.embedding_scale(vars(self.args))
        h = h * mx.array(scale, mx.bfloat16).astype(h.dtype)
        cache = cache or [None] * len(self.layers)
        global_mask = create_attention_mask(h, cache[self.global_idx])
        local_mask = None
        if self.local_idx is not None:
            local_mask = create_attention_mask(
                h, cache[self.local_idx], window_size=self.args.sliding_window
            )
        masks = [local_mask if l.use_sliding else global_mask for l in self.layers]
        gain = self.norm.gain(ARCH.gain_offset) if "norm" in self else None
        return run_blocks(self.layers, h, self.args.rms_norm_eps, masks, cache, gain)


class Model(nn.Module):
    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        """norm_gains: the weights are unfolded (a quantized checkpoint as stored)
        and the RMSNorm gains are applied in the kernels (models/blocks.py)."""
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Gemma3Model(args, norm_gains)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        # The final norm ran in the last block (its gain folded into an untied head).
        h = self.model(inputs, cache, input_embeddings)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights):
        """Hugging Face names -> the fused layout (applied once, at load)."""
        if self.args.tie_word_embeddings and "lm_head.weight" in weights:
            # As stock decides: a stored head is used, whatever the config says
            # (the final norm, kept for a tied head, then applies its gain).
            self.args.tie_word_embeddings = False
            self.lm_head = nn.Linear(
                self.args.hidden_size, self.args.vocab_size, bias=False
            )
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

    def shard(self, group=None):
        """Tensor parallelism as for Llama (models/llama.py): attention by GQA
        groups, the FFN by hidden columns; every rank holds the whole residual
        row, so the post-norms run whole after each all-sum."""
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
