"""FlashNorm GLM-4.5 and GLM-4.6 (`glm4_moe`), as mlx-lm's `glm4_moe` runs them.

Llama's blocks (models/llama.py) with, per layer (docs/design.md section 2o):
- attention: q|k|v in one matmul with its bias, then the epilogue: the bias
  added after s (2c); with `use_qk_norm`, Qwen3's QK-norm form (2d), the bias
  then entering as b / s before it so that s still cancels; mlx-lm's plain
  RoPE on `partial_rotary_factor` of each head, the rest passed through at
  angle 0 in the same launch (2e);
- feed-forward: Llama's GLU in the first `first_k_dense_replace` layers, then
  routed experts (models/moe.py) picked by a sigmoid router whose logits take
  s before the sigmoid; `e_score_correction_bias` only picks (by groups of
  experts where `n_group` > 1), the weights are the unbiased scores,
  normalized where `norm_topk_prob`, times `routed_scaling_factor` (mlx-lm's
  own `group_expert_select` on s * logits); beside them the shared experts,
  a dense GLU on the same s.
The multi-token-prediction layer of the checkpoints is dropped, as stock does.
"""

import dataclasses
import functools
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.glm4_moe import ModelArgs  # noqa: F401 (stock's config)
from mlx_lm.models.glm4_moe import group_expert_select

from .. import kernels
from ..parallel import sharding
from . import llama
from .arch import MoE
from .decoder import MLP
from .gains import QKNorm, QKNormGains
from .moe import SparseMoE, fuse_experts_and_shared

