"""FlashNorm Gemma 4 (`gemma4_text`): mlx-lm's class with folded norm gains.

What differs from Gemma 3 (docs/design.md section 2m), each read from mlx-lm:
- gains are plain w (nn.RMSNorm), not 1 + w;
- q, k and v are all renormalized per head after the input norm (q_norm,
  k_norm, and v_norm without a gain): the input norm's gain folds into q|k|v
  and its deferred 1/RMS cancels in all three (section 2d), v's norm run on
  the epilogue's v' = s v with the same epsilon; the attention scale is 1;
- the pre-FFN norm folds and defers as in Llama; the post-norms stay in
  `kernels.post_residual` as in Gemma 3 (no 1 + w, no float16 clip in stock);
- a per-layer scalar on each block's output (`layer_scalar`), applied after
  the second residual, the next norm's statistics taken after it;
- sliding layers (head_dim, default RoPE) and global ones (global_head_dim,
  proportional partial RoPE through `kernels.rope_angles`), as layer_types say;
- embeddings times sqrt(hidden) unrounded, a softcapped head.
Not folded yet (one line each, `unsupported`): per-layer input embeddings,
KV-shared layers, K = V global layers and the MoE block.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..errors import UnsupportedModel
from . import gemma3
from .blocks import FusedAttention
from .decoder import Decoder, DecoderBlock, DecoderModel
from .gains import QKNorm, QKNormGains

# Gemma 3's names, norms and sandwich post-norms, with plain gains (no 1 + w).
ARCH = dataclasses.replace(
    gemma3.ARCH,
    gain_offset=0.0,
    # llama.cpp's gemma4 files: loading/gguf_gemma4.py reads them whole.
    gguf=dataclasses.replace(
        gemma3.ARCH.gguf,
        arch="gemma4",
        hf="Gemma4ForCausalLM",
        names=(),
        reader="gguf_gemma4",
    ),
    cannot=(),
)

# Weights stock's sanitize drops (quantization-aware training's clip ranges).
_DROPPED = (
    "self_attn.rotary_emb",
    "input_max",
    "input_min",
    "output_max",
    "output_min",
)


def uncovered(config: dict) -> Optional[str]:
    """What of this Gemma 4 FlashNorm does not fold yet (docs/design.md section
    2m), None where it folds all: such a config runs as stock, with a note
    (`models.is_covered`), as every family FlashNorm does not cover."""
    get = config.get
    why = [
        (get("hidden_size_per_layer_input", 256), "per-layer input embeddings"),
        (get("num_kv_shared_layers", 20), "KV-shared layers"),
        (get("attention_k_eq_v", False), "K = V global layers"),
        (get("enable_moe_block", False), "the MoE block"),
    ]
    found = [what for on, what in why if on]
    return f"gemma4_text with {', '.join(found)}" if found else None


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as stock's sanitize keeps them (lazily); idempotent."""
    return {k: v for k, v in weights.items() if not any(d in k for d in _DROPPED)}


@dataclass
class ModelArgs(gemma4_text.ModelArgs):
    def __post_init__(self):
        super().__post_init__()
        why = uncovered(vars(self))
        if why:  # `models.run_mode` never builds ours on one; a caller that does
            raise UnsupportedModel(f"{why} is not folded yet")


def is_sliding(args: ModelArgs, i: int) -> bool:
    return args.layer_types[i] == "sliding_attention"


class Attention(FusedAttention):
    """q|k|v in one matmul, one `qkv_epilogue` pass in QK-norm form, then v's
    norm without a gain (s cancels there too: section 2m)."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        sliding = is_sliding(args, layer_idx)
        h = args.head_dim if sliding or not args.global_head_dim else None
        self.head_dim = h = h or args.global_head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.eps = args.rms_norm_eps
        out = (self.n_heads + 2 * self.n_kv_heads) * h
        self.qkv_proj = nn.Linear(args.hidden_size, out, bias=False)
        self.o_proj = nn.Linear(self.n_heads * h, args.hidden_size, bias=False)
        self.q_norm = QKNorm(h)
        self.k_norm = QKNorm(h)
        key = "sliding_attention" if sliding else "full_attention"
        params = args.rope_parameters.get(key, {})
        self.rope = initialize_rope(  # stock's very call
            dims=h,
            traditional=args.rope_traditional,
            base=params.get("rope_theta", 10000.0),
            scaling_config=params,
            max_position_embeddings=args.max_position_embeddings,
        )
        self._angles = kernels.rope_angles(self.rope, h)
        self._qk_gains = QKNormGains(1.0, self.eps)  # stock's attention scale: 1

    def epilogue_args(self) -> kernels.Epilogue:
        gains = self._qk_gains(self.q_norm.weight, self.k_norm.weight)
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(*heads, self._angles, self.rope, **gains)

    def heads(self, xs, ms, offset):
        q, k, v = super().heads(xs, ms, offset)
        # v' = s v: rms_norm(s v, eps) is stock's v_norm of its v (section 2m).
        return q, k, mx.fast.rms_norm(v, None, self.eps)


class TransformerBlock(DecoderBlock):
    ARCH = ARCH

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.layer_scalar = mx.ones((1,))

    def close(self, x, a, out_gain, final: bool):
        # Post-norm, residual, pre-FFN statistics; FFN; post-norm, residual;
        # the layer scalar, then the next norm's statistics of the scaled row.
        h, ms_h, hs = kernels.post_residual(
            x, a, None, self.post_gain(0), self.eps, self.gain(1)
        )
        y, ms_y = self[self.FEED_FORWARD](hs, ms_h)
        out = kernels.post_residual(h, y, ms_y, self.post_gain(1), self.eps)[0]
        out = out * self.layer_scalar
        if final:
            return kernels.residual_norm(out, None, None, self.eps, out_gain)
        return kernels.residual(out, None, None, self.eps, out_gain)


class GemmaModel(DecoderModel):
    ROUND_EMBED_SCALE = False  # stock: h * hidden_size**0.5, a Python float


class Model(Decoder):
    Block = TransformerBlock
    Inner = GemmaModel

    def attention(self, args: ModelArgs, i: int) -> Attention:
        return Attention(args, i)

    def is_sliding(self, args: ModelArgs, i: int) -> bool:
        return is_sliding(args, i)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        out = super().__call__(inputs, cache, input_embeddings)
        cap = self.args.final_logit_softcapping
        return out if cap is None else gemma4_text.logit_softcap(cap, out)

    def sanitize(self, weights):
        return super().sanitize(canonical(vars(self.args), weights))
