"""FlashNorm Nemotron-H and Nemotron 3 (`nemotron_h`): one norm, one sublayer.

mlx-lm's `nemotron_h`: each block is a norm and one mixer, by the config's
`hybrid_override_pattern` ("M-*E", a string as checkpoints write it): a
Mamba-2 mixer (M), attention without RoPE (*), a ReLU² MLP (-) or sigmoid-
routed experts (E). The block norm's gain folds into the mixer's input
projection; s, the block input's deferred 1/RMS, goes where docs/design.md
section 2p says:
- Mamba-2: on all of in_proj's output (z gate, x|B|C, dt) before the
  convolution over tokens, the SiLUs and dt's softplus (s commutes with none);
  the grouped gated norm's gain folds into out_proj's columns, its per-group
  1/RMS stays;
- attention: s on q, k and v, the 1/sqrt(h) scale with q in the attention;
- ReLU² MLP and every expert: s on the up projection's output before relu²;
- MoE: s on the router's logits before the sigmoid (the correction bias only
  picks, mlx-lm's own selection), a shared expert on the same s, a latent
  projection (`moe_latent_size`) taking s on its output, experts then as stock.
The head is always untied: the last block's residual is the final norm, its
gain in lm_head. `canonical` reads a checkpoint as mlx-lm's `sanitize` does.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import nemotron_h as stock
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache

from .. import kernels
from ..parallel import mamba
from .arch import Architecture, GatedNorm, Mixer, MoE, NormPair
from .blocks import Block, run_blocks
from .decoder import fuse_pairs
from .gains import Gain
from .moe import SwitchReLU2

MAMBA = NormPair("norm", "mixer.in_proj", ("mixer.in_proj",))
ATTENTION = NormPair(
    "norm", "mixer.qkv_proj", ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj")
)
RELU2_MLP = NormPair("norm", "mixer.up_proj", ("mixer.up_proj",))
ROUTED = NormPair("norm", "mixer.gate", ("mixer.gate",))  # its linears: `MoE`
KINDS = {"M": "mamba2", "*": "attention", "-": "relu2_mlp", "E": "moe"}


# mlx-lm's ModelArgs: the block-type names a config may list in place of the
# pattern (transformers 5.13's and the legacy ones) and their characters.
CHARS = {"full_attention": "*", "linear_attention": "M", "moe": "E", "mlp": "-"}
CHARS.update(attention="*", mamba="M", conv="M")


def pattern(config: dict) -> str:
    """The block kinds ("M", "*", "-", "E"), as mlx-lm's ModelArgs reads them."""
    chars = config.get("hybrid_override_pattern")
    if chars is None:
        types = config.get("layers_block_type") or config.get("layer_types")
        chars = [CHARS[t] for t in types]
    return "".join(chars)


def n_layers(config: dict) -> int:
    return len(pattern(config))  # num_hidden_layers may be absent (mlx-lm's note)


def layer_kind(config: dict, i: int) -> str:
    return KINDS[pattern(config)[i]]


@dataclass(frozen=True)
class LatentMoE(MoE):
    """The MoE's contract; with a latent projection the norm feeds it (and
    router and shared expert), not the experts, which read the latent row."""

    latent: str = "mixer.fc1_latent_proj"

    def linears(self, prefix: str, weights) -> list:
        experts = f"{prefix}.{self.experts}.{self.fed[0]}"
        if f"{prefix}.{self.latent}.weight" in weights:
            swap = {experts: f"{prefix}.{self.latent}"}
        else:
            swap = {}
        out = [swap.get(l, l) for l in super().linears(prefix, weights)]
        return [l for l in out if f"{l}.weight" in weights]  # shared: optional


