"""FlashNorm OpenELM: mlx-lm's OpenELM with folded norm gains and deferred 1/RMS.

Runs on weights folded by `flashnorm_mlx.fold.fold_norms` (attn_norm -> qkv_proj,
ffn_norm -> proj_1). Per block, with ms = mean(x^2) + eps in float32 and
s = rsqrt(ms) (docs/design.md sections 2b and 2d):
    q, k, v = split(x @ Wqkv*)                      x is never normalized
    q' = RoPE(gq * q / sqrt(mean(q^2) + eps*ms)) / sqrt(h)   (exact QK-norm of s*q)
    k' = RoPE(gk * k / sqrt(mean(k^2) + eps*ms)),   v' = v * s
    ffn = proj_2(silu(s * gate) * up) * s
q', k', v' come out of the fused qkv matmul in one `kernels.qkv_epilogue` pass
(its QK-norm form): the QK-norm gains, with 1/sqrt(h) folded into q's once, ride
with RoPE's cos and sin, so attention runs with scale 1. Without QK-norm
(normalize_qk_projections=False) it is the Llama epilogue: q' = RoPE(q) * s /
sqrt(h), k' = RoPE(k) * s.

A decode step launches 11 primitives per block, as FlashNorm Llama's does (see
models/llama.py): blocks hand on (x, ms, xs) as models/blocks.py describes, with
the norm gains folded or, with `norm_gains`, applied in the kernels.
"""

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.openelm import make_divisible

from .. import kernels
from ..parallel import sharding
from .arch import Architecture, NormPair
from .blocks import Block, FusedAttention, run_blocks
from .gains import QKNorm, QKNormGains

ARCH = Architecture(
    layers_key="num_transformer_layers",
    layer="transformer.layers.{i}",
    pairs=(
        NormPair("attn_norm", "attn.qkv_proj", ("attn.qkv_proj",)),
        NormPair("ffn_norm", "ffn.proj_1", ("ffn.proj_1",)),
    ),
    final_norm="transformer.norm",
    embed="transformer.token_embeddings",
    head="lm_head",
    tie_key="share_input_output_layers",
    width_key="model_dim",
    qk_norms=("attn.q_norm", "attn.k_norm"),
)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    head_dim: int
    num_transformer_layers: int
    model_dim: int
    vocab_size: int
    ffn_dim_divisor: int
    num_query_heads: List
    num_kv_heads: List
    ffn_multipliers: List
    ffn_with_glu: bool = True
    normalize_qk_projections: bool = True
    share_input_output_layers: bool = True
    rms_norm_eps: float = 1e-6
    rope_freq_constant: float = 10000
    # Apple's precomputed RoPE length; informational (angles come from inv_freq).
    rope_max_length: Optional[int] = None


class Attention(FusedAttention):
    OUT = "out_proj"

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.head_dim = h = args.head_dim
        self.n_heads = args.num_query_heads[layer_id]
        self.n_kv_heads = args.num_kv_heads[layer_id]
        self.scale = h**-0.5
        self.eps = args.rms_norm_eps
        op_size = (self.n_heads + 2 * self.n_kv_heads) * h
        self.qkv_proj = nn.Linear(args.model_dim, op_size, bias=False)
        self.out_proj = nn.Linear(self.n_heads * h, args.model_dim, bias=False)
        if args.normalize_qk_projections:
            self.q_norm = QKNorm(h)
            self.k_norm = QKNorm(h)
            self._qk_gains = QKNormGains(self.scale, self.eps)
        # RoPE angles per position, mx.fast.rope's own float32 formula ("_": not
        # a parameter).
        rope = nn.RoPE(h, traditional=False, base=args.rope_freq_constant)
        self._angles = kernels.rope_angles(rope, h)
        if self._angles is None:
            raise ValueError(f"head_dim {h}: the qkv epilogue needs an even head_dim")

    def epilogue_args(self) -> kernels.Epilogue:
        """The epilogue's form: QK-norm gains and epsilons (see models/gains.py),
        or Llama's scale without QK-norm."""
        heads = (self.n_heads, self.n_kv_heads, self._angles)
        if "q_norm" not in self:
            return kernels.Epilogue(*heads, scale=self.scale)
        return kernels.Epilogue(
            *heads, **self._qk_gains(self.q_norm.weight, self.k_norm.weight)
        )


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        dim = args.model_dim
        hidden = int(
            make_divisible(
                args.ffn_multipliers[layer_id] * dim, divisor=args.ffn_dim_divisor
            )
        )
        self.proj_1 = nn.Linear(dim, 2 * hidden, bias=False)  # gate | up
        self.proj_2 = nn.Linear(hidden, dim, bias=False)

    def __call__(self, xs, ms):
        """(proj_2(silu(s*gate) * up), ms), s from ms: the output owes the other s,
        which the caller's residual applies."""
        return self.proj_2(kernels.deferred_glu(self.proj_1(xs), ms)), ms


class TransformerBlock(Block):
    ARCH = ARCH  # attn_norm and ffn_norm, attn and ffn

    def __init__(self, args: ModelArgs, layer_id: int, norm_gains: bool = False):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.attn = Attention(args, layer_id)
        self.ffn = MLP(args, layer_id)
        if norm_gains:
            self.keep_gains(args.model_dim)


class OpenELMModel(nn.Module):
    act_dtype = None  # as decoder.DecoderModel's: stock's promoted dtype

    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        super().__init__()
        self.args = args
        self.token_embeddings = nn.Embedding(args.vocab_size, args.model_dim)
        self.layers = [
            TransformerBlock(args, i, norm_gains)
            for i in range(args.num_transformer_layers)
        ]
        # Folded into an untied head, so kept only for a shared one or unfolded.
        if args.share_input_output_layers or norm_gains:
            self.norm = nn.RMSNorm(args.model_dim, eps=args.rms_norm_eps)

    def __call__(self, inputs, cache=None):
        h = self.token_embeddings(inputs)
        if self.act_dtype is not None and h.dtype != self.act_dtype:
            h = h.astype(self.act_dtype)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        gain = self.norm.weight if "norm" in self else None
        masks = [mask] * len(self.layers)
        return run_blocks(self.layers, h, self.args.rms_norm_eps, masks, cache, gain)


class Model(nn.Module):
    def __init__(self, args: ModelArgs, norm_gains: bool = False):
        """norm_gains: unfolded weights, the RMSNorm gains applied in the kernels
        (models/blocks.py)."""
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.transformer = OpenELMModel(args, norm_gains)
        if not args.share_input_output_layers:
            self.lm_head = nn.Linear(args.model_dim, args.vocab_size, bias=False)

    def __call__(self, inputs, cache=None):
        # The final norm ran in the last block (its gain folded into an untied head).
        h = self.transformer(inputs, cache)
        if self.args.share_input_output_layers:
            return self.transformer.token_embeddings.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights):
        """Drop what this class does not hold (applied once, at load)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
        if self.args.share_input_output_layers:
            weights.pop("lm_head.weight", None)
        return weights

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Tensor parallelism the mlx-lm way, each layer by its own head counts:
        q|k|v rows by whole GQA groups, gate|up rows, out_proj and proj_2
        all-summed. mlx-lm's OpenELM has the same names, so both use one function."""
        sharding.shard_layers(self.layers, group or mx.distributed.init(), ARCH)

    @property
    def layers(self):
        return self.transformer.layers

    def make_cache(self) -> List[Any]:
        return [KVCache() for _ in self.layers]
