"""FlashNorm Granite 4 (`granitemoehybrid`): Mamba-2 and attention, experts.

mlx-lm's `granitemoehybrid`: each layer is input_layernorm -> a Mamba-2 mixer
or attention (by `layer_types`), then post_attention_layernorm -> softmax-of-
top-k experts beside a shared GLU (`num_local_experts`), or a dense GLU. With
s the block input's deferred 1/RMS (docs/design.md section 2r):
- Mamba-2: input_layernorm's gain in in_proj, s on all of in_proj's output
  before the convolution over tokens (as Nemotron-H's, 2p); the gated norm
  spans the whole intermediate vector (one 1/RMS per token, whatever
  n_groups): its gain folds into out_proj's columns and its 1/RMS defers past
  out_proj to the block's residual;
- attention: RoPE or none (`position_embedding_type`), stock's
  attention_multiplier as the attention's scale;
- experts: s on the k picked logits before their softmax (Mixtral's, 2j), the
  shared GLU on the same s; or the dense GLU.
The µP multipliers fold into weights at load (`Model.sanitize`, 2r):
residual_multiplier into every linear that closes a sublayer, the
embedding_multiplier into the embedding table, 1/logits_scaling into an untied
head (a tied one: into the final norm's gain, with 1/embedding_multiplier).
`canonical` reads a checkpoint as mlx-lm's `sanitize` leaves it.
"""

from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import granitemoehybrid as stock
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_ssm_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..parallel import sharding
from . import llama, nemotron_h
from .arch import Architecture, GatedNorm, Mixer, MoE, NormPair
from .decoder import MLP, Decoder, DecoderBlock, DecoderModel, fuse_pairs
from .gains import Gain
from .moe import SoftmaxOfTopK, fuse_experts

MAMBA = NormPair("input_layernorm", "mamba.in_proj", ("mamba.in_proj",))
ATTENTION = NormPair(
    "input_layernorm",
    "self_attn.qkv_proj",
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
)
FFN = NormPair(
    "post_attention_layernorm", "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")
)
KINDS = {"mamba": "mamba2", "attention": "attention"}


def layer_kind(config: dict, i: int) -> str:
    return KINDS[config["layer_types"][i]]


def shard_layers(layers, group, arch=None) -> None:
    """Ours and mlx-lm's layers over `group` (docs/design.md 2r): attention by
    GQA groups, a dense GLU by hidden columns; ours' experts and shared GLU by
    hidden columns, one all-sum for both. Every Mamba-2 mixer stays whole on
    every rank: its gated norm's one 1/RMS reads the whole vector. Stock's
    experts stay whole too (its shared GLU is the layer's, beside the block)."""
    for i, layer in enumerate(layers):
        where = f"layer {i}"
        if "self_attn" in layer:
            sharding.shard_attention(layer.self_attn, group, where)
        if "mlp" in layer:
            sharding.shard_mlp(layer.mlp, group, where)
        elif "shared_mlp" in layer.block_sparse_moe:  # ours
            sharding.shard_experts(layer.block_sparse_moe, ARCH.moe, group, where)


ARCH = Architecture(
    layers_key="num_hidden_layers",
    layer="model.layers.{i}",
    pairs=(MAMBA, FFN),
    final_norm="model.norm",
    embed="model.embed_tokens",
    head="lm_head",
    tie_key="tie_word_embeddings",
    width_key="hidden_size",
    mixers=(
        Mixer(
            "mamba2",
            MAMBA,
            # Ungrouped: one gain and one 1/RMS over the whole vector (2r).
            GatedNorm(
                "mamba.norm", "mamba.out_proj", ("mamba_n_heads", "mamba_d_head"), None
            ),
        ),
        Mixer("attention", ATTENTION),
    ),
    layer_kind=layer_kind,
    moe=MoE(
        norm="post_attention_layernorm",
        router="block_sparse_moe.router.layer",
        experts="block_sparse_moe.switch_mlp",
        count_key="num_local_experts",
        router_quant=(8, 64),  # stock's quant_predicate
        shared=("shared_mlp.input_linear",),  # gate|up rows already
    ),
    shard_layers=shard_layers,  # stock's layers too
    cannot=(
        ("gguf", "llama.cpp's granitehybrid files are not read yet"),
        ("nonorm", "its µP multipliers are not carried by the nonorm build yet"),
    ),
)