ARCH = Architecture(
    layers_key="num_hidden_layers",
    layer="backbone.layers.{i}",
    pairs=(MAMBA,),
    final_norm="backbone.norm_f",
    embed="backbone.embeddings",
    head="lm_head",
    tie_key="flashnorm_nemotron_h_tied",  # stock's head is always lm_head
    width_key="hidden_size",
    tie_default=False,
    mixers=(
        Mixer(
            "mamba2",
            MAMBA,
            GatedNorm(
                "mixer.norm",
                "mixer.out_proj",
                ("mamba_num_heads", "mamba_head_dim"),
                None,
            ),
        ),
        Mixer("attention", ATTENTION),
        Mixer("relu2_mlp", RELU2_MLP),
        Mixer("moe", ROUTED),
    ),
    layer_kind=layer_kind,
    layer_count=n_layers,
    moe=LatentMoE(
        norm="norm",
        router="mixer.gate",
        experts="mixer.switch_mlp",
        fed=("fc1",),  # nothing to stack: relu² has no gate
        down="fc2",
        per_expert="mixer.experts.{e}",
        per_expert_names=("up_proj", "down_proj"),
        count_key="n_routed_experts",
        shared=("mixer.shared_experts.up_proj",),
        router_float=True,  # stock's MoEGate is no linear: never quantized
    ),
    cannot=(("gguf", "llama.cpp's nemotron_h files are not read yet"),),
    shard_layers=mamba.shard_layers,  # stock's and nonorm's layers too
)


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as mlx-lm's `sanitize` leaves them, before the experts are
    stacked (`MoE.stack`): no multi-token-prediction head, the Conv1d weight
    of Hugging Face's (C, 1, K) in MLX's (C, K, 1)."""
    out = {}
    for k, v in weights.items():
        if k.startswith("mtp."):
            continue
        if "conv1d.weight" in k and v.shape[-1] != 1:
            v = v.moveaxis(2, 1)
        out[k] = v
    return out


@dataclass
class ModelArgs(stock.ModelArgs):
    tie_word_embeddings = False  # not a field: stock's head is always lm_head

    @property
    def rms_norm_eps(self) -> float:
        return self.layer_norm_epsilon


class Mamba2(stock.NemotronHMamba2Mixer):
    """mlx-lm's Mamba-2 mixer on (xs, ms): in_proj's output times s, its bias
    after (`project`); stock's convolution (`_conv`) and scan (`_ssm`); the
    grouped gated norm with its gain in out_proj (kept with `norm_gains`)."""

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__(args)
        self.eps = args.layer_norm_epsilon
        rows = self.in_proj.weight.shape[0]
        self.in_proj = nn.Linear(args.hidden_size, rows, bias=False)
        if args.mamba_proj_bias:  # added after s: in_proj(RMSNorm(x))
            self.in_bias = mx.zeros((rows,))
        del self.norm  # weightless here (`gated_norm`)
        if norm_gains:
            self.norm = Gain(self.intermediate_size)

    def project(self, xs, ms):
        """(z gate, x|B|C, dt) of in_proj's output, each times s: before the
        convolution over tokens, the SiLUs and dt's softplus (2p)."""
        y = kernels.scaled(self.in_proj(xs), ms, self.get("in_bias"))
        I, C = self.intermediate_size, self.conv_dim
        return mx.split(y, [I, I + C], axis=-1)

    def gated_norm(self, y, gate):
        """swiglu(gate, y), then 1/RMS per group of I / n_groups (2p)."""
        h = mx.unflatten(swiglu(gate, y), -1, (self.n_groups, -1))
        return mx.fast.rms_norm(h, None, self.eps).flatten(-2)

    def __call__(self, xs, ms, mask=None, cache=None):
        gate, conv_input, dt = self.project(xs, ms)
        I, N = self.intermediate_size, self.n_groups * self.ssm_state_size
        x, B, C = mx.split(self._conv(conv_input, cache, mask), [I, I + N], -1)
        y = self._ssm(x, B, C, dt, cache, mask)
        if cache:
            cache.advance(y.shape[1])
        h = self.gated_norm(y, gate)
        return self.out_proj(h * self.norm.weight if "norm" in self else h)