ARCH = dataclasses.replace(
    llama.ARCH,
    qk_norms=("self_attn.q_norm", "self_attn.k_norm"),  # where use_qk_norm
    moe=MoE(
        norm="post_attention_layernorm",
        router="mlp.gate",
        experts="mlp.switch_mlp",
        count_key="n_routed_experts",
        shared=("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
        shared_fused="mlp.shared_experts.gate_up_proj",
        router_float=True,  # stock's MoEGate is no Linear: its -q keeps it float
    ),
    gguf=None,
    cannot=(("gguf", "llama.cpp's glm4moe files are not read yet"),),
    uncast=(".e_score_correction_bias",),  # float32 in any dtype, as stock's
)


def uncovered(config: dict) -> Optional[str]:
    """GLM without shared experts (never shipped; its routed layers' sum would
    miss the shared GLU this file always builds) runs as stock, with a note."""
    if config.get("n_routed_experts") and not config.get("n_shared_experts"):
        return "glm4_moe without shared experts"
    return None


def canonical(config: dict, weights: dict) -> dict:
    """`weights` without the multi-token-prediction layers (index
    num_hidden_layers and up), which mlx-lm's sanitize drops."""
    n = config["num_hidden_layers"]

    def mtp(k: str) -> bool:
        head, _, rest = k.partition("model.layers.")
        return not head and int(rest.partition(".")[0]) >= n

    return {k: v for k, v in weights.items() if not mtp(k)}


def bias_over_s(qkv, ms, bias):
    """qkv + bias / s, so that the QK-norm form's s * (qkv + bias / s) is
    stock's s * qkv + b (2o): one launch, any length (float16: plain ops,
    1/s = p * sqrt(ms) with the prescale p of 2g)."""
    if qkv.dtype == mx.float16:
        return (qkv + bias / kernels.deferred_scale(ms, qkv.dtype)).astype(qkv.dtype)
    return _bias_over_s(qkv, ms, bias)


@functools.partial(mx.compile, shapeless=True)
def _bias_over_s(qkv, ms, bias):
    return (qkv + bias * mx.sqrt(ms)).astype(qkv.dtype)


class Attention(llama.Attention):
    """q|k|v and its bias; QK-norm (Qwen3's epilogue) where `use_qk_norm`;
    mlx-lm's nn.RoPE over the first `partial_rotary_factor` of each head."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, qkv_bias=args.attention_bias, o_bias=False)
        if args.use_qk_norm:
            self.q_norm = QKNorm(self.head_dim)
            self.k_norm = QKNorm(self.head_dim)
            self._qk_gains = QKNormGains(self.scale, args.rms_norm_eps)

    def make_rope(self, args: ModelArgs, h: int) -> nn.Module:
        # Stock's: plain RoPE whatever rope_scaling says, half-split (2e).
        dims = int(h * args.partial_rotary_factor)
        return nn.RoPE(dims, traditional=False, base=args.rope_theta)

    def heads(self, xs, ms, offset):
        """A bias before the QK-norm enters as bias / s (2o): the epilogue's
        QK-norm of qkv + b / s with eps * ms is stock's rms_norm(s * qkv + b),
        and v' = s * (v + b / s) is stock's v."""
        qkv = self.qkv_proj(xs)
        if "q_norm" in self and "qkv_bias" in self:
            qkv = bias_over_s(qkv, ms, self.qkv_bias)
        return kernels.qkv_epilogue(qkv, ms, offset, self.epilogue())

    def epilogue_args(self) -> kernels.Epilogue:
        if "q_norm" not in self:  # Llama's form: the bias after s (2c)
            return super().epilogue_args()
        gains = self._qk_gains(self.q_norm.weight, self.k_norm.weight)
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(*heads, self._angles, self.rope, **gains)


class Router(nn.Module):
    """mlx-lm's MoEGate's parameters (a weight, no Linear: -q leaves it float,
    as stock's does) and its selection bias, kept float32 as stock keeps it."""

    def __init__(self, dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, dims))
        self.e_score_correction_bias = mx.zeros((num_experts,))

    def __call__(self, xs):
        return xs @ self.weight.T


class GroupRouted(SparseMoE):
    """mlx-lm's glm4_moe MoE on (xs, ms): routed experts and the shared ones,
    (y, ms) with y owing s (2j)."""

    def __init__(self, args: ModelArgs):
        D, F = args.hidden_size, args.moe_intermediate_size
        super().__init__(
            D, F, args.n_routed_experts, args.num_experts_per_tok, args.norm_topk_prob
        )
        self.gate = Router(D, args.n_routed_experts)
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.routed_scaling_factor = args.routed_scaling_factor
        shared = SimpleNamespace(
            hidden_size=D, intermediate_size=F * args.n_shared_experts
        )
        self.shared_experts = MLP(shared)

    def route(self, xs, ms):
        """s on the logits before the sigmoid, then stock's own selection: the
        correction bias picks (and ranks groups), the unbiased scores weigh."""
        z = kernels.scaled(self.gate(xs), ms)
        return group_expert_select(
            z,
            self.gate.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor,
            self.norm_topk_prob,
        )

    def shared(self, xs, ms):
        """The shared experts' GLU on the same s; it owes s as the routed do."""
        return self.shared_experts(xs, ms)[0]

    def __call__(self, xs, ms):
        inds, scores = self.route(xs, ms)
        y = self.switch_mlp(xs, ms, inds)
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        y = y + self.shared(xs, ms)
        if self.sharding_group is not None:  # each rank's hidden columns summed
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y, ms


def is_sparse(args: ModelArgs, i: int) -> bool:
    """Layer i has experts, as mlx-lm's glm4_moe DecoderLayer decides."""
    return args.n_routed_experts is not None and i >= args.first_k_dense_replace


class Model(llama.Model):
    ARCH = ARCH
    attention_cls = Attention

    def feed_forward(self, args: ModelArgs, i: int):
        return (
            GroupRouted(args) if is_sparse(args, i) else super().feed_forward(args, i)
        )

    def sanitize(self, weights):
        """The MTP layer dropped and the experts stacked (as stock's sanitize),
        then q|k|v, gate|up, the experts' and the shared experts' gate|up fused."""
        config = vars(self.args)
        weights = ARCH.moe.stack(config, canonical(config, weights))
        weights = super().sanitize(weights)
        moe = ARCH.moe
        for p in ARCH.layer_prefixes(config):
            weights = fuse_experts_and_shared(weights, p, moe)
        return weights

    @property
    def cast_predicate(self):
        return lambda path: "e_score_correction_bias" not in path  # as stock

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Attention by GQA groups, dense GLUs by hidden columns; experts and
        shared experts by hidden columns, summed once; the router whole."""
        sharding.shard_layers(self.layers, group or mx.distributed.init(), ARCH)
