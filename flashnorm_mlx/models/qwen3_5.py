"""FlashNorm Qwen3.5 and Qwen3.6 (`qwen3_5`, `qwen3_5_moe`): gated DeltaNet and
gated attention layers.

mlx-lm's `qwen3_5` holds the text model under `language_model` (the multimodal
wrapper's name; a flat text config loads too). Three of every
`full_attention_interval` layers mix tokens with a gated DeltaNet, the fourth
with gated attention. With s the block input's deferred 1/RMS (docs/design.md
section 2k):
- gated DeltaNet: input norm gain folded into in_proj_qkv|z|b|a, one matmul;
  s applied to its output before the token-mixing convolution, the SiLU gate,
  beta's sigmoid and the decay's softplus (s commutes with none of them). The
  gated norm's gain folds into out_proj's columns, tiled per head; its per-head
  1/RMS stays.
- gated attention: q|k|v in one matmul through the QK-norm epilogue (Qwen3's:
  s cancels in q and k, v takes it), partial rotary; the output gate's rows,
  apart from q's, take s before their sigmoid.
- the GLU as Llama's, or (qwen3_5_moe) routed experts beside a shared expert
  whose sigmoid gate takes s first (models/moe.py); the last block's residual
  is the final norm.
`canonical` reads a checkpoint as mlx-lm's `sanitize` leaves it (its names,
the Conv1d layout, the 1 + w norm gains of Hugging Face's files).
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import precise_swiglu
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_5 import ModelArgs, TextModelArgs  # stock's configs
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..errors import UnsupportedModel
from ..parallel import sharding
from . import qwen3
from .arch import Architecture, GatedNorm, Gguf, Mixer, MoE, NormPair
from .decoder import Decoder, DecoderBlock, fuse, fuse_pairs
from .gains import Gain
from .moe import SharedExpertMoE, fuse_experts_and_shared

PREFIX = "language_model."  # stock's module path of the text model

ATTENTION = NormPair(
    "input_layernorm",
    "self_attn.qkv_proj",
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
)
DELTANET = NormPair(
    "input_layernorm",
    "linear_attn.in_proj",
    tuple(f"linear_attn.in_proj_{p}" for p in ("qkv", "z", "b", "a")),
)
FFN = NormPair(
    "post_attention_layernorm", "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")
)


def layer_kind(config: dict, i: int) -> str:
    """mlx-lm's DecoderLayer: every `full_attention_interval`-th layer attends."""
    interval = config.get("full_attention_interval", 4)
    return "gated_attention" if (i + 1) % interval == 0 else "gated_deltanet"


ARCH = Architecture(
    layers_key="num_hidden_layers",
    layer=PREFIX + "model.layers.{i}",
    pairs=(ATTENTION, FFN),
    final_norm=PREFIX + "model.norm",
    embed=PREFIX + "model.embed_tokens",
    head=PREFIX + "lm_head",
    tie_key="tie_word_embeddings",
    width_key="hidden_size",
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    tie_default=False,
    mixers=(
        Mixer("gated_attention", ATTENTION),
        Mixer(
            "gated_deltanet",
            DELTANET,
            GatedNorm(
                "linear_attn.norm",
                "linear_attn.out_proj",
                "linear_value_head_dim",
                "linear_num_value_heads",
            ),
        ),
    ),
    layer_kind=layer_kind,
    # qwen3_5_moe: experts in every layer, beside a sigmoid-gated shared expert
    # (docs/design.md section 2j); a dense config has no router, so no layer
    # reads these.
    moe=MoE(
        norm="post_attention_layernorm",
        router="mlp.gate",
        experts="mlp.switch_mlp",
        router_quant=(8, 64),  # mlx-lm's quant_predicate: router, shared gate
        shared=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
        shared_fused="mlp.shared_expert.gate_up_proj",
        shared_gate="mlp.shared_expert_gate",
    ),
    # llama.cpp's qwen35 and qwen35moe files: loading/gguf_qwen35.py.
    gguf=Gguf(
        "qwen35", "Qwen3_5ForCausalLM", reader="gguf_qwen35", also=("qwen35moe",)
    ),
)

