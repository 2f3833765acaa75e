"""FlashNorm Gemma 4 (`gemma4_text`): mlx-lm's class with folded norm gains.

What differs from Gemma 3 (docs/design.md section 2m), each read from mlx-lm:
- gains are plain w (nn.RMSNorm), not 1 + w;
- q, k and v are all renormalized per head after the input norm (q_norm,
  k_norm, and v_norm without a gain): the input norm's gain folds into q|k|v
  and its deferred 1/RMS cancels in all three (section 2d), v's norm run on
  the epilogue's v' = s v with the same epsilon; the attention scale is 1;
- the pre-FFN norm folds and defers as in Llama; the post-norms stay in
  `kernels.post_residual` as in Gemma 3 (no 1 + w, no float16 clip in stock);
- a per-layer scalar on each block's output (`layer_scalar`), applied after
  the second residual, the next norm's statistics taken after it;
- sliding layers (head_dim, default RoPE) and global ones (global_head_dim,
  proportional partial RoPE through `kernels.rope_angles`), as layer_types say;
- embeddings times sqrt(hidden) unrounded, a softcapped head;
- K = V global layers (`attention_k_eq_v`): q|k in one matmul, v' = s k_raw
  renormalized without a gain (section 2m);
- KV-shared layers (`num_kv_shared_layers`): q only, attending over the keys
  and values an earlier layer of their kind fetched from its cache;
- per-layer inputs (`hidden_size_per_layer_input`): stock's model-level
  embedding and projection as they are; in each layer the gate reads the raw
  residual (no norm: nothing folds), `geglu` times the layer's input, the
  projection, its post-norm in `kernels.post_residual`.
Not folded yet (`uncovered`): the MoE block.
"""

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..errors import UnsupportedModel
from . import gemma3
from .arch import NormPair
from .blocks import FusedAttention
from .decoder import MLP, Decoder, DecoderBlock, DecoderModel
from .gains import Gain, QKNorm, QKNormGains


def _args(config) -> gemma4_text.ModelArgs:
    """A config dict (or args) with stock's defaults filled in (layer_types
    from the pattern, 20 KV-shared layers where the config says nothing)."""
    if isinstance(config, gemma4_text.ModelArgs):
        return config
    return gemma4_text.ModelArgs.from_dict(config)


def first_shared(config) -> int:
    """The first KV-shared layer (stock's `num_hidden_layers -
    num_kv_shared_layers`); the layer count where none is."""
    a = _args(config)
    return a.num_hidden_layers - a.num_kv_shared_layers


def has_kv(config, i: int) -> bool:
    return i < first_shared(config)


def k_eq_v(config, i: int) -> bool:
    """A global layer whose values are its keys' raw projection (stock's
    `use_k_eq_v`): no v_proj."""
    a = _args(config)
    return bool(a.attention_k_eq_v) and a.layer_types[i] == "full_attention"


def kv_source(config, j: int) -> int:
    """The layer whose keys and values layer j reads: itself, or for a
    KV-shared layer the last layer before them of its kind (stock's
    `previous_kvs`)."""
    if has_kv(config, j):
        return j
    kinds = _args(config).layer_types
    return max(i for i in range(first_shared(config)) if kinds[i] == kinds[j])


def _pairs(config: dict, i: int):
    """Layer i's pairs: what its input norm feeds (q|k|v; q|k where K = V; q
    alone where KV-shared), then the FFN's."""
    qkv, ffn = gemma3.ARCH.pairs
    parts = qkv.parts if has_kv(config, i) else qkv.parts[:1]
    if has_kv(config, i) and k_eq_v(config, i):
        parts = qkv.parts[:2]
    return (dataclasses.replace(qkv, parts=parts), ffn)


def _more_post_norms(config) -> dict:
    """The per-layer inputs' norms on a linear's output (nonorm's constants go
    into its rows): the model's projection norm (per layer's P rows) and each
    layer's norm after its per-layer projection."""
    if not _args(config).hidden_size_per_layer_input:
        return {}
    out = {"model.per_layer_projection_norm": "model.per_layer_model_projection"}
    for p in ARCH.layer_prefixes(config):
        out[f"{p}.post_per_layer_input_norm"] = f"{p}.per_layer_projection"
    return out


