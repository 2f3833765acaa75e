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
- a GELU (tanh) GLU (`activation`), the `deferred_glu` kernel's GELU form;
- embeddings times sqrt(hidden) (`embed_scale`), rounded to bfloat16 first as
  mlx-lm does; a tied head;
- local layers (sliding window, RoPE base rope_local_base_freq) and global
  ones (rope_theta, rope_scaling) in mlx-lm's pattern, with its caches:
  RotatingKVCache on the local layers, so the compiled engine runs the
  blocks' cache-free parts compiled (engine.py), not the whole step.
The skeleton (embedding scale, post-norm blocks, caches, shard) is
models/decoder.py's; this file holds the attention and the layer pattern.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import mlx.nn as nn
from mlx_lm.models import gemma3_text
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from .arch import Architecture, Gguf, NormPair, PostNorm
from .blocks import FusedAttention
from .decoder import Decoder, DecoderBlock
from .gains import QKNorm, QKNormGains

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
    # llama.cpp's ffn_norm is the pre-FFN norm here; the sandwich norms its own.
    gguf=Gguf(
        "gemma3",
        "Gemma3ForCausalLM",
        reader="gguf_gemma3",  # its norms stored as 1 + w, its loader's settings
        names=(
            ("attn_q_norm", "self_attn.q_norm"),
            ("attn_k_norm", "self_attn.k_norm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
        ),
    ),
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
    """q|k|v in one matmul, then one `qkv_epilogue` pass in QK-norm form."""

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
        self._angles = kernels.rope_angles(self.rope, h)
        self._qk_gains = QKNormGains(self.scale, args.rms_norm_eps, ARCH.gain_offset)

    def epilogue_args(self) -> kernels.Epilogue:
        gains = self._qk_gains(self.q_norm.weight, self.k_norm.weight)
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(*heads, self._angles, self.rope, **gains)


class TransformerBlock(DecoderBlock):
    ARCH = ARCH


class Model(Decoder):
    ARCH = ARCH
    Block = TransformerBlock

    def attention(self, args: ModelArgs, i: int) -> Attention:
        return Attention(args, i)

    def is_sliding(self, args: ModelArgs, i: int) -> bool:
        return is_sliding(args, i)

    def sanitize(self, weights):
        if self.args.tie_word_embeddings and "lm_head.weight" in weights:
            # As stock decides: a stored head is used, whatever the config says
            # (the final norm, kept for a tied head, then applies its gain).
            self.args.tie_word_embeddings = False
            self.lm_head = nn.Linear(
                self.args.hidden_size, self.args.vocab_size, bias=False
            )
        return super().sanitize(weights)