class Attention(nn.Module):
    """q|k|v in one matmul times s (bias after), no RoPE, the cache, attention
    with stock's 1/sqrt(h) scale, o_proj."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = (
            args.num_attention_heads,
            args.num_key_value_heads,
        )
        # Granite 4's config (models/granitemoehybrid.py) has no head_dim.
        h = getattr(args, "head_dim", None) or args.hidden_size // self.n_heads
        self.scale = h**-0.5
        rows = (self.n_heads + 2 * self.n_kv_heads) * h
        self.qkv_proj = nn.Linear(args.hidden_size, rows, bias=False)
        if args.attention_bias:
            self.qkv_bias = mx.zeros((rows,))
        self.o_proj = nn.Linear(self.n_heads * h, args.hidden_size, args.attention_bias)

    def __call__(self, xs, ms, mask=None, cache=None):
        B, L, _ = xs.shape
        qkv = kernels.scaled(self.qkv_proj(xs), ms, self.get("qkv_bias"))
        hq, hkv = self.n_heads, self.n_kv_heads  # a rank's own, where sharded
        h = qkv.shape[-1] // (hq + 2 * hkv)
        parts = mx.split(qkv, [hq * h, (hq + hkv) * h], axis=-1)
        q, k, v = [
            t.reshape(B, L, n, h).transpose(0, 2, 1, 3)
            for t, n in zip(parts, (hq, hkv, hkv))
        ]
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = kernels.scaled_dot_product_attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class ReLU2MLP(nn.Module):
    """up (s before relu², its bias after s), down: stock's NemotronHMLP."""

    def __init__(self, args: ModelArgs, hidden: Optional[int] = None):
        super().__init__()
        hidden = hidden or args.intermediate_size
        self.up_proj = nn.Linear(args.hidden_size, hidden, bias=False)
        if args.mlp_bias:
            self.up_bias = mx.zeros((hidden,))
        self.down_proj = nn.Linear(hidden, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, xs, ms, mask=None, cache=None):
        u = kernels.scaled(self.up_proj(xs), ms, self.get("up_bias"), relu2=True)
        return self.down_proj(u)


