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
  projection, its post-norm in `kernels.post_residual`;
- the MoE block beside the dense MLP: its router's norm and the experts'
  pre-norm read the same residual as the pre-FFN norm, so the block's s
  serves all three; the router's gain (scale * hidden**-0.5) folds into its
  projection at load, the experts' into their gate|up; s scales the k picked
  logits before their softmax; both outputs owe s, their post-norms cancel it.
Nothing is left stock.
"""

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text
from mlx_lm.models.rope_utils import initialize_rope

from .. import fold, kernels
from ..kernels._common import pow2_prescale, prescaled
from ..mlx_lm_compat import gemma4_per_layer_inputs
from . import gemma3
from .arch import MoE, NormPair
from .blocks import FusedAttention
from .decoder import MLP, Decoder, DecoderBlock, DecoderModel
from .gains import Gain, QKNorm, QKNormGains
from .moe import SwitchGLU, fuse_experts


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


# The MoE block's experts, fed by their own norm of the same residual as the
# dense MLP's (section 2m): its gain folds into the stacked gate and up (3-D,
# along the input axis); our gate|up stacks them per expert (`fuse_experts`).
EXPERTS = MoE(
    norm="pre_feedforward_layernorm_2",
    router="router.proj",
    experts="experts.switch_glu",
)
EXPERTS_PAIR = NormPair(
    EXPERTS.norm,
    f"{EXPERTS.experts}.{EXPERTS.fused}",
    tuple(f"{EXPERTS.experts}.{f}" for f in EXPERTS.fed),
)


def _pairs(config: dict, i: int):
    """Layer i's pairs: what its input norm feeds (q|k|v; q|k where K = V; q
    alone where KV-shared), then the FFN's."""
    qkv, ffn = gemma3.ARCH.pairs
    parts = qkv.parts if has_kv(config, i) else qkv.parts[:1]
    if has_kv(config, i) and k_eq_v(config, i):
        parts = qkv.parts[:2]
    pairs = (dataclasses.replace(qkv, parts=parts), ffn)
    return pairs + ((EXPERTS_PAIR,) if _args(config).enable_moe_block else ())


def _more_post_norms(config) -> dict:
    """Norms on a linear's output beyond the sandwich ones (nonorm's constants
    go into its rows): the per-layer inputs' (the model's projection norm, per
    layer's P rows; each layer's after its per-layer projection) and the MoE
    block's on the dense MLP's and the experts' outputs."""
    args, out = _args(config), {}
    if args.hidden_size_per_layer_input:
        out["model.per_layer_projection_norm"] = "model.per_layer_model_projection"
    for p in ARCH.layer_prefixes(config):
        if args.hidden_size_per_layer_input:
            out[f"{p}.post_per_layer_input_norm"] = f"{p}.per_layer_projection"
        if args.enable_moe_block:
            out[f"{p}.post_feedforward_layernorm_1"] = f"{p}.mlp.down_proj"
            down = f"{p}.{EXPERTS.experts}.{EXPERTS.down}"
            out[f"{p}.post_feedforward_layernorm_2"] = down
    return out


# Gemma 3's names, norms and sandwich post-norms, with plain gains (no 1 + w),
# each layer's input norm feeding what its attention has (`_pairs`).
ARCH = dataclasses.replace(
    gemma3.ARCH,
    gain_offset=0.0,
    # llama.cpp's gemma4 files: loading/gguf_gemma4.py reads them whole.
    gguf=dataclasses.replace(
        gemma3.ARCH.gguf,
        arch="gemma4",
        hf="Gemma4ForCausalLM",
        names=(),
        reader="gguf_gemma4",
    ),
    cannot=(),
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


def canonical(config: dict, weights: dict) -> dict:
    """`weights` as stock's sanitize keeps them (lazily); idempotent: a
    KV-shared layer's k_proj, v_proj and k_norm dropped, as stock drops them;
    Hugging Face's experts (`experts.gate_up_proj` (E, 2F, D), `down_proj`)
    as stock's switch_glu gate, up and down."""
    first = first_shared(config)

    def kept(k: str) -> bool:
        if any(d in k for d in _DROPPED):
            return False
        if not any(f".self_attn.{n}." in k for n in ("k_proj", "v_proj", "k_norm")):
            return True
        i = k.split("layers.")[1].split(".")[0] if "layers." in k else ""
        return not (i.isdigit() and int(i) >= first)

    out = {}
    for k, v in weights.items():
        if k.endswith(".experts.gate_up_proj"):
            base = k.removesuffix(".gate_up_proj")
            gate, up = mx.split(v, 2, axis=-2)
            out[f"{base}.switch_glu.gate_proj.weight"] = mx.contiguous(gate)
            out[f"{base}.switch_glu.up_proj.weight"] = mx.contiguous(up)
        elif k.endswith(".experts.down_proj"):
            out[f"{k.removesuffix('.down_proj')}.switch_glu.down_proj.weight"] = v
        elif kept(k):
            out[k] = v
    return out


@dataclass
class ModelArgs(gemma4_text.ModelArgs):
    pass


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
        # k and v row blocks after q's (sharding reads it): q|k where K = V.
        self.kv_row_sets = (1 if self.k_eq_v else 2) if self.has_kv else 0
        rows = self.n_heads + kv * self.kv_row_sets
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


class Router(nn.Module):
    """Stock's router with its norm's gain (scale * hidden**-0.5) folded into
    proj at load (`Model.sanitize`); a proj as stored keeps it as `gain`, for
    the row it reads. Its norm is of the same residual as the pre-FFN norm's,
    with the same epsilon: the block's s serves it (section 2m)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.top_k = args.top_k_experts

    def __call__(self, xs, ms):
        """(indices, weights) (B, L, k): stock's top k of s z (the top k of z,
        s > 0), the softmax of the k picked s z, times per_expert_scale."""
        z = self.proj(xs)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(z, kth=-k, axis=-1)[..., -k:])
        picked = kernels.scaled(mx.take_along_axis(z, inds, axis=-1), ms)
        weights = mx.softmax(picked, axis=-1) * self.per_expert_scale[inds]
        return inds, weights


class Experts(nn.Module):
    """Stock's experts (GELU GLUs, gate|up stacked per expert), the deferred
    GLU of section 2j: the weighted sum owes s."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        D, F, E = args.hidden_size, args.moe_intermediate_size, args.num_experts
        self.switch_glu = SwitchGLU(D, F, E, ARCH.activation)

    def __call__(self, xs, ms, inds, weights):
        y = self.switch_glu(xs, ms, inds)
        return (y * weights[..., None]).sum(axis=-2).astype(y.dtype)


