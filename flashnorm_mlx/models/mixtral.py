"""FlashNorm Mixtral: Llama's FlashNorm attention with a mixture of experts in
every layer (`block_sparse_moe`), as mlx-lm's `mixtral` runs it.

The experts and the deferred scale are models/moe.py's (docs/design.md section
2j); the routing is Mixtral's: the top-k logits, then their softmax, s applied
to the k picked logits. mlx-lm's class runs plain RoPE (no `rope_scaling`) and
head_dim = hidden / heads; so does this one.
"""

import dataclasses
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
from mlx_lm.models.mixtral import ModelArgs  # the config is stock's

from ..parallel import sharding
from . import llama
from .arch import MoE
from .moe import SoftmaxOfTopK, fuse_experts

ARCH = dataclasses.replace(
    llama.ARCH,
    moe=MoE(
        norm="post_attention_layernorm",
        router="block_sparse_moe.gate",
        experts="block_sparse_moe.switch_mlp",
        per_expert="block_sparse_moe.experts.{e}",
        per_expert_names=("w1", "w3", "w2"),
        count_key="num_local_experts",
    ),
    gguf=None,  # llama.cpp writes Mixtral as `llama` with experts: not read
)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        # mlx-lm's Mixtral: no biases, nn.RoPE whatever rope_scaling says.
        plain = SimpleNamespace(
            **{
                **vars(args),
                "attention_bias": False,
                "rope_scaling": None,
                "max_position_embeddings": None,
            }
        )
        super().__init__(plain, qkv_bias=False, o_bias=False)


class TransformerBlock(llama.TransformerBlock):
    FEED_FORWARD = "block_sparse_moe"  # its experts' module, in every layer


class Model(llama.Model):
    ARCH = ARCH
    Block = TransformerBlock
    attention_cls = Attention

    def feed_forward(self, args: ModelArgs, i: int) -> SoftmaxOfTopK:
        return SoftmaxOfTopK(
            args.hidden_size,
            args.intermediate_size,
            args.num_local_experts,
            args.num_experts_per_tok,
        )

    def sanitize(self, weights):
        """Per-expert w1/w3/w2 stacked as mlx-lm's sanitize does, then q|k|v and
        each layer's experts' gate|up fused."""
        args = vars(self.args)
        weights = ARCH.moe.stack(args, super().sanitize(weights))
        for i in range(self.args.num_hidden_layers):
            weights = fuse_experts(weights, ARCH.layer.format(i=i), ARCH.moe)
        return weights

    def shard(self, group: Optional[mx.distributed.Group] = None):
        sharding.shard_layers(self.layers, group or mx.distributed.init(), ARCH)
