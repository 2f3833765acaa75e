"""FlashNorm DeepSeek V3 (`deepseek_v3`; Kimi K2's `kimi_k2`, which mlx-lm
remaps to it), as mlx-lm's `deepseek_v3` runs it (docs/design.md section 2s).

Multi-head latent attention (MLA), per layer, x the block input, s its 1/RMS:
- the input norm's gain folds into `q_a_proj` and `kv_a_proj_with_mqa` (one
  matmul here, `q_kv_a_proj`); s must reach the rotary key part k_pe, and on
  the latent q and kv, which `q_a_layernorm` and `kv_a_layernorm`
  renormalize, it cancels: one launch puts it on the whole output row, and
  the latent norms run as stock's (mx.fast.rms_norm; skipping s there would
  need a per-token epsilon, 4 launches a norm: 2s says why not);
- `q_a_layernorm`'s gain folds into `q_b_proj`; its 1/RMS stays before it;
- `kv_a_layernorm`'s gain folds into mlx-lm's up-projections, `unembed_out`'s
  input columns and `embed_q`'s rows (read as latent @ W); its 1/RMS stays on
  each cached latent row. The cache holds stock's (latent, k_pe).
- feed-forward: GLM-4.5's (models/glm4_moe.py): dense GLUs in the first
  `first_k_dense_replace` layers and off the `moe_layer_freq` stride, else
  routed experts on a sigmoid router with s before the sigmoid, the correction
  bias only picking (by groups), and the shared experts on the same s.
The multi-token-prediction layer of the checkpoints is dropped, as stock does.
"""

import dataclasses
import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3 as stock
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.mla import MultiLinear
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..errors import ShardError
from ..parallel import cuts, sharding
from . import glm4_moe, llama
from .arch import Architecture, NormPair
from .decoder import MLP, Decoder, DecoderBlock
from .gains import Gain
from .moe import fuse_experts_and_shared