# Gemma 3's names, norms and sandwich post-norms, with plain gains (no 1 + w),
# each layer's input norm feeding what its attention has (`_pairs`).
ARCH = dataclasses.replace(
    gemma3.ARCH,
    gain_offset=0.0,
    gguf=None,
    cannot=(("gguf", "llama.cpp's gemma4 files are not read yet"),),
    pairs_of=_pairs,
    more_post_norms=_more_post_norms,
)

# Weights stock's sanitize drops (quantization-aware training's clip ranges).
_DROPPED = (
    "self_attn.rotary_emb",
    "input_max",
    "input_min",
    "output_max",
    "output_min",
)


def uncovered(config: dict) -> Optional[str]:
    """What of this Gemma 4 FlashNorm does not fold yet (docs/design.md section
    2m), None where it folds all: such a config runs as stock, with a note
    (`models.is_covered`), as every family FlashNorm does not cover."""
    get = config.get
    why = [
        (get("enable_moe_block", False), "the MoE block"),
    ]
    found = [what for on, what in why if on]
    return f"gemma4_text with {', '.join(found)}" if found else None


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as stock's sanitize keeps them (lazily); idempotent: a
    KV-shared layer's k_proj, v_proj and k_norm dropped, as stock drops them."""
    first = first_shared(config)

    def kept(k: str) -> bool:
        if any(d in k for d in _DROPPED):
            return False
        if not any(f".self_attn.{n}." in k for n in ("k_proj", "v_proj", "k_norm")):
            return True
        i = k.split("layers.")[1].split(".")[0] if "layers." in k else ""
        return not (i.isdigit() and int(i) >= first)

    return {k: v for k, v in weights.items() if kept(k)}


@dataclass
class ModelArgs(gemma4_text.ModelArgs):
    def __post_init__(self):
        super().__post_init__()
        self.layer_types = list(self.layer_types)
        why = uncovered(vars(self))
        if why:  # `models.run_mode` never builds ours on one; a caller that does
            raise UnsupportedModel(f"{why} is not folded yet")


def is_sliding(args: ModelArgs, i: int) -> bool:
    return args.layer_types[i] == "sliding_attention"