# Hugging Face's norms that store w of a 1 + w gain (mlx-lm's sanitize adds 1).
OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as mlx-lm's Qwen3.5 `sanitize` leaves them (lazily): under
    `language_model.`, no vision tower or multi-token-prediction head; from
    Hugging Face's own files (a Conv1d weight not yet (C, K, 1)) the conv
    moved to MLX's layout and the 1 + w norms made gains. Idempotent."""
    raw = any(
        k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items()
    )
    out = {}
    for k, v in weights.items():
        if k.startswith(("vision_tower", "model.visual")) or "mtp." in k:
            continue
        if k.startswith("model.language_model"):
            k = k.replace("model.language_model", PREFIX + "model", 1)
        elif not k.startswith(PREFIX):
            k = PREFIX + k
        if raw and k.endswith("conv1d.weight") and v.shape[-1] != 1:
            v = v.moveaxis(2, 1)
        elif raw and v.ndim == 1 and k.endswith(OFFSET_NORMS):
            v = v + 1.0
        if k.endswith("mlp.experts.gate_up_proj"):  # (E, 2F, D): gate rows first
            head = k[: -len("experts.gate_up_proj")] + "switch_mlp."
            gate, up = mx.split(v, 2, axis=-2)
            out[head + "gate_proj.weight"], out[head + "up_proj.weight"] = gate, up
            continue
        if k.endswith("mlp.experts.down_proj"):
            out[k[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = v
            continue
        out[k] = v
    if config.get("tie_word_embeddings", False):
        out.pop(PREFIX + "lm_head.weight", None)
    return out


def _text_args(args: ModelArgs) -> TextModelArgs:
    text = TextModelArgs.from_dict(args.text_config)
    if text.attention_bias:  # a bias before the QK-norm: s would not cancel
        raise UnsupportedModel("qwen3_5 with attention_bias is not folded yet")
    return text


def fuse_layers(weights: dict, args, arch: Architecture) -> dict:
    """Per layer: q_proj's per-head [q | gate] rows parted; q|k|v, the
    DeltaNet's inputs, gate|up, the experts' and the shared expert's gate|up,
    and the router with the shared gate each stacked into one matmul (rows:
    exact for quantized ones too)."""
    h, heads, moe = args.head_dim, args.num_attention_heads, arch.moe
    prefixes = list(arch.layer_prefixes(vars(args)))
    for p in prefixes:
        q = f"{p}.self_attn.q_proj"
        for suffix in ("weight", "scales", "biases"):
            w = weights.pop(f"{q}.{suffix}", None)
            if w is not None:  # rows (heads, [q | gate], h, ...)
                parts = w.reshape(heads, 2, h, -1)
                weights[f"{q}.{suffix}"] = parts[:, 0].reshape(heads * h, -1)
                gate = parts[:, 1].reshape(heads * h, -1)
                weights[f"{p}.self_attn.gate_proj.{suffix}"] = gate
    weights = fuse_pairs(weights, arch, vars(args))
    for p in prefixes:
        weights = fuse_experts_and_shared(weights, p, moe)
        # The router's rows and the shared gate's row: one matmul.
        gates = [f"{p}.{moe.router}", f"{p}.{moe.shared_gate}"]
        weights = fuse(weights, gates, gates[0], f"{p}.mlp.gate_bias")
    return weights


class Attention(qwen3.Attention):
    """Qwen3-Next's gated attention: q|k|v through the QK-norm epilogue, then
    o_proj(attention * sigmoid(s * gate)), the gate rows apart from q's."""

    def __init__(self, args: TextModelArgs):
        super().__init__(args)
        self.gate_proj = nn.Linear(
            args.hidden_size, self.n_heads * self.head_dim, False
        )

    def make_rope(self, args: TextModelArgs, h: int) -> nn.Module:
        return initialize_rope(
            int(h * args.partial_rotary_factor),
            args.rope_theta,
            False,
            args.rope_scaling,
            args.max_position_embeddings,
        )

    def __call__(self, xs, ms, mask=None, cache=None):
        offset = cache.offset if cache is not None else 0
        q, k, v = self.heads(xs, ms, offset)
        o = self.attend(q, k, v, mask, cache)
        B, _, L, _ = o.shape
        return self.o_proj(
            o.transpose(0, 2, 1, 3).reshape(B, L, -1) * self.gate(xs, ms)
        )

    def gate(self, xs, ms):
        """sigmoid(s * (x @ Wg*)): s before the sigmoid (B, L, Hq * h)."""
        g = self.gate_proj(xs)
        return mx.sigmoid(kernels.scaled(g, ms))


class GatedDeltaNet(nn.Module):
    """mlx-lm's Qwen3.5 GatedDeltaNet on (xs, ms): one in_proj matmul, s on its
    output, then stock's convolution, recurrence and gated norm (its gain in
    out_proj, or kept with `norm_gains`)."""

    def __init__(self, args: TextModelArgs, norm_gains: bool = False):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.eps = args.rms_norm_eps
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # Rows: qkv (conv_dim) | z (value_dim) | b (heads) | a (heads).
        self.splits = [
            self.conv_dim,
            self.conv_dim + self.value_dim,
            self.conv_dim + self.value_dim + self.num_v_heads,
        ]
        width = self.splits[-1] + self.num_v_heads
        self.in_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.conv_kernel_size,
            groups=self.conv_dim,
            padding=0,
            bias=False,
        )
        self.dt_bias = mx.ones(self.num_v_heads)
        self.A_log = mx.zeros(self.num_v_heads)
        if norm_gains:  # the gated norm's gain, else folded into out_proj
            self.norm = Gain(self.head_v_dim)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    def project(self, y, ms):
        """qkv, z, b, a of the in_proj output y (B, L, rows), each times s:
        before the convolution over tokens and every activation (2k)."""
        return mx.split(kernels.scaled(y, ms), self.splits, axis=-1)

    def __call__(self, xs, ms, mask=None, cache=None):
        B, S, _ = xs.shape
        qkv, z, b, a = self.project(self.in_proj(xs), ms)
        z = z.reshape(B, S, self.num_v_heads, self.head_v_dim)
        conv_state = cache[0] if cache is not None and cache[0] is not None else None
        if conv_state is None:
            conv_state = mx.zeros(
                (B, self.conv_kernel_size - 1, self.conv_dim), xs.dtype
            )
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if cache is not None:
            n_keep = self.conv_kernel_size - 1
            if cache.lengths is not None:
                ends = mx.clip(cache.lengths, 0, S)
                positions = (ends[:, None] + mx.arange(n_keep))[..., None]
                cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
            else:
                cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        state = cache[1] if cache else None
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        out, state = gated_delta_update(
            q, k, v, a, b, self.A_log, self.dt_bias, state, mask, use_kernel=True
        )
        if cache is not None:
            cache[1] = state
            cache.advance(S)
        gain = self.norm.weight if "norm" in self else None
        out = precise_swiglu(out, z, mx.fast.rms_norm(out, gain, self.eps))
        return self.out_proj(out.reshape(B, S, -1))


class AttentionBlock(DecoderBlock):
    ARCH = ARCH
    PARTS = False  # its gate reads the block input after attention


class DeltaNetBlock(AttentionBlock):
    ATTENTION = "linear_attn"
    RECURRENT = True


class TextModel(Decoder):
    ARCH = ARCH
    Block = AttentionBlock
    attention_cls = Attention

    def block(self, args: TextModelArgs, i: int) -> type:
        deltanet = layer_kind(vars(args), i) == "gated_deltanet"
        return DeltaNetBlock if deltanet else AttentionBlock

    def attention(self, args: TextModelArgs, i: int) -> nn.Module:
        if self.block(args, i) is DeltaNetBlock:
            return GatedDeltaNet(args, self.norm_gains)
        return Attention(args)

    def feed_forward(self, args: TextModelArgs, i: int) -> nn.Module:
        """The deferred GLU, or (qwen3_5_moe) the experts beside a shared one."""
        if not args.num_experts:
            return super().feed_forward(args, i)
        return SharedExpertMoE(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
            args.shared_expert_intermediate_size,
        )

    def make_cache(self):
        return [ArraysCache(size=2) if l.RECURRENT else KVCache() for l in self.layers]


class Model(nn.Module):
    """The text model under stock's `language_model`, as mlx-lm's wrapper."""

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = TextModel(_text_args(args), norm_gains)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return self.language_model(inputs, cache, input_embeddings)

    @property
    def layers(self):
        return self.language_model.layers

    def make_cache(self):
        return self.language_model.make_cache()

    def sanitize(self, weights):
        """Canonical names (`canonical`), then `fuse_layers`."""
        text = self.language_model.args
        return fuse_layers(canonical(vars(text), weights), text, ARCH)

    @property
    def cast_predicate(self):
        return lambda path: not path.endswith("A_log")  # as stock: kept float32

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism (`sharding.shard_layers`): each DeltaNet by runs
        of key heads, each attention by GQA groups (its gate rows with its query
        heads), each GLU by hidden columns; embedding, head and residual whole."""
        sharding.shard_layers(self.layers, group or mx.distributed.init(), ARCH)
