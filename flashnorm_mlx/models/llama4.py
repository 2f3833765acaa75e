"""FlashNorm Llama 4 (`llama4`: Scout, Maverick), the text model of mlx-lm's
`llama4` wrapper class, under its names (docs/design.md section 2q).

The config is read flat (loading/wrappers.py), text_config kept for stock.
Per layer, with s the block input's deferred 1/RMS:
- attention: q|k|v in one matmul; every fourth layer has no RoPE (zero angles,
  2e), global attention and stock's position-dependent query temperature (one
  multiply on q', as Ministral 3's); the others RoPE by `rope_scaling` on
  q's and k's rows reordered at load (stock's interleaved pairs made
  half-split, 2q), chunked attention (stock's chunk mask, ChunkedKVCache),
  and a weightless QK-norm after RoPE: a rotation keeps each head's norm, so
  it is the QK-norm before it, s cancels and eps 1e-6 becomes 1e-6 * ms (2d);
- feed-forward: experts where `interleave_moe_layer_step` says, else the GLU
  `intermediate_size_mlp` wide. A top-1 router picks on z (top-1 of s z is
  top-1 of z), its score sigmoid(s z) takes s before the sigmoid; stock feeds
  the expert x * score, so ours feeds it xs * score: its GLU then sees
  s * score before SiLU, as stock's, and owes s alone, as the shared expert
  (a dense GLU on the same s) does.
"""

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama4 as stock
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ChunkedKVCache, KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..mlx_lm_compat import llama4_attn_scale
from ..parallel import sharding
from . import llama, llama4_text
from .arch import MoE
from .decoder import MLP, Decoder, DecoderModel, fuse_pairs
from .gains import QKNormGains
from .moe import SwitchGLU, fuse_experts_and_shared

ModelArgs = stock.ModelArgs  # stock's: text_config and model_type

ARCH = dataclasses.replace(
    llama4_text.ARCH,
    layer="language_model.model.layers.{i}",
    final_norm="language_model.model.norm",
    embed="language_model.model.embed_tokens",
    head="language_model.lm_head",
    tie_default=False,  # stock's head is never the embedding
    moe=MoE(
        norm="post_attention_layernorm",
        router="feed_forward.router",
        experts="feed_forward.experts",
        count_key="num_local_experts",
        shared=(
            "feed_forward.shared_expert.gate_proj",
            "feed_forward.shared_expert.up_proj",
        ),
        shared_fused="feed_forward.shared_expert.gate_up_proj",
    ),
)
QK_EPS = 1e-6  # stock's constant, not rms_norm_eps


def uncovered(config: dict) -> Optional[str]:
    """What this file does not fold: runs as stock, with a note."""
    if config.get("attention_bias"):
        return "llama4 with attention biases"
    if config.get("tie_word_embeddings"):
        return "llama4 with a tied head"
    if config.get("num_experts_per_tok", 1) != 1:
        return "llama4 with more than one expert a token"
    return None


def canonical(config: dict, weights: dict) -> dict:
    """The vision tower dropped and the experts split and transposed, as
    stock's `sanitize`: gate_up_proj (E, D, 2F) -> gate/up (E, F, D),
    down_proj (E, F, D) -> (E, D, F)."""
    out = {
        k: v
        for k, v in weights.items()
        if "vision_model" not in k and "multi_modal_projector" not in k
    }
    for p in ARCH.layer_prefixes(config):
        e = f"{p}.feed_forward.experts"
        if f"{e}.gate_up_proj" in out:
            gate, up = mx.split(out.pop(f"{e}.gate_up_proj"), 2, axis=-1)
            out[f"{e}.gate_proj.weight"] = mx.swapaxes(gate, 1, 2)
            out[f"{e}.up_proj.weight"] = mx.swapaxes(up, 1, 2)
        if f"{e}.down_proj" in out:
            out[f"{e}.down_proj.weight"] = mx.swapaxes(out.pop(f"{e}.down_proj"), 1, 2)
    return out


@dataclass
class TextArgs(stock.TextArgs):
    tie_word_embeddings: bool = False  # what the decoder reads: never tied


def uses_rope(i: int) -> bool:
    return (i + 1) % 4 != 0  # stock's rule, whatever no_rope_layers says