# mlx-lm's latent norms: (norm, the linears it feeds, config key of its width).
LATENT_NORMS = (
    ("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), "q_lora_rank"),
    (
        "self_attn.kv_a_layernorm",
        ("self_attn.unembed_out", "self_attn.embed_q"),
        "kv_lora_rank",
    ),
)
LATENT_EPS = 1e-6  # stock's, whatever the config says


@dataclasses.dataclass
class ModelArgs(stock.ModelArgs):
    tie_word_embeddings: bool = False  # stock always has its own head


@dataclasses.dataclass(frozen=True)
class MLAArchitecture(Architecture):
    """The contract plus the latent norms inside attention (their gains fold
    like a block norm's: `norm_pairs`, `norm_width`)."""

    def norm_pairs(self, config: dict, weights):
        out = super().norm_pairs(config, weights)
        for p in self.layer_prefixes(config):
            for norm, linears, _ in LATENT_NORMS:
                out.append((f"{p}.{norm}", [f"{p}.{lin}" for lin in linears]))
        return out

    def norm_width(self, config: dict, norm: str) -> int:
        for name, _, key in LATENT_NORMS:
            if norm.endswith(name):
                return config[key]
        return super().norm_width(config, norm)


def shard_mla(attn: nn.Module, group, where: str = "") -> None:
    """MLA by heads (ours and stock's share the names): q_b_proj's rows, the
    heads of embed_q and unembed_out, o_proj's columns all-summed; the latent
    projections and norms whole on every rank."""
    H, n = attn.num_heads, group.size()
    if H % n:
        raise ShardError(
            f"cannot shard {where} over {n} ranks: {H} heads do not divide"
        )
    a, b = group.rank() * H // n, (group.rank() + 1) * H // n
    qh = attn.q_b_proj.weight.shape[0] // H
    attn.q_b_proj = cuts.take_rows(attn.q_b_proj, [(a * qh, b * qh)])
    for name in ("embed_q", "unembed_out"):
        lin = attn[name]
        for key in ("weight", "scales", "biases"):
            if key in lin and lin[key] is not None:
                lin[key] = mx.contiguous(lin[key][a:b])
    v = cuts.input_width(attn.o_proj) // H
    attn.o_proj = cuts.sum_columns(attn.o_proj, (a * v, b * v), group, where)
    attn.num_heads = b - a


def shard_layers(layers, group, arch=None) -> None:
    """Every layer's MLA by heads, its experts and shared experts (or dense
    GLU) by hidden columns: ours, stock's and nonorm's (`ARCH.shard_layers`)."""
    for i, layer in enumerate(layers):
        shard_mla(layer.self_attn, group, f"layer {i}")
        if "switch_mlp" in layer.mlp:
            sharding.shard_experts(layer.mlp, ARCH.moe, group, f"layer {i}")
        else:
            sharding.shard_mlp(layer.mlp, group, f"layer {i}")


ARCH = MLAArchitecture(
    **{
        **{
            f.name: getattr(glm4_moe.ARCH, f.name)
            for f in dataclasses.fields(Architecture)
        },
        "pairs": (
            NormPair(
                "input_layernorm",
                "self_attn.q_kv_a_proj",
                ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
            ),
            llama.ARCH.pairs[1],
        ),
        "qk_norms": (),
        "tie_default": False,  # stock always has its own head
        "gain_on_rows": ("self_attn.embed_q",),  # read as latent @ W
        "cannot": (("gguf", "llama.cpp's deepseek2 files are not read yet"),),
        "shard_layers": shard_layers,
    }
)


class TransformerBlock(DecoderBlock):
    ARCH = ARCH
    PARTS = False  # the attention holds its cache update (engine.py)


def uncovered(config: dict) -> Optional[str]:
    """What runs as stock, with a note: no q latent (V2-Lite's q_proj), biases
    on the latent projections (s would not cancel), a tied head (stock never
    ties), routed experts without shared ones (GLM's reason)."""
    if "q_lora_rank" in config and config["q_lora_rank"] is None:
        return "deepseek_v3 without q_lora_rank"
    if config.get("attention_bias"):
        return "deepseek_v3 with attention biases"
    if config.get("tie_word_embeddings"):
        return "deepseek_v3 with tied embeddings"
    return glm4_moe.uncovered(config)


def canonical(config: dict, weights: dict) -> dict:
    """As mlx-lm's sanitize leaves them: the MTP layers dropped, Hugging Face's
    float kv_b_proj split into embed_q (transposed) and unembed_out."""
    weights = glm4_moe.canonical(config, weights)
    H, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    for k in [k for k in weights if k.endswith("kv_b_proj.weight")]:
        p = k[: -len(".kv_b_proj.weight")]
        if f"{p}.kv_b_proj.scales" in weights:
            continue  # a quantized one: stock's sanitize requantizes it
        v = weights.pop(k).reshape(H, nope + config["v_head_dim"], -1)
        weights[f"{p}.embed_q.weight"] = mx.contiguous(v[:, :nope].swapaxes(-1, -2))
        weights[f"{p}.unembed_out.weight"] = mx.contiguous(v[:, nope:])
    return weights


def renorm(u, gain: Optional[nn.Module]):
    """A latent norm on u (s on it already): stock's RMSNorm, its gain folded
    into the linears after it (None) or kept (a quantized checkpoint as
    stored)."""
    return mx.fast.rms_norm(u, None if gain is None else gain.weight, LATENT_EPS)


class Attention(nn.Module):
    """mlx-lm's DeepseekV3Attention on (xs, ms); `norm_gains`: the latent
    norms' gains kept (a quantized checkpoint as stored) and applied here."""

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.q_head_dim = self.nope + self.rope_dim
        D = args.hidden_size
        out = self.q_lora_rank + self.kv_lora_rank + self.rope_dim
        self.q_kv_a_proj = nn.Linear(D, out, bias=False)
        self.q_b_proj = nn.Linear(
            self.q_lora_rank, self.num_heads * self.q_head_dim, bias=False
        )
        self.embed_q = MultiLinear(self.nope, self.kv_lora_rank, self.num_heads)
        self.unembed_out = MultiLinear(
            self.kv_lora_rank, args.v_head_dim, self.num_heads
        )
        self.o_proj = nn.Linear(self.num_heads * args.v_head_dim, D, bias=False)
        if norm_gains:
            self.q_a_layernorm = Gain(self.q_lora_rank)
            self.kv_a_layernorm = Gain(self.kv_lora_rank)
        self.scale = self.q_head_dim**-0.5
        rs = args.rope_scaling
        if rs is not None and rs.get("mscale_all_dim", 0) and rs["factor"] > 1:
            m = 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"])
            self.scale = self.scale * (m + 1.0) ** 2  # stock's YaRN mscale
        self.rope = initialize_rope(
            dims=self.rope_dim,
            base=args.rope_theta,
            traditional=True,
            max_position_embeddings=args.max_position_embeddings,
            scaling_config=rs,
        )

    def latents(self, xs, ms):
        """q (B, H, L, nope + rope) and the cached pair: the renormalized kv
        latent (B, 1, L, r) and the rotary key part (B, 1, L, rope) before
        RoPE. s rides past q_a|kv_a to its output row in one launch, which
        k_pe needs; the latent norms then cancel it on q_a and the kv latent
        (mx.fast.rms_norm: one launch each; section 2s)."""
        B, L, _ = xs.shape
        a = kernels.scaled(self.q_kv_a_proj(xs), ms)
        q_a, ckv, k_pe = mx.split(
            a, [self.q_lora_rank, self.q_lora_rank + self.kv_lora_rank], axis=-1
        )
        q = self.q_b_proj(renorm(q_a, self.get("q_a_layernorm")))
        latent = renorm(ckv, self.get("kv_a_layernorm"))
        q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        latent = mx.expand_dims(latent, 1)
        return q, latent, k_pe.reshape(B, L, 1, self.rope_dim).transpose(0, 2, 1, 3)

    def __call__(self, xs, ms, mask=None, cache=None):
        B, L, _ = xs.shape
        q, kv_latent, k_pe = self.latents(xs, ms)
        q_nope, q_pe = mx.split(q, [self.nope], axis=-1)
        offset = cache.offset if cache is not None else 0
        q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        if cache is not None:
            kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)
        # From here stock's: the rotary scores as the additive mask.
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if isinstance(mask, str):  # the decoder's "causal": stock's array
            mask = create_causal_mask(L, kv_latent.shape[2] - L)
        if mask is not None:
            low = mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
            pe_scores = mx.where(mask, pe_scores, low)
        if L == 1:
            q_nope = self.embed_q(q_nope)
            k = v = kv_latent
        else:
            k = self.embed_q(kv_latent, transpose=False)
            v = self.unembed_out(kv_latent)
        o = kernels.scaled_dot_product_attention(
            q_nope, k, v, cache, self.scale, pe_scores
        )
        if L == 1:
            o = self.unembed_out(o)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


