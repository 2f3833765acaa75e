"""FlashNorm Qwen3-MoE: Qwen3's FlashNorm blocks with a mixture of experts.

Attention is models/qwen3.py's (QK-norm). The feed-forward of layer i is
models/moe.py's `SparseMoE` (router and experts folded, 1/RMS deferred:
docs/design.md section 2j) where mlx-lm's class makes it sparse, i.e. i not
in `mlp_only_layers` and (i + 1) a multiple of `decoder_sparse_step`; else
Llama's dense GLU on `intermediate_size`.
"""

import dataclasses
from typing import Optional

import mlx.core as mx
from mlx_lm.models.qwen3_moe import ModelArgs  # the config is stock's

from ..parallel import sharding
from . import llama, qwen3
from .arch import Gguf, MoE
from .moe import SparseMoE, fuse_experts

ARCH = dataclasses.replace(
    qwen3.ARCH,
    moe=MoE(
        norm="post_attention_layernorm",
        router="mlp.gate",
        experts="mlp.switch_mlp",
        router_quant=(8, 64),  # mlx-lm's Qwen3-MoE quant_predicate
        gguf=("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
    ),
    gguf=Gguf("qwen3moe", "Qwen3MoeForCausalLM", names=qwen3.QK_NORMS),
)


def is_sparse(args: ModelArgs, i: int) -> bool:
    """Layer i has experts, as mlx-lm's Qwen3MoeDecoderLayer decides."""
    return (
        i not in args.mlp_only_layers
        and args.num_experts > 0
        and (i + 1) % args.decoder_sparse_step == 0
    )


class Model(llama.Model):
    ARCH = ARCH
    attention_cls = qwen3.Attention

    def feed_forward(self, args: ModelArgs, i: int):
        if not is_sparse(args, i):
            return super().feed_forward(args, i)
        return SparseMoE(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
        )

    def sanitize(self, weights):
        """Hugging Face's per-expert weights stacked (as mlx-lm's sanitize does),
        then q|k|v, the dense gate|up and the experts' gate|up each fused."""
        weights = ARCH.moe.stack(self.args.__dict__, super().sanitize(weights))
        for i in range(self.args.num_hidden_layers):
            weights = fuse_experts(weights, ARCH.layer.format(i=i), ARCH.moe)
        return weights

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Attention and dense MLPs as Llama's; the experts' gate|up by rows and
        down by columns, each rank's share all-summed; the router replicated."""
        sharding.shard_layers(self.layers, group or mx.distributed.init(), ARCH)
