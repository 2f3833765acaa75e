"""FlashNorm gpt-oss: biases everywhere, attention sinks, alternating sliding
windows and a mixture of experts with a clamped SwiGLU, as mlx-lm's `gpt_oss`.

Everything folds exactly (docs/design.md section 2j): q/k/v biases are added
after the deferred scale (Llama's `qkv_bias`), the sinks are extra logits of
the attention, which sees stock's q and k; the router's bias is added after s
scales its logits; each expert's gate and up take s before their biases and
the clamps, so the down projection's output (with its bias) owes nothing.
Weights are mlx-lm's sanitized layout (`mlp.experts.{gate,up,down}_proj`).
"""

import dataclasses
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
from mlx_lm.models.activations import swiglu_oai
from mlx_lm.models.gpt_oss import ModelArgs  # the config is stock's

from .. import kernels
from ..parallel import sharding
from . import llama
from .arch import MoE
from .moe import SparseMoE, SwitchGLU, fuse_experts

ARCH = dataclasses.replace(
    llama.ARCH,
    tie_default=False,  # gpt-oss configs say nothing: its head is its own
    moe=MoE(
        norm="post_attention_layernorm",
        router="mlp.router",
        experts="mlp.experts",
        count_key="num_local_experts",
        router_quant=(8, 64),  # mlx-lm's gpt_oss quant_predicate
    ),
    gguf=None,  # llama.cpp's gpt-oss files are not read
)


def _args(args: ModelArgs) -> SimpleNamespace:
    """mlx-lm's gpt-oss config as Llama's classes read it."""
    types = args.layer_types or ["sliding_attention", "full_attention"] * (
        args.num_hidden_layers // 2
    )
    return SimpleNamespace(
        **{
            **vars(args),
            "attention_bias": True,
            "tie_word_embeddings": False,
            "max_position_embeddings": None,
            "layer_types": types,
        }
    )


class Attention(llama.Attention):
    """Llama's fused attention with q/k/v/o biases and mlx-lm's sinks."""

    def __init__(self, args):
        super().__init__(args, qkv_bias=True, o_bias=True)
        self.sinks = mx.zeros((self.n_heads,))

    def attend(self, q, k, v, mask, cache):
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if getattr(cache, "fixed_capacity", False):
            # The compiled whole step's cache (all plain KVCaches) never comes
            # here: gpt-oss's sliding layers rotate, and mlx-lm's class needs
            # one; its `decode_attention` takes no sinks.
            raise ValueError("gpt-oss attention sinks need mlx-lm's attention")
        sinks = self.sinks.astype(q.dtype)
        return kernels.scaled_dot_product_attention(
            q, k, v, cache, 1.0, mask, sinks=sinks
        )


def _scaled_glu(gu, s, bias):
    """mlx-lm's clamped SwiGLU (compiled by mlx-lm) of (s * gate|up) + bias."""
    gate, up = mx.split((gu * s).astype(gu.dtype) + bias, 2, axis=-1)
    return swiglu_oai(gate, up)


class ClampedGLU(SwitchGLU):
    """Experts with biased gate|up: s on both before the biases and mlx-lm's
    clamped SwiGLU, so the output owes no deferred scale."""

    def __init__(self, dims: int, hidden: int, num_experts: int):
        super().__init__(dims, hidden, num_experts)
        self.down_proj.bias = mx.zeros((num_experts, dims))
        self.gate_up_bias = mx.zeros((num_experts, 2 * hidden))

    def glu(self, gu, ms_rows, idx):
        s = kernels.deferred_scale(ms_rows, gu.dtype)[..., None, :]  # (..., 1, 1)
        return _scaled_glu(gu, s, mx.expand_dims(self.gate_up_bias[idx], -2))


class ExpertsMoE(SparseMoE):
    """mlx-lm's gpt-oss MLPBlock: biased router, top-k of its logits, their
    softmax; (xs, ms) -> (y, None)."""

    def __init__(self, dims: int, hidden: int, num_experts: int, top_k: int):
        super().__init__(dims, hidden, num_experts, top_k, False)
        del self["gate"], self["switch_mlp"]
        self.router = llama.nn.Linear(dims, num_experts, bias=False)
        self.router_bias = mx.zeros((num_experts,))
        self.experts = ClampedGLU(dims, hidden, num_experts)

    def route(self, xs, ms):
        s = kernels.deferred_scale(ms, xs.dtype)
        z = self.router(xs)
        z = (z * s).astype(z.dtype) + self.router_bias
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(z, kth=-k, axis=-1)[..., -k:])
        picked = mx.take_along_axis(z, inds, axis=-1)
        return inds, mx.softmax(picked, axis=-1, precise=True)

    def __call__(self, xs, ms):
        inds, scores = self.route(xs, ms)
        y = self.experts(xs, ms, inds)
        y = (y * mx.expand_dims(scores, -1)).sum(axis=-2)
        if self.sharding_group is not None:
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y, None


class Model(llama.Model):
    ARCH = ARCH
    attention_cls = Attention

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__(_args(args), norm_gains)

    def feed_forward(self, args: ModelArgs, i: int) -> "ExpertsMoE":
        return ExpertsMoE(
            args.hidden_size,
            args.intermediate_size,
            args.num_local_experts,
            args.num_experts_per_tok,
        )

    def sanitize(self, weights):
        """mlx-lm's sanitized names; q|k|v and the experts' gate|up fused, the
        biases that must follow the deferred scale moved apart."""
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            p = ARCH.layer.format(i=i)
            weights = fuse_experts(weights, p, ARCH.moe)
            for old, new in (
                ("mlp.router.bias", "mlp.router_bias"),
                ("mlp.experts.gate_up_proj.bias", "mlp.experts.gate_up_bias"),
            ):
                if f"{p}.{old}" in weights:
                    weights[f"{p}.{new}"] = weights.pop(f"{p}.{old}")
        return weights

    def shard(self, group: Optional[mx.distributed.Group] = None):
        sharding.shard_layers(self.layers, group or mx.distributed.init(), ARCH)
