"""What fold, nonorm, loading, convert and GGUF need to know about an architecture.

Each model file (`models/<model_type>.py`) holds one `Architecture` as `ARCH`
beside its model classes; `models.architecture(config)` finds it. Names are
Hugging Face weight names (as mlx-lm's `sanitize` leaves them), relative to a
layer's prefix where they are per layer.
"""

from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple


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


@dataclass(frozen=True)
class Architecture:
    layers_key: str  # config key: number of layers
    layer: str  # weight prefix of layer i, "{i}" formatted
    pairs: Tuple[NormPair, ...]  # per layer, in order
    final_norm: str
    embed: str
    head: str
    tie_key: str  # config key: is the head the embedding (default True)
    width_key: str  # config key: width of the residual stream
    # Per-head norms on q and k inside attention (QK-norm), relative to a layer.
    qk_norms: Tuple[str, ...] = ()

    def n_layers(self, config: dict) -> int:
        return config[self.layers_key]

    def is_tied(self, config: dict) -> bool:
        return bool(config.get(self.tie_key, True))

    def layer_prefixes(self, config: dict) -> Iterator[str]:
        for i in range(self.n_layers(config)):
            yield self.layer.format(i=i)

    def norm_pairs(self, config: dict, weights: Dict) -> List[Tuple[str, List[str]]]:
        """(norm, [linears it feeds]) for every foldable norm, final one included
        when the head is untied; the fused or split names, as `weights` has them."""
        out = []
        for p in self.layer_prefixes(config):
            for pair in self.pairs:
                if f"{p}.{pair.fused}.weight" in weights:
                    linears = [f"{p}.{pair.fused}"]
                else:
                    linears = [f"{p}.{part}" for part in pair.parts]
                out.append((f"{p}.{pair.norm}", linears))
        if not self.is_tied(config):
            out.append((self.final_norm, [self.head]))
        return out