def is_sparse(args: ModelArgs, i: int) -> bool:
    """Layer i has experts, as mlx-lm's DeepseekV3DecoderLayer decides."""
    return (
        args.n_routed_experts is not None
        and i >= args.first_k_dense_replace
        and i % args.moe_layer_freq == 0
    )


class GroupRouted(glm4_moe.GroupRouted):
    """GLM-4.5's routed and shared experts; stock's own group_expert_select
    (deepseek_v3's: the same function, its own module)."""

    def route(self, xs, ms):
        z = kernels.scaled(self.gate(xs), ms)  # s before the sigmoid
        return stock.group_expert_select(
            z,
            self.gate.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor,
            self.norm_topk_prob,
        )


class Model(Decoder):
    ARCH = ARCH  # the registry's contract (main's Decoder reads it)
    Block = TransformerBlock

    def attention(self, args: ModelArgs, i: int) -> nn.Module:
        return Attention(args, self.norm_gains)

    def feed_forward(self, args: ModelArgs, i: int):
        return GroupRouted(args) if is_sparse(args, i) else MLP(args)

    def sanitize(self, weights):
        """Stock's MTP drop and kv_b_proj split, the experts stacked, then
        q_a|kv_a, gate|up, the experts' and shared experts' gate|up fused."""
        config = vars(self.args)
        weights = ARCH.moe.stack(config, canonical(config, weights))
        weights = super().sanitize(weights)
        for p in ARCH.layer_prefixes(config):
            weights = fuse_experts_and_shared(weights, p, ARCH.moe)
        return weights

    @property
    def cast_predicate(self):
        return lambda path: "e_score_correction_bias" not in path  # as stock

    def shard(self, group: Optional[mx.distributed.Group] = None):
        shard_layers(self.layers, group or mx.distributed.init(), ARCH)