# The linears that close a sublayer: residual_multiplier folds into them (2r).
_CLOSING = (
    "mamba.out_proj",
    "self_attn.o_proj",
    "block_sparse_moe.switch_mlp.down_proj",
    "shared_mlp.output_linear",
    "mlp.down_proj",
)


def uncovered(config: dict) -> Optional[str]:
    """A checkpoint quantized in a mode other than affine (mxfp4's scales are
    powers of two) cannot take the µP multipliers in its scales exactly: it
    runs as stock, with a note (docs/design.md 2r)."""
    q = config.get("quantization") or {}
    modes = [q.get("mode", "affine")]
    modes += [v.get("mode", modes[0]) for v in q.values() if isinstance(v, dict)]
    if any(m != "affine" for m in modes):
        return f"granitemoehybrid quantized as {modes[0]}"
    return None


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as mlx-lm's `sanitize` leaves them (lazily): Conv1d (C, 1, K)
    moved to (C, K, 1); the experts' input_linear split into gate and up,
    output_linear as down; a dense model's shared_mlp as `mlp`."""
    out = {}
    moe = bool(config.get("num_local_experts"))
    for k, v in weights.items():
        if "conv1d.weight" in k and v.shape[-1] != 1:
            v = v.moveaxis(2, 1)
        if moe and k.endswith("block_sparse_moe.input_linear.weight"):
            head = k.removesuffix("input_linear.weight") + "switch_mlp."
            gate, up = mx.split(v, 2, axis=1)
            out[head + "gate_proj.weight"], out[head + "up_proj.weight"] = gate, up
            continue
        if moe and k.endswith("block_sparse_moe.output_linear.weight"):
            out[k.replace("output_linear", "switch_mlp.down_proj")] = v
            continue
        if not moe and ".shared_mlp.input_linear.weight" in k:
            gate, up = mx.split(v, 2, axis=0)
            head = k.removesuffix("shared_mlp.input_linear.weight") + "mlp."
            out[head + "gate_proj.weight"], out[head + "up_proj.weight"] = gate, up
            continue
        if not moe and ".shared_mlp.output_linear.weight" in k:
            out[k.replace("shared_mlp.output_linear", "mlp.down_proj")] = v
            continue
        out[k] = v
    if config.get("tie_word_embeddings", True):
        out.pop("lm_head.weight", None)
    return out


ModelArgs = stock.ModelArgs  # the config is stock's, field for field


class Mamba2(stock.GraniteMoeHybridMamba2Mixer):
    """mlx-lm's Mamba-2 mixer on (xs, ms): in_proj's output times s (its bias
    after), stock's convolution and scan, the whole-vector gated norm's 1/RMS
    deferred past out_proj: (y, ms_y), y owing deferred_scale(ms_y)."""

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__(args)
        self.eps = args.rms_norm_eps
        rows, I = self.in_proj.weight.shape[0], self.intermediate_size
        self.in_proj = nn.Linear(args.hidden_size, rows, bias=False)
        self.out_proj = nn.Linear(I, args.hidden_size, bias=False)
        if args.mamba_proj_bias:  # added after s: in_proj(RMSNorm(x))
            self.in_bias = mx.zeros((rows,))
            self.out_bias = mx.zeros((args.hidden_size,))
        del self.norm  # its gain in out_proj's columns, else kept (`norm_gains`)
        if norm_gains:
            self.norm = Gain(I)

    def __call__(self, xs, ms, mask=None, cache=None):
        # s before the convolution over tokens, the SiLUs and dt's softplus (2p).
        y = kernels.scaled(self.in_proj(xs), ms, self.get("in_bias"))
        I, C, N = (
            self.intermediate_size,
            self.conv_dim,
            self.n_groups * self.ssm_state_size,
        )
        gate, conv_input, dt = mx.split(y, [I, I + C], axis=-1)
        x, B, Cm = mx.split(self._conv(conv_input, cache, mask), [I, I + N], -1)
        y = self._ssm(x, B, Cm, dt, cache, mask)
        if cache:
            cache.advance(y.shape[1])
        # One 1/RMS per token over the whole vector: its statistics and the row
        # out_proj reads in one launch; the 1/RMS rides to the residual (2r).
        gain = self.norm.weight if "norm" in self else None
        _, ms_h, hs = kernels.residual(swiglu(gate, y), None, None, self.eps, gain)
        out = self.out_proj(hs)
        if "out_bias" in self:  # a bias stops the deferral: scale, then add
            return kernels.scaled(out, ms_h, self.out_bias), None
        return out, ms_h


