"""What fold, nonorm, loading, convert and GGUF need to know about an architecture.

Each model file (`models/<model_type>.py`) holds one `Architecture` as `ARCH`
beside its model classes; `models.architecture(config)` finds it. Names are
Hugging Face weight names (as mlx-lm's `sanitize` leaves them), relative to a
layer's prefix where they are per layer.

Beyond the Llama shape (docs/design.md section 2h), an architecture states:
- `gain_offset`: a norm's gain is `gain_offset + weight` (Gemma stores w of
  1 + w); fold, nonorm, GPTQ and the kernels read gains through `gain`, and
  `unit_weight` is the weight of a gain of 1 (what `--compat` writes);
- `activation`: the GLU's gate activation, "silu" or "gelu_tanh";
- `post_norms`: norms on a sublayer's output before the residual add, which
  cannot fold (nonorm folds its constant into the rows of the linear before);
- `embed_scale`: the embeddings are scaled by sqrt(width) before the blocks;
- `moe`: a mixture-of-experts feed-forward (`MoE`) in the layers that have one:
  its router and stacked experts, which the norm feeds in place of the dense
  pair's gate and up (docs/design.md section 2j).
- `gguf`: how llama.cpp's GGUF files of the family are read (`Gguf`), None
  where it has none (the MoE's tensor names are on `MoE.gguf`);
- `cannot`: what the family does not do (a mode such as "nonorm", or
  "gguf"), each with why; `require` turns asking for it into one line;
- `mixers` and `layer_kind`: a hybrid family's token mixers (attention, gated
  attention, gated DeltaNet, short convolution), each with the pair its norm
  feeds and the gated norm that closes it, and which one layer i holds;
  `layer_pairs(config, i)` is that layer's pairs (docs/design.md section 2k);
  a family of one-sublayer blocks (Nemotron-H, section 2p) has one pair, each
  block kind a mixer fed by the block's norm;
- `pairs_of`: layer i's pairs where layers of one family differ in what their
  norms feed (Gemma 4's K = V and KV-shared attention, its MoE layers);
  `more_post_norms`: post-norms a config adds (Gemma 4's per-layer inputs).
- `uncast`: tensors kept float32 whatever the dtype, as stock's
  `cast_predicate` keeps them (GLM's correction bias, section 2o);
- `layer_count`: the layers where a config may leave the count out, and
  `shard_layers`: a family's own split of mlx-lm's layers over ranks;
- `gain_on_rows`: linears applied untransposed, whose rows take a gain.
The block and sublayer names (`norms`, `attention`, `feed_forward`) come from
`pairs`, so the shared decoder (models/decoder.py) and sharding read them here.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import mlx.core as mx

from ..errors import UnsupportedModel

ACTIVATIONS = ("silu", "gelu_tanh")
MIXER_KINDS = (
    "attention",
    "gated_attention",
    "gated_deltanet",
    "short_conv",
    # Nemotron-H: one sublayer a block, each fed by the block's one norm.
    "mamba2",
    "relu2_mlp",
    "moe",
)


@dataclass(frozen=True)
class NormPair:
    """One RMSNorm and the linear layers it feeds, within a layer.

    `fused` is the single linear our model stacks `parts` into (q|k|v, gate|up);
    a checkpoint may hold either form (a folded one written by `convert` keeps
    the parts; OpenELM's checkpoints are fused already: parts == (fused,)).
    """

    norm: str
    fused: str
    parts: Tuple[str, ...]
    # The fused linear's rows are the parts' in order (a build may then share
    # them with the source); False where they are permuted (Qwen3-Next's).
    in_order: bool = True

    @property
    def fused_bias(self) -> str:
        """Where our model keeps the parts' stacked biases (qkv_proj: qkv_bias)."""
        return self.fused.removesuffix("_proj") + "_bias"


@dataclass(frozen=True)
class PostNorm:
    """A norm on a sublayer's output, before the residual add (Gemma's sandwich
    norms), and the linear whose output it normalizes (within a layer)."""

    norm: str
    after: str


@dataclass(frozen=True)
class GatedNorm:
    """A norm inside a mixer, y = rms_norm(h) * g * act(z) per head, and the
    linear it feeds (Qwen3.5's RMSNormGated before out_proj): g folds into
    `out`'s input columns, tiled over the heads; the per-head 1/RMS stays
    (docs/design.md section 2k). `width_key`: the config key of its width
    (a tuple: keys whose product it is), `heads_key` of its head count (the
    tiling; None: the gain spans out's whole input, as Mamba's grouped norm)."""

    norm: str
    out: str
    width_key: Union[str, Tuple[str, ...]]
    heads_key: Optional[str]

    def width(self, config: dict) -> int:
        keys = (self.width_key,) if isinstance(self.width_key, str) else self.width_key
        return math.prod(config[k] for k in keys)

    def tiles(self, config: dict) -> int:
        return config[self.heads_key] if self.heads_key else 1


@dataclass(frozen=True)
class Mixer:
    """One kind of token mixer a hybrid family's layer may hold: `kind` (one
    of MIXER_KINDS), the norm pair that feeds it, a gated norm closing it."""

    kind: str
    pair: NormPair
    gated_norm: Optional[GatedNorm] = None

    def __post_init__(self):
        if self.kind not in MIXER_KINDS:
            raise ValueError(f"mixer kind {self.kind!r} not in {MIXER_KINDS}")

    @property
    def module(self) -> str:
        """The mixer's module within a layer (e.g. "linear_attn")."""
        return self.pair.fused.split(".")[0]


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts feed-forward, names relative to a layer: one router
    (a linear, width -> experts) and the experts stacked expert-major, each a
    3-D (experts, out, in) weight as mlx-lm's `sanitize` leaves them (its
    SwitchLinear's), read by `norm` like the dense pair it replaces.

    Sharding, nonorm, stock_fused, quantization and GGUF read it from here."""

    norm: str  # the norm that feeds router and experts
    router: str  # e.g. "mlp.gate"
    experts: str  # the stacked experts' module, e.g. "mlp.switch_mlp"
    fed: Tuple[str, ...] = ("gate_proj", "up_proj")  # the experts' norm-fed linears
    down: str = "down_proj"
    fused: str = "gate_up_proj"  # our stacked gate|up (rows: axis -2)
    per_expert: str = "mlp.experts.{e}"  # Hugging Face's one module per expert
    # Hugging Face's names of an expert's gate, up and down (Mixtral: w1, w3, w2).
    per_expert_names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    count_key: str = "num_experts"  # config key: number of experts
    # mlx-lm's quant_predicate for the router (qwen3_moe: 8 bits, groups of 64).
    router_quant: Optional[Tuple[int, int]] = None  # (bits, group_size)
    # mlx-lm's router is no Linear (GLM's MoEGate, Nemotron-H's bare weight):
    # its -q leaves it float.
    router_float: bool = False
    # llama.cpp's names of the router and the stacked experts' fed and down
    # linears, in that order ((E, out, in) as ours); () where no GGUF has them.
    gguf: Tuple[str, ...] = ()
    # A shared expert beside the routed ones (Qwen3-Next, Qwen3.5): its
    # norm-fed linears (gate, up), our stacked gate|up of them, and the linear
    # of its sigmoid gate (quantized as the router is).
    shared: Tuple[str, ...] = ()
    shared_fused: Optional[str] = None
    shared_gate: Optional[str] = None

    def gguf_names(self) -> Dict[str, str]:
        """llama.cpp's layer tensor name -> our module, for the MoE's linears."""
        ours = [f"{self.experts}.{lin}" for lin in (*self.fed, self.down)]
        return dict(zip(self.gguf, [self.router, *ours]))

    def linears(self, prefix: str, weights: Dict) -> List[str]:
        """The router and the experts' norm-fed linears of one layer, as
        `weights` name them (fused or split); [] where the layer is dense."""
        if f"{prefix}.{self.router}.weight" not in weights:
            return []
        fused = f"{prefix}.{self.experts}.{self.fused}"
        if f"{fused}.weight" in weights:
            out = [f"{prefix}.{self.router}", fused]
        else:
            parts = [f"{prefix}.{self.experts}.{f}" for f in self.fed]
            out = [f"{prefix}.{self.router}"] + parts
        shared = (self.shared_fused,) if self.shared_fused else ()
        if not shared or f"{prefix}.{shared[0]}.weight" not in weights:
            shared = self.shared
        shared += (self.shared_gate,) if self.shared_gate else ()
        return out + [f"{prefix}.{s}" for s in shared]

    def stack(self, config: dict, weights: Dict) -> Dict:
        """Hugging Face's per-expert weights (`per_expert`) stacked into the
        3-D ones mlx-lm's `sanitize` makes (lazily: nothing is computed)."""
        n = config.get(self.count_key, 0)
        first = self.per_expert.format(e=0)
        if not n or not any(f".{first}." in k for k in weights):
            return weights
        out, done = dict(weights), set()
        for k in weights:
            head, sep, _ = k.partition(f".{first}.")
            if not sep or head in done:
                continue
            done.add(head)
            for hf, lin in zip(self.per_expert_names, (*self.fed, self.down)):
                for suffix in ("weight", "scales", "biases", "bias"):
                    keys = [
                        f"{head}.{self.per_expert.format(e=e)}.{hf}.{suffix}"
                        for e in range(n)
                    ]
                    if keys[0] in out:
                        stacked = mx.stack([out.pop(key) for key in keys])
                        out[f"{head}.{self.experts}.{lin}.{suffix}"] = stacked
        return out


@dataclass(frozen=True)
class Gguf:
    """How loading/gguf.py reads a family's llama.cpp files: `arch` is their
    general.architecture, `hf` the Hugging Face architectures entry; `names`
    the layer tensors (GGUF name -> our module) the family adds to, or renames
    in, llama.cpp's Llama names; `biases` the modules whose bias every layer
    has; `permuted`: llama.cpp permuted Q/K rows for interleaved RoPE (Llama).
    A family whose files need more than that is read whole by `reader`, a
    module of flashnorm_mlx.loading (its `read`), and `also` names more
    llama.cpp architectures that module reads (Qwen3.5's qwen35moe)."""

    arch: str
    hf: str
    names: Tuple[Tuple[str, str], ...] = ()
    biases: Tuple[str, ...] = ()
    permuted: bool = False
    reader: str = ""
    also: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Architecture:
    layers_key: str  # config key: number of layers
    layer: str  # weight prefix of layer i, "{i}" formatted
    pairs: Tuple[NormPair, ...]  # per layer, in order
    final_norm: str
    embed: str
    head: str
    tie_key: str  # config key: is the head the embedding (default: tie_default)
    width_key: str  # config key: width of the residual stream
    # Per-head norms on q and k inside attention (QK-norm), relative to a layer.
    qk_norms: Tuple[str, ...] = ()
    gain_offset: float = 0.0  # gain = gain_offset + weight (Gemma: 1)
    activation: str = "silu"  # the GLU's gate activation, one of ACTIVATIONS
    post_norms: Tuple[PostNorm, ...] = ()  # per layer, unfoldable
    embed_scale: bool = False  # embeddings times sqrt(width) (Gemma)
    tie_default: bool = True  # a config without tie_key (stock's default)
    # (what, why) the family cannot do: a mode ("nonorm", ...) or "gguf".
    cannot: Tuple[Tuple[str, str], ...] = ()
    moe: Optional[MoE] = None  # a mixture-of-experts feed-forward, where any
    gguf: Optional[Gguf] = None  # llama.cpp's files, where they are read
    # Hybrid families: every mixer a layer may hold (pairs[0] is the first's
    # pair), and the kind of layer i from the config.
    mixers: Tuple[Mixer, ...] = ()
    layer_kind: Optional[Callable[[dict, int], str]] = None
    # Layer i's pairs from the config, where they differ by layer (Gemma 4).
    pairs_of: Optional[Callable[[dict, int], Tuple[NormPair, ...]]] = None
    # Post-norms a config adds to `post_norms` ({norm: the linear before}, full
    # paths: Gemma 4's per-layer inputs), for nonorm's constants.
    more_post_norms: Optional[Callable[[dict], Dict[str, str]]] = None
    # Name endings of tensors stock never casts to the run's dtype (its
    # `cast_predicate`; GLM's correction bias: picks at float32's resolution).
    uncast: Tuple[str, ...] = ()
    # The number of layers where a config may omit `layers_key` (Nemotron-H's,
    # which transformers derives from its block list).
    layer_count: Optional[Callable[[dict], int]] = None
    # A family's own split of mlx-lm's layers (stock, nonorm) over ranks,
    # (layers, group, arch), where `sharding.shard_layers` does not know them.
    shard_layers: Optional[Callable] = None
    # Linears (relative to a layer) that read a norm's output as x @ W, not
    # x @ W^T (mlx-lm's MLA embed_q): the gain scales their rows (axis -2).
    gain_on_rows: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} not in {ACTIVATIONS}")

    @property
    def norms(self) -> Tuple[str, ...]:
        """The foldable norms of a layer, in order (attention's, the FFN's)."""
        return tuple(p.norm for p in self.pairs)

    def mixer(self, config: dict, i: int) -> Mixer:
        """The mixer of layer i: one of `mixers` by `layer_kind`, else attention
        on the first pair."""
        if not self.mixers:
            return Mixer("attention", self.pairs[0])
        kind = self.layer_kind(config, i)
        return next(m for m in self.mixers if m.kind == kind)

    def layer_pairs(self, config: dict, i: int) -> Tuple[NormPair, ...]:
        """Layer i's pairs: its mixer's, then the feed-forward's."""
        if self.pairs_of is not None:
            return self.pairs_of(config, i)
        if not self.mixers:
            return self.pairs
        return (self.mixer(config, i).pair, *self.pairs[1:])

    def gated_norms(self, config: dict) -> Dict[str, Tuple[str, GatedNorm]]:
        """{gated norm: (the linear it feeds, its GatedNorm)}, every layer's
        (docs/design.md section 2k)."""
        out = {}
        for i, p in enumerate(self.layer_prefixes(config)):
            g = self.mixer(config, i).gated_norm if self.mixers else None
            if g is not None:
                out[f"{p}.{g.norm}"] = (f"{p}.{g.out}", g)
        return out

    def norm_width(self, config: dict, norm: str) -> int:
        """A foldable norm's width: the residual's, a gated norm's own."""
        gated = self.gated_norms(config).get(norm)
        return gated[1].width(config) if gated else config[self.width_key]

    def folded_gain(self, config: dict, norm: str, weight: mx.array) -> mx.array:
        """What `norm` multiplies its linears' input columns by: its `gain`,
        a gated norm's repeated once per head (its linear reads every head)."""
        gain = self.gain(weight)
        gated = self.gated_norms(config).get(norm)
        return mx.tile(gain, (gated[1].tiles(config),)) if gated else gain

    @property
    def attention(self) -> str:
        """A layer's attention module (the first pair's linear lives in it)."""
        return self.pairs[0].fused.split(".")[0]

    @property
    def feed_forward(self) -> str:
        return self.pairs[-1].fused.split(".")[0]

    def require(self, what: str, model_type: str) -> None:
        """UnsupportedModel (one line) where the family declares it cannot `what`."""
        why = dict(self.cannot).get(what)
        if why is not None:
            raise UnsupportedModel(f"{model_type} has no {what}: {why}")

    def gain(self, weight: mx.array) -> mx.array:
        """The gain a norm applies, from its stored weight, in the weight's
        dtype as mlx-lm computes it (Gemma's RMSNorm: 1.0 + weight)."""
        return self.gain_offset + weight if self.gain_offset else weight

    def unit_weight(self, like: mx.array) -> mx.array:
        """The stored weight of a gain of 1, shaped and typed as `like`."""
        return mx.full(like.shape, 1.0 - self.gain_offset, like.dtype)

    def embedding_scale(self, config: dict) -> float:
        return config[self.width_key] ** 0.5 if self.embed_scale else 1.0

    def n_layers(self, config: dict) -> int:
        if self.layer_count is not None:
            return self.layer_count(config)
        return config[self.layers_key]

    def is_tied(self, config: dict) -> bool:
        return bool(config.get(self.tie_key, self.tie_default))

    def layer_prefixes(self, config: dict) -> Iterator[str]:
        for i in range(self.n_layers(config)):
            yield self.layer.format(i=i)

    def post_norm_paths(self, config: dict) -> Dict[str, str]:
        """{post-norm: the linear whose output it normalizes}, every layer's."""
        out = {
            f"{p}.{post.norm}": f"{p}.{post.after}"
            for p in self.layer_prefixes(config)
            for post in self.post_norms
        }
        return {**out, **(self.more_post_norms(config) if self.more_post_norms else {})}

    def norm_pairs(self, config: dict, weights: Dict) -> List[Tuple[str, List[str]]]:
        """(norm, [linears it feeds]) for every foldable norm, final one included
        when the head is untied; the fused or split names, as `weights` has them."""
        out = []
        for i, p in enumerate(self.layer_prefixes(config)):
            experts = self.moe.linears(p, weights) if self.moe else []
            for pair in self.layer_pairs(config, i):
                if experts and pair.norm == self.moe.norm:  # this layer's MoE
                    linears = experts
                elif f"{p}.{pair.fused}.weight" in weights:
                    linears = [f"{p}.{pair.fused}"]
                else:
                    linears = [f"{p}.{part}" for part in pair.parts]
                out.append((f"{p}.{pair.norm}", linears))
        # A gated norm's gain folds into the linear after it (tiled per head).
        out += [(norm, [lin]) for norm, (lin, _) in self.gated_norms(config).items()]
        if not self.is_tied(config):
            out.append((self.final_norm, [self.head]))
        return out
