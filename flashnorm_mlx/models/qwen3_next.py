"""FlashNorm Qwen3-Next (and Qwen3-Coder-Next): Qwen3.5's layers under other names.

The same gated DeltaNet, gated attention and shared-expert MoE as
models/qwen3_5.py (docs/design.md section 2k), with what mlx-lm's `qwen3_next`
does differently:
- the DeltaNet's inputs are two linears, in_proj_qkvz and in_proj_ba, whose
  rows run per key head ([q | k | v | z] and [b | a] of each); the fold folds
  into them as stored, and at load their rows are reordered into Qwen3.5's one
  in_proj, [all q | all k | all v | all z | all b | all a] (a row permutation:
  exact, quantized rows too), so the mixer is Qwen3.5's;
- names under `model.` with a top-level `lm_head`; sparse layers as Qwen3-MoE
  decides (`mlp_only_layers`, `decoder_sparse_step`), dense ones a GLU;
- Hugging Face's files (per-expert weights) take 1 + w norms and the Conv1d
  move, as mlx-lm's `sanitize` does only for them (`canonical`).
"""

import dataclasses
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import ModelArgs  # stock's config

from ..errors import UnsupportedModel
from ..parallel import sharding
from . import qwen3_5
from .arch import Gguf, Mixer, NormPair
from .decoder import Decoder

DELTANET = NormPair(
    "input_layernorm",
    "linear_attn.in_proj",
    ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"),
    in_order=False,  # in_proj's rows are theirs reordered (`in_proj_rows`)
)
ARCH = dataclasses.replace(
    qwen3_5.ARCH,
    layer="model.layers.{i}",
    final_norm="model.norm",
    embed="model.embed_tokens",
    head="lm_head",
    mixers=(
        qwen3_5.ARCH.mixers[0],
        Mixer("gated_deltanet", DELTANET, qwen3_5.ARCH.mixers[1].gated_norm),
    ),
    # llama.cpp's qwen3next files: loading/gguf_qwen35.py.
    gguf=Gguf("qwen3next", "Qwen3NextForCausalLM", reader="gguf_qwen35"),
)


def is_sparse(args, i: int) -> bool:
    """Layer i has experts, as mlx-lm's Qwen3NextDecoderLayer decides."""
    return (
        i not in args.mlp_only_layers
        and args.num_experts > 0
        and (i + 1) % args.decoder_sparse_step == 0
    )


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as mlx-lm's `sanitize` leaves them (lazily): no MTP head;
    Hugging Face's per-expert files (mlx-lm's test for them) with the norms'
    1 + w made gains and the Conv1d in MLX's layout; experts stacked after,
    by `models.canonical_weights`."""
    raw = any(k.endswith(".mlp.experts.0.up_proj.weight") for k in weights)
    out = {k: v for k, v in weights.items() if "mtp." not in k}
    if config.get("tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    if raw:
        for k, v in out.items():
            if k.endswith("conv1d.weight") and v.shape[-1] != 1:
                out[k] = v.moveaxis(2, 1)
            elif v.ndim == 1 and k.endswith(qwen3_5.OFFSET_NORMS):
                out[k] = v + 1.0
    return out


def in_proj_rows(qkvz: mx.array, ba: mx.array, args) -> mx.array:
    """Qwen3.5's in_proj rows from Qwen3-Next's two (per key head) linears'
    arrays (weight, scales or biases: rows first)."""
    nk, dk = args.linear_num_key_heads, args.linear_key_head_dim
    vd = args.linear_num_value_heads // nk * args.linear_value_head_dim
    r = args.linear_num_value_heads // nk
    per_head = qkvz.reshape(nk, 2 * dk + 2 * vd, -1)
    parts = mx.split(per_head, [dk, 2 * dk, 2 * dk + vd], axis=1)
    parts += mx.split(ba.reshape(nk, 2 * r, -1), [r], axis=1)
    return mx.concatenate([p.reshape(-1, qkvz.shape[-1]) for p in parts])


class Model(qwen3_5.TextModel):
    ARCH = ARCH

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        if args.attention_bias:  # a bias before the QK-norm: s would not cancel
            raise UnsupportedModel("qwen3_next with attention_bias is not folded yet")
        super().__init__(args, norm_gains)

    def feed_forward(self, args: ModelArgs, i: int) -> nn.Module:
        if not is_sparse(args, i):
            return Decoder.feed_forward(self, args, i)
        return super().feed_forward(args, i)

    def sanitize(self, weights):
        """Canonical names, experts stacked, each DeltaNet's two linears
        reordered into one in_proj, then Qwen3.5's `fuse_layers`."""
        args = self.args
        weights = ARCH.moe.stack(vars(args), canonical(vars(args), weights))
        for p in ARCH.layer_prefixes(vars(args)):
            a = f"{p}.linear_attn"
            for suffix in ("weight", "scales", "biases"):
                if f"{a}.in_proj_qkvz.{suffix}" in weights:
                    qkvz = weights.pop(f"{a}.in_proj_qkvz.{suffix}")
                    ba = weights.pop(f"{a}.in_proj_ba.{suffix}")
                    weights[f"{a}.in_proj.{suffix}"] = in_proj_rows(qkvz, ba, args)
        return qwen3_5.fuse_layers(weights, args, ARCH)

    @property
    def cast_predicate(self):
        return lambda path: not path.endswith("A_log")  # as Qwen3.5's: float32

    def shard(self, group: Optional[mx.distributed.Group] = None):
        sharding.shard_layers(self.layers, group or mx.distributed.init(), ARCH)