class Attention(llama.Attention):
    """Llama's fused attention with RoPE as stock makes it, scaled by
    attention_multiplier (stock's scale)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.scale = args.attention_multiplier

    def make_rope(self, args, h: int) -> nn.Module:
        return initialize_rope(
            h, args.rope_theta, False, None, args.max_position_embeddings
        )


class NoPEAttention(nemotron_h.Attention):
    """q|k|v in one matmul times s (bias after), no RoPE (`nope`), the cache,
    attention at attention_multiplier, o_proj: Nemotron-H's attention with
    Granite's scale."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.scale = args.attention_multiplier


class GraniteMoE(SoftmaxOfTopK):
    """Stock's top-k of the router's logits z (s > 0 keeps the picks and
    stock's argpartition order), s on the k picked logits before their softmax
    (2j); the experts and the shared GLU on the same s: the sum owes s."""

    def __init__(self, args: ModelArgs):
        E, k = args.num_local_experts, args.num_experts_per_tok
        super().__init__(args.hidden_size, args.intermediate_size, E, k)
        del self.gate
        self.router = nn.Module()
        self.router.layer = nn.Linear(args.hidden_size, E, bias=False)
        shape = SimpleNamespace(
            hidden_size=args.hidden_size,
            intermediate_size=args.shared_intermediate_size,
        )
        self.shared_mlp = MLP(shape)

    def route(self, xs, ms):
        z = self.router.layer(xs)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(z, kth=-k, axis=-1)[..., -k:])
        picked = mx.take_along_axis(z, inds, axis=-1)
        picked = (picked * kernels.deferred_scale(ms, xs.dtype)).astype(z.dtype)
        return inds, mx.softmax(picked, axis=-1, precise=True)

    def __call__(self, xs, ms):
        inds, scores = self.route(xs, ms)
        y = self.switch_mlp(xs, ms, inds)
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        shared, _ = self.shared_mlp(xs, ms)  # owes s too
        y = y + shared
        if self.sharding_group is not None:  # each rank's hidden columns summed
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y, ms


class GraniteBlock(DecoderBlock):
    ARCH = ARCH  # sets the names from pairs: ATTENTION "mamba", FEED_FORWARD "mlp"

    def __init__(self, args, attention, ffn, norm_gains=False, use_sliding=False):
        if args.use_moe:  # stock's module name for the experts' feed-forward
            self.__dict__["FEED_FORWARD"] = "block_sparse_moe"
        super().__init__(args, attention, ffn, norm_gains, use_sliding)


class AttentionBlock(GraniteBlock):
    ATTENTION = "self_attn"


class NoPEBlock(AttentionBlock):
    PARTS = False  # no heads/project_out to compile apart


class MambaBlock(GraniteBlock):
    RECURRENT = True
    PARTS = False

    def __call__(self, x, ms, xs, mask, cache, out_gain, final: bool):
        a, ms_a = self.mamba(xs, ms, mask, cache)
        return self.close(x, a, out_gain, final, ms_a)


