"""FlashNorm LFM2-MoE: LFM2's layers (models/lfm2.py) with a mixture of experts.

The first `num_dense_layers` layers' feed-forward is a dense GLU (gate_proj,
up_proj, down_proj on `intermediate_size`, as mlx-lm's sanitize names
Hugging Face's w1, w3, w2); every later one a sparse MoE with mlx-lm's
sigmoid router (docs/design.md section 2l): weights sigmoid(s * logits), s
before the sigmoid, which it does not commute with; `expert_bias` added to
those weights only to choose the top-k experts, the chosen weights taken
unbiased, normalized where `norm_topk_prob`, times `routed_scaling_factor`.
The experts are models/moe.py's (gate|up in one gather matmul, s deferred
past down as in the dense GLU). No shared expert.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import lfm2_moe

from .. import kernels
from . import lfm2
from .arch import Gguf, MoE, NormPair
from .decoder import MLP
from .moe import SparseMoE, fuse_experts

FFN = NormPair(
    "ffn_norm",
    "feed_forward.gate_up_proj",
    ("feed_forward.gate_proj", "feed_forward.up_proj"),
)
ARCH = lfm2.make_arch(
    FFN,
    moe=MoE(
        norm="ffn_norm",
        router="feed_forward.gate",
        experts="feed_forward.switch_mlp",
        per_expert="feed_forward.experts.{e}",
        router_quant=(8, 64),  # mlx-lm's LFM2-MoE quant_predicate
    ),
    # llama.cpp's lfm2moe files: loading/gguf_lfm2.py.
    gguf=Gguf("lfm2moe", "Lfm2MoeForCausalLM", reader="gguf_lfm2"),
)
# Hugging Face's names of the GLUs' linears -> mlx-lm's (its sanitize's test).
_RENAMES = {
    "w1.weight": "gate_proj.weight",
    "w2.weight": "down_proj.weight",
    "w3.weight": "up_proj.weight",
}


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as mlx-lm's `sanitize` leaves them, before the experts are
    stacked (`MoE.stack`): the Conv1d layout and the GLUs' names."""
    out = {}
    for k, v in lfm2.canonical(config, weights).items():
        for hf, ours in _RENAMES.items():
            k = k.replace(hf, ours) if hf in k else k
        out[k] = v
    return out


@dataclass
class ModelArgs(lfm2_moe.ModelArgs):
    tie_word_embeddings = True  # not a field: stock always ties
    rope_scaling = None  # not a field: stock's RoPE is plain

    @property
    def rms_norm_eps(self) -> float:
        return self.norm_eps


class SigmoidRouted(SparseMoE):
    """mlx-lm's Lfm2MoeSparseMoeBlock on (xs, ms): its router and top-k on
    sigmoid(s * logits), the experts and weighted sum as SparseMoE's."""

    def __init__(self, args: ModelArgs):
        super().__init__(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
        )
        self.routed_scaling_factor = args.routed_scaling_factor
        if args.use_expert_bias:
            self.expert_bias = mx.zeros((args.num_experts,))

    def route(self, xs, ms):
        """(indices, scores): s before the sigmoid (2l); the bias only picks."""
        weights = mx.sigmoid(kernels.scaled(self.gate(xs), ms))
        pick = weights
        if "expert_bias" in self:
            pick = weights.astype(mx.float32) + self.expert_bias
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(pick, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(weights, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-6)
        return inds, (scores * self.routed_scaling_factor).astype(xs.dtype)


class Model(lfm2.Model):
    ARCH = ARCH  # the blocks are LFM2's: the same norms and mixers

    def feed_forward(self, args: ModelArgs, i: int):
        if i < args.num_dense_layers:
            return MLP(args)
        return SigmoidRouted(args)

    def sanitize(self, weights):
        """Canonical names, the experts stacked (`MoE.stack`), then LFM2's
        fusing and the experts' gate|up in one gather matmul."""
        config = vars(self.args)
        weights = ARCH.moe.stack(config, canonical(config, weights))
        weights = super().sanitize(weights)
        for p in ARCH.layer_prefixes(config):
            weights = fuse_experts(weights, p, ARCH.moe)
        return weights