class Attention(FusedAttention):
    """q|k|v in one matmul, one `qkv_epilogue` pass in QK-norm form, then v's
    norm without a gain (s cancels there too: section 2m). A K = V layer
    holds q|k (its v is k's raw projection); a KV-shared layer q alone, and
    attends over its source layer's fetched keys and values."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        sliding = is_sliding(args, layer_idx)
        h = args.head_dim if sliding or not args.global_head_dim else None
        self.head_dim = h = h or args.global_head_dim
        self.n_heads = args.num_attention_heads
        self.has_kv, self.k_eq_v = has_kv(args, layer_idx), k_eq_v(args, layer_idx)
        kv = args.num_key_value_heads
        if self.k_eq_v and args.num_global_key_value_heads is not None:
            kv = args.num_global_key_value_heads
        self.n_kv_heads = kv
        self.eps = args.rms_norm_eps
        rows = self.n_heads + (kv * (1 if self.k_eq_v else 2) if self.has_kv else 0)
        self.qkv_proj = nn.Linear(args.hidden_size, rows * h, bias=False)
        self.o_proj = nn.Linear(self.n_heads * h, args.hidden_size, bias=False)
        self.q_norm = QKNorm(h)
        if self.has_kv:
            self.k_norm = QKNorm(h)
        key = "sliding_attention" if sliding else "full_attention"
        params = args.rope_parameters.get(key, {})
        self.rope = initialize_rope(  # stock's very call
            dims=h,
            traditional=args.rope_traditional,
            base=params.get("rope_theta", 10000.0),
            scaling_config=params,
            max_position_embeddings=args.max_position_embeddings,
        )
        self._angles = kernels.rope_angles(self.rope, h)
        self._qk_gains = QKNormGains(1.0, self.eps)  # stock's attention scale: 1
        self.shares = False  # later KV-shared layers read this one's keys (the model)

    def epilogue_args(self) -> kernels.Epilogue:
        gains = self._qk_gains(self.q_norm.weight, self.k_norm.weight)
        heads = (self.n_heads, self.n_kv_heads)
        return kernels.Epilogue(*heads, self._angles, self.rope, **gains)

    def heads(self, xs, ms, offset):
        y = self.qkv_proj(xs)
        if not self.has_kv:
            return self.query(y, ms, offset), None, None
        if self.k_eq_v:  # v is k's raw projection: k's columns again as v's heads
            y = mx.concatenate([y, y[..., self.n_heads * self.head_dim :]], axis=-1)
        q, k, v = kernels.qkv_epilogue(y, ms, offset, self.epilogue())
        # v' = s v: rms_norm(s v, eps) is stock's v_norm of its v (section 2m).
        return q, k, mx.fast.rms_norm(v, None, self.eps)

    def query(self, y, ms, offset):
        """A KV-shared layer's q': stock's q_norm and RoPE of s y (its q_proj of
        the normed row), s applied in one launch; y (B, L, Hq h)."""
        B, L, _ = y.shape
        q = kernels.scaled(y, ms).reshape(B, L, self.n_heads, self.head_dim)
        q = mx.fast.rms_norm(q, self.q_norm.weight, self.eps)
        return self.rope(q.transpose(0, 2, 1, 3), offset=offset)

    def __call__(self, xs, ms, mask=None, cache=None, shared=None):
        """shared: (keys, values, cache, offset) a KV-shared layer reads from
        its source layer, as that layer fetched them this step."""
        if shared is None:
            return super().__call__(xs, ms, mask, cache)
        keys, values, source_cache, offset = shared
        q = self.heads(xs, ms, offset)[0]
        # The source's cache routes attention (the compiled step's, quantized).
        o = kernels.scaled_dot_product_attention(
            q, keys, values, source_cache, 1.0, mask
        )
        return self.project_out(o)

    def attend(self, q, k, v, mask, cache):
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.shares:  # read by the KV-shared layers later in this step
            self.__dict__["_fetched"] = (k, v)
        return kernels.scaled_dot_product_attention(q, k, v, cache, 1.0, mask)


class TransformerBlock(DecoderBlock):
    ARCH = ARCH

    def __init__(self, args, *a, **kw):
        super().__init__(args, *a, **kw)
        self.layer_scalar = mx.ones((1,))
        if args.hidden_size_per_layer_input:  # stock's names
            D, P = args.hidden_size, args.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(D, P, bias=False)
            self.per_layer_projection = nn.Linear(P, D, bias=False)
            self.post_per_layer_input_norm = Gain(D)

    def __call__(self, x, ms, xs, mask, cache, out_gain, final: bool, **extra):
        """extra: `shared` (a KV-shared layer's keys and values), and
        `per_layer_input` (B, L, P), where the layer has them."""
        a = self.self_attn(xs, ms, mask, cache, extra.get("shared"))
        return self.close(x, a, out_gain, final, extra.get("per_layer_input"))

    def close(self, x, a, out_gain, final: bool, per_layer_input=None):
        # Post-norm, residual, pre-FFN statistics; FFN; post-norm, residual;
        # the per-layer input; the layer scalar, then the next norm's
        # statistics of the scaled row.
        h, ms_h, hs = kernels.post_residual(
            x, a, None, self.post_gain(0), self.eps, self.gain(1)
        )
        y, ms_y = self[self.FEED_FORWARD](hs, ms_h)
        out = kernels.post_residual(h, y, ms_y, self.post_gain(1), self.eps)[0]
        if per_layer_input is not None:
            # The gate reads the raw residual (no norm before it: nothing to
            # fold); its output's norm is a post-norm (section 2m).
            g = self.per_layer_input_gate(out)
            y = self.per_layer_projection(gemma4_text.geglu(g, per_layer_input))
            post = self.post_per_layer_input_norm.gain()
            out = kernels.post_residual(out, y, None, post, self.eps)[0]
        out = out * self.layer_scalar
        if final:
            return kernels.residual_norm(out, None, None, self.eps, out_gain)
        return kernels.residual(out, None, None, self.eps, out_gain)


class EagerBlock(TransformerBlock):
    """A layer called with more than the block hand-off (a per-layer input,
    a source layer's keys): the engine never compiles its parts apart."""

    PARTS = False


class GemmaModel(DecoderModel):
    """Stock's per-layer input embedding and projection (its modules, names
    and methods) and KV sharing around the FlashNorm blocks."""

    ROUND_EMBED_SCALE = False  # stock: h * hidden_size**0.5, a Python float

    def __init__(self, args, arch, layers, norm_gains):
        super().__init__(args, arch, layers, norm_gains)
        self.config = args  # stock's methods below read it
        P = self.hidden_size_per_layer_input = args.hidden_size_per_layer_input
        if P:
            N, D = args.num_hidden_layers, args.hidden_size
            V = args.vocab_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(V, N * P)
            self.embed_tokens_per_layer_scale = P**0.5
            self.per_layer_input_scale = 2.0**-0.5
            self.per_layer_projection_scale = D**-0.5
            self.per_layer_model_projection = nn.Linear(D, N * P, bias=False)
            # Followed by an add (the embedding's share), not a linear: stock's.
            self.per_layer_projection_norm = nn.RMSNorm(P, eps=args.rms_norm_eps)
        self.sources = [kv_source(args, j) for j in range(len(layers))]
        for j, i in enumerate(self.sources):
            if i != j:
                layers[i].self_attn.shares = True

    def __call__(self, inputs, cache=None, input_embeddings=None):
        n, eps = len(self.layers), self.args.rms_norm_eps
        cache = list(cache or [])
        cache += [None] * (n - len(cache))  # KV-shared layers have none
        raw = input_embeddings
        if raw is None:
            raw = self.embed_tokens(inputs)
        h = self.embed(None, raw)
        extra = [{} for _ in range(n)]
        if self.hidden_size_per_layer_input:
            stock = gemma4_text.Gemma4TextModel
            per_layer = stock._get_per_layer_inputs(self, inputs, raw)
            per_layer = stock._project_per_layer_inputs(self, h, per_layer)
            for i in range(n):
                extra[i]["per_layer_input"] = per_layer[:, :, i, :]
        masks = self.masks(h, cache)
        final_gain = self.final_gain()
        _, ms, xs = kernels.residual(h, None, None, eps, self.layers[0].gain(0))
        fetched = {}  # a source layer's keys and values, for the shared layers
        for i, layer in enumerate(self.layers):
            if self.sources[i] != i:
                extra[i]["shared"] = fetched[self.sources[i]]
            c = cache[i]
            offset = c.offset if c is not None else 0  # before this step's update
            last = i == n - 1
            out_gain = final_gain if last else self.layers[i + 1].gain(0)
            out = layer(h, ms, xs, masks[i], c, out_gain, last, **extra[i])
            if layer.self_attn.shares:
                k, v = layer.self_attn.__dict__.pop("_fetched")
                fetched[i] = (k, v, c, offset)
            if not last:
                h, ms, xs = out
        return out


class Model(Decoder):
    Block = TransformerBlock
    Inner = GemmaModel

    def attention(self, args: ModelArgs, i: int) -> Attention:
        return Attention(args, i)

    def feed_forward(self, args: ModelArgs, i: int) -> MLP:
        # Stock's KV-shared layers' MLP is twice as wide (use_double_wide_mlp).
        if args.use_double_wide_mlp and i >= first_shared(args) > 0:
            w = 2 * args.intermediate_size
            args = SimpleNamespace(hidden_size=args.hidden_size, intermediate_size=w)
        return MLP(args, ARCH.activation)

    def block(self, args: ModelArgs, i: int) -> type:
        extra = args.hidden_size_per_layer_input or not has_kv(args, i)
        return EagerBlock if extra else TransformerBlock

    def is_sliding(self, args: ModelArgs, i: int) -> bool:
        return is_sliding(args, i)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        out = super().__call__(inputs, cache, input_embeddings)
        cap = self.args.final_logit_softcapping
        return out if cap is None else gemma4_text.logit_softcap(cap, out)

    def sanitize(self, weights):
        return super().sanitize(canonical(vars(self.args), weights))

    def make_cache(self):
        # Stock's: none for the KV-shared layers.
        return super().make_cache()[: first_shared(self.args)]