class Attention(llama.Attention):
    def __init__(self, args: TextArgs, i: int):
        super().__init__(args, qkv_bias=False, o_bias=False)
        self.use_rope = uses_rope(i)
        self.temperature = args.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = args.floor_scale, args.attn_scale
        if not self.use_rope:  # zero angles: cos 1, sin 0, exactly (2e)
            self.rope = llama4_text.NoPE()
            h = self.head_dim
            self._angles = kernels.RopeAngles(mx.zeros((h // 2,), mx.float32), h)
        elif args.use_qk_norm:
            self._unit = mx.ones((self.head_dim,))
            self._qk_gains = QKNormGains(self.scale, QK_EPS)

    def make_rope(self, args: TextArgs, h: int) -> nn.Module:
        # Half-split on the reordered rows (2q); stock's scaling otherwise.
        return initialize_rope(
            h,
            args.rope_theta,
            traditional=False,
            scaling_config=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def epilogue_args(self) -> kernels.Epilogue:
        if "_qk_gains" not in self.__dict__:
            return super().epilogue_args()
        gains = self._qk_gains(self._unit, self._unit)
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(*heads, self._angles, self.rope, **gains)

    def heads(self, xs, ms, offset):
        q, k, v = super().heads(xs, ms, offset)
        if not self.temperature:
            return q, k, v
        # Stock's scale of q after RoPE, positions from offset + 1 (Ministral
        # 3's formula, a batch's offsets too): linear in q, so on q' as is.
        t = llama4_attn_scale(q.shape[2], offset + 1, self.attn_scale, self.floor_scale)
        return (q * t).astype(q.dtype), k, v


class Routed(nn.Module):
    """Stock's top-1 MoE on (xs, ms): (y, ms), y owing s."""

    def __init__(self, args: TextArgs):
        super().__init__()
        D, F, E = args.hidden_size, args.intermediate_size, args.num_local_experts
        self.router = nn.Linear(D, E, bias=False)
        self.experts = SwitchGLU(D, F, E)
        shared = SimpleNamespace(hidden_size=D, intermediate_size=F)
        self.shared_expert = MLP(shared)
        self.sharding_group: Optional[mx.distributed.Group] = None

    def __call__(self, xs, ms):
        z = self.router(xs)
        inds = mx.stop_gradient(mx.argpartition(-z, kth=0, axis=-1)[..., :1])
        picked = kernels.scaled(mx.take_along_axis(z, inds, axis=-1), ms)
        score = mx.sigmoid(picked.astype(mx.float32)).astype(xs.dtype)
        # The expert reads score * xs: s * score before its SiLU, s owed (2q).
        y = self.experts(xs * score, ms, inds).squeeze(-2)
        y = y + self.shared_expert(xs, ms)[0]
        if self.sharding_group is not None:  # each rank's hidden columns summed
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y, ms


class Block(llama4_text.TransformerBlock):
    ARCH = ARCH


class Inner(DecoderModel):
    def masks(self, h, cache) -> list:
        """Stock's: a chunk mask on the RoPE layers (their ChunkedKVCaches
        trimmed first), the global one on every fourth."""
        n, chunk = len(self.layers), self.args.attention_chunk_size
        if cache[0] is not None:
            for i, c in enumerate(cache):
                if uses_rope(i):
                    c.maybe_trim_front()
            start, offset = cache[0].start_position, cache[0].offset
        else:
            start = offset = 0
        end = offset + h.shape[1]
        linds = mx.arange(start, end)
        rinds = mx.arange(offset, end)[:, None]
        same = (linds // chunk) == (rinds // chunk)
        chunked = same & (linds <= rinds)
        full = create_attention_mask(h, cache[3])
        return [chunked if uses_rope(i) else full for i in range(n)]


class TextModel(Decoder):
    ARCH = ARCH
    Block = Block
    Inner = Inner

    def attention(self, args, i):
        return Attention(args, i)

    def feed_forward(self, args, i):
        step = args.interleave_moe_layer_step
        if i % step == step - 1:
            return Routed(args)
        wide = SimpleNamespace(
            hidden_size=args.hidden_size, intermediate_size=args.intermediate_size_mlp
        )
        return MLP(wide, ARCH.activation)


class Model(nn.Module):
    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        text = TextArgs.from_dict(vars(args.text_config))
        self.language_model = TextModel(text, norm_gains)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.language_model(inputs, cache, input_embeddings)

    def sanitize(self, weights):
        """Stock's read (`canonical`), q's and k's rows reordered per head,
        then q|k|v, gate|up, the experts' and the shared expert's gate|up fused."""
        config = vars(self.language_model.args)
        weights = canonical(config, weights)
        heads = {"q_proj": config["num_attention_heads"]}
        heads["k_proj"] = config["num_key_value_heads"]
        for p in ARCH.layer_prefixes(config):
            for proj, n in heads.items():
                for suffix in ("weight", "scales", "biases"):
                    key = f"{p}.self_attn.{proj}.{suffix}"
                    if key in weights:
                        weights[key] = llama4_text.half_split(weights[key], n)
        weights = fuse_pairs(weights, ARCH, config)
        moe = ARCH.moe
        for p in ARCH.layer_prefixes(config):
            weights = fuse_experts_and_shared(weights, p, moe)
        return weights

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self):
        chunk = self.language_model.args.attention_chunk_size
        return [
            ChunkedKVCache(chunk) if uses_rope(i) else KVCache()
            for i in range(len(self.layers))
        ]

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Attention by GQA groups, GLUs, experts and the shared expert by
        hidden columns, summed once; the router whole."""
        sharding.shard_layers(self.layers, group or mx.distributed.init(), ARCH)