class TransformerBlock(DecoderBlock):
    ARCH = ARCH

    def __init__(self, args, attention, ffn, norm_gains=False, use_sliding=False):
        super().__init__(args, attention, ffn, norm_gains, use_sliding)
        self.layer_scalar = mx.ones((1,))
        self.enable_moe = args.enable_moe_block
        if self.enable_moe:  # stock's names; the pre-FFN norm's of the experts
            D = args.hidden_size  # folded, or kept where the gains are
            self.router, self.experts = Router(args), Experts(args)
            self.post_feedforward_layernorm_1 = Gain(D)
            self.post_feedforward_layernorm_2 = Gain(D)
            if norm_gains:
                self.pre_feedforward_layernorm_2 = Gain(D)
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
        if self.enable_moe:
            y, ms_y = self.mixture(h, ms_h, hs)
        else:
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

    def mixture(self, h, ms, hs):
        """Stock's MoE block: the dense MLP and the experts beside it, each
        output post-normed and the two summed, (y, None). The three norms of h
        (pre-FFN, router, experts') share its s; the two outputs owe it, and
        their post-norms cancel it (section 2m)."""
        y1, _ = self.mlp(hs, ms)
        xr = x2 = hs  # gains folded: every matmul reads the same row
        if "gain" in self.router or "pre_feedforward_layernorm_2" in self:
            x = h * pow2_prescale(ms).astype(h.dtype) if prescaled(h.dtype) else h
            if "gain" in self.router:  # a router as stored
                xr = x * self.router.gain
            if "pre_feedforward_layernorm_2" in self:  # experts as stored
                x2 = x * self.pre_feedforward_layernorm_2.gain()
        inds, weights = self.router(xr, ms)
        y2 = kernels.scaled(self.experts(x2, ms, inds, weights), ms)
        n2 = mx.fast.rms_norm(y2, self.post_feedforward_layernorm_2.gain(), self.eps)
        # n2 + post_norm_1(s y1): one launch.
        post = self.post_feedforward_layernorm_1.gain()
        return kernels.post_residual(n2, y1, ms, post, self.eps)[0], None


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
            per_layer = gemma4_per_layer_inputs(self, inputs, raw, h)
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
    ARCH = ARCH
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
        weights = canonical(vars(self.args), weights)
        if self.args.enable_moe_block:
            root = self.args.hidden_size**-0.5
            for layer, p in zip(self.layers, ARCH.layer_prefixes(vars(self.args))):
                weights = fuse_experts(weights, p, EXPERTS)
                scale = weights.pop(f"{p}.router.scale", None)
                if scale is None:
                    continue
                gain = scale * root  # stock's router norm gain, in scale's dtype
                if f"{p}.router.proj.scales" in weights or self.norm_gains:  # row
                    layer.router.gain = mx.zeros_like(gain)
                    weights[f"{p}.router.gain"] = gain
                else:
                    weights = fold.fold_gain(weights, gain, f"{p}.router.proj")
        return super().sanitize(weights)

    def make_cache(self):
        # Stock's: none for the KV-shared layers.
        return super().make_cache()[: first_shared(self.args)]