class Inner(DecoderModel):
    def masks(self, h, cache) -> list:
        """As stock: no attention mask where no layer attends (all Mamba-2)."""
        if all(l.RECURRENT for l in self.layers):
            return [create_ssm_mask(h, cache[0])] * len(self.layers)
        return super().masks(h, cache)


class Model(Decoder):
    ARCH = ARCH
    Block = AttentionBlock
    Inner = Inner

    def block(self, args, i: int) -> type:
        if args.layer_types[i] == "mamba":
            return MambaBlock
        return AttentionBlock if args.position_embedding_type != "nope" else NoPEBlock

    def attention(self, args, i: int) -> nn.Module:
        if args.layer_types[i] == "mamba":
            return Mamba2(args, self.norm_gains)
        return (
            Attention(args)
            if args.position_embedding_type != "nope"
            else NoPEAttention(args)
        )

    def feed_forward(self, args, i: int) -> nn.Module:
        return GraniteMoE(args) if args.use_moe else MLP(args)

    def shard(self, group: Optional[mx.distributed.Group] = None):
        shard_layers(self.layers, group or mx.distributed.init())

    def make_cache(self):
        return [ArraysCache(size=2) if l.RECURRENT else KVCache() for l in self.layers]

    def sanitize(self, weights):
        """Canonical weights, the µP multipliers folded (`multipliers`), q|k|v,
        gate|up and the experts' gate|up stacked, our names."""
        config = vars(self.args)
        weights = multipliers(config, canonical(config, weights))
        weights = fuse_pairs(weights, ARCH, config)
        for p in ARCH.layer_prefixes(config):
            weights = fuse_experts(weights, p, ARCH.moe)
        return {_ours(k): v for k, v in weights.items()}


def _times(weights: dict, module: str, c: float) -> None:
    """`module`'s weight (or a quantized one's scales and biases) and bias
    times c: a constant commutes with the linear map (2r)."""
    scaled = (".scales", ".biases") if f"{module}.scales" in weights else (".weight",)
    for suffix in (*scaled, ".bias"):
        if f"{module}{suffix}" in weights:
            weights[f"{module}{suffix}"] = weights[f"{module}{suffix}"] * c


def multipliers(config: dict, weights: dict) -> dict:
    """Granite's µP multipliers in the weights (2r): residual_multiplier r in
    every sublayer's closing linear (h + r * W y = h + (r W) y); the
    embedding_multiplier in the table (the residual stream is stock's, so the
    norms' eps sees stock's rows); 1/logits_scaling in an untied head, or,
    with a tied head that now holds the embedding_multiplier, both undone in
    the final norm's gain (RMSNorm(x) * g @ E^T: linear in g)."""
    weights = dict(weights)
    r, m = config["residual_multiplier"], config["embedding_multiplier"]
    for p in ARCH.layer_prefixes(config):
        for lin in _CLOSING:
            _times(weights, f"{p}.{lin}", r)
    _times(weights, ARCH.embed, m)
    scale = 1.0 / config["logits_scaling"]
    if ARCH.is_tied(config):
        weights[f"{ARCH.final_norm}.weight"] = weights[f"{ARCH.final_norm}.weight"] * (
            scale / m
        )
    else:
        _times(weights, ARCH.head, scale)
    return weights


_RENAMES = {
    ".shared_mlp.input_linear.": ".block_sparse_moe.shared_mlp.gate_up_proj.",
    ".shared_mlp.output_linear.": ".block_sparse_moe.shared_mlp.down_proj.",
}
_BIASES = ("mamba.in_proj", "mamba.out_proj")  # added after s: under our names


def _ours(key: str) -> str:
    for lin in _BIASES:
        if key.endswith(f".{lin}.bias"):
            return key.removesuffix("_proj.bias") + "_bias"
    for theirs, ours in _RENAMES.items():
        if theirs in key:
            return key.replace(theirs, ours, 1)
    return key