class MoE(nn.Module):
    """stock's NemotronHMoE on (xs, ms): its own group_expert_select on
    s * logits; experts (on the latent row where it has one) and shared expert."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        latent = args.moe_latent_size
        dims = latent if latent is not None else args.hidden_size
        self.switch_mlp = SwitchReLU2(
            dims, args.moe_intermediate_size, args.n_routed_experts
        )
        self.gate = stock.MoEGate(args)  # its weight and correction bias
        self.sharding_group: Optional[mx.distributed.Group] = None
        if args.n_shared_experts is not None:
            hidden = args.moe_shared_expert_intermediate_size
            self.shared_experts = ReLU2MLP(args, hidden)
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(args.hidden_size, latent, bias=False)
            if args.mlp_bias:
                self.fc1_latent_bias = mx.zeros((latent,))
            self.fc2_latent_proj = nn.Linear(latent, args.hidden_size, args.mlp_bias)

    def __call__(self, xs, ms, mask=None, cache=None):
        g = self.gate
        # s before the sigmoid; the correction bias only picks (2p).
        inds, scores = stock.group_expert_select(
            kernels.scaled(xs @ g.weight.T, ms),
            g.e_score_correction_bias,
            g.top_k,
            g.n_group,
            g.topk_group,
            g.routed_scaling_factor,
            g.norm_topk_prob,
        )
        if "fc1_latent_proj" in self:  # the latent row is whole: experts as stock
            x = kernels.scaled(
                self.fc1_latent_proj(xs), ms, self.get("fc1_latent_bias")
            )
            y = self.switch_mlp(x, None, inds)
        else:
            y = self.switch_mlp(xs, ms, inds)
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        if "fc2_latent_proj" in self:
            y = self.fc2_latent_proj(y)
        if "shared_experts" in self:
            y = y + self.shared_experts(xs, ms)
        if self.sharding_group is not None:  # each rank's hidden columns summed
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y


MIXERS = {"M": Mamba2, "*": Attention, "-": ReLU2MLP, "E": MoE}


class NemotronBlock(Block):
    """norm -> mixer -> residual: (xs, ms) in, the next block's (x, ms, xs)
    out in one `residual` launch (the final norm's, last)."""

    ARCH = ARCH
    PARTS = False  # one sublayer: no heads/project_out to compile apart

    def __init__(self, args: ModelArgs, kind: str, norm_gains: bool):
        super().__init__()
        self.eps = args.layer_norm_epsilon
        self.kind = kind
        gains = (norm_gains,) if kind == "M" else ()
        self.mixer = MIXERS[kind](args, *gains)
        if norm_gains:
            self.keep_gains(args.hidden_size)

    def __call__(self, x, ms, xs, mask, cache, out_gain, final: bool):
        y = self.mixer(xs, ms, mask, cache)
        if final:
            return kernels.residual_norm(x, y, None, self.eps, out_gain)
        return kernels.residual(x, y, None, self.eps, out_gain)


class MambaBlock(NemotronBlock):
    RECURRENT = True


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, norm_gains: bool):
        super().__init__()
        self.args = args
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            (MambaBlock if k == "M" else NemotronBlock)(args, k, norm_gains)
            for k in pattern(vars(args))
        ]
        if norm_gains:  # else folded into lm_head
            self.norm_f = Gain(args.hidden_size)

    def __call__(self, inputs, cache=None):
        h = self.embeddings(inputs)
        kinds = [l.kind for l in self.layers]
        cached = [k for k in kinds if k in "M*"]  # stock's cache list: M and *
        cache = cache or [None] * len(cached)
        # As stock: the masks read the first attention's and first Mamba's cache.
        fa, ssm = (cached.index(k) if k in cached else None for k in "*M")
        attn_mask = create_attention_mask(h, cache[fa] if fa is not None else None)
        ssm_mask = create_ssm_mask(h, cache[ssm] if ssm is not None else None)
        caches, masks, n = [], [], 0
        for k in kinds:
            caches.append(cache[n] if k in "M*" else None)
            n += k in "M*"
            masks.append(attn_mask if k == "*" else ssm_mask)
        gain = self.norm_f.weight if "norm_f" in self else None
        eps = self.args.layer_norm_epsilon
        return run_blocks(self.layers, h, eps, masks, caches, gain)


class Model(nn.Module):
    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.backbone = Backbone(args, norm_gains)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.lm_head(self.backbone(inputs, cache))

    @property
    def layers(self):
        return self.backbone.layers

    def make_cache(self):
        return [
            ArraysCache(size=2) if l.kind == "M" else KVCache()
            for l in self.layers
            if l.kind in "M*"
        ]

    def sanitize(self, weights):
        """Canonical weights, the experts stacked (`MoE.stack`), q|k|v in one
        matmul (rows: exact for quantized ones too), biases added after s under
        our names."""
        config = vars(self.args)
        weights = ARCH.moe.stack(config, canonical(config, weights))
        weights = fuse_pairs(weights, ARCH, config)
        return {_ours(k): v for k, v in weights.items()}

    @property
    def cast_predicate(self):
        return stock.Model.cast_predicate.fget(self)  # float32 bias and A_log

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism (parallel/mamba.py): Mamba-2 by whole groups,
        attention by GQA groups, MLPs and experts by hidden columns."""
        mamba.shard_layers(self.layers, group or mx.distributed.init(), ARCH)


_BIASES = ("in_proj", "up_proj", "fc1_latent_proj")  # biases added after s


def _ours(key: str) -> str:
    for lin in _BIASES:
        if key.endswith(f".{lin}.bias"):
            return key.removesuffix(f"{lin}.bias") + lin.removesuffix("_proj") + "_bias"
    return key
