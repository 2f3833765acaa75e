"""Pure weight transforms: fold RMSNorm gains into the linear layers they feed.

Every function here takes a weights dict (Hugging Face names, as mlx-lm's
`sanitize` leaves them) and a config dict, and returns new ones; nothing is
modified in place and nothing runs inside a model's `__call__`.

    RMSNorm(x) @ W.T == (x @ (W * g[None, :]).T) * rsqrt(mean(x^2) + eps)

MLX Linear weights are (out, in), so the gain scales input columns.
"""

import copy
from typing import Callable, Dict, List, Tuple

import mlx.core as mx

from . import models
from .errors import FoldError

Weights = Dict[str, mx.array]

# config.json key that marks a folded checkpoint (and how it was folded).
MARKER = "flashnorm"
FORMAT_VERSION = 1


def is_folded(config: dict) -> bool:
    return bool(config.get(MARKER, {}).get("folded", False))


def norm_pairs(config: dict, weights: Weights) -> List[Tuple[str, List[str]]]:
    """(norm module, [linear modules it feeds]) for every foldable norm."""
    return models.architecture(config).norm_pairs(config, weights)


def fold_gain(weights: Weights, gain: mx.array, linear: str) -> Weights:
    """W* = W diag(g), computed in float32 and cast back to W's dtype."""
    if f"{linear}.scales" in weights:
        raise FoldError(
            f"{linear} is quantized; dequantize before folding "
            "(folding changes the weight, so fold in float then quantize)"
        )
    w = weights[f"{linear}.weight"]
    folded = (w.astype(mx.float32) * gain.astype(mx.float32)[None, :]).astype(w.dtype)
    return {**weights, f"{linear}.weight": folded}


def fold_into(weights: Weights, gain: mx.array, linear: str, arch) -> Weights:
    """`fold_gain`, or on the rows (axis -2) of a linear `arch.gain_on_rows`
    names (read as x @ W: mlx-lm's MLA embed_q, docs/design.md section 2s)."""
    if not arch.gain_on_rows or not linear.endswith(arch.gain_on_rows):
        return fold_gain(weights, gain, linear)
    if f"{linear}.scales" in weights:
        raise FoldError(f"{linear} is quantized; dequantize before folding")
    w = weights[f"{linear}.weight"]
    g = gain.astype(mx.float32)[:, None]
    return {**weights, f"{linear}.weight": (w.astype(mx.float32) * g).astype(w.dtype)}


def fold_norms(
    weights: Weights, config: dict, untie: bool = False, compat: bool = False
) -> Tuple[Weights, dict]:
    """Fold every RMSNorm gain into the linear layers it feeds.

    untie:  with tied embeddings, make an lm_head = embedding and fold the
            final norm into it (more storage, same decode bandwidth).
    compat: keep all-ones norm tensors so stock mlx-lm still loads the result.
    A folded config is returned unchanged: folding twice equals folding once.
    """
    if is_folded(config):
        return weights, config
    arch = models.architecture(config)
    weights = dict(weights)
    config = copy.deepcopy(config)

    if untie and arch.is_tied(config):
        if f"{arch.embed}.scales" in weights:
            raise FoldError("cannot untie a quantized embedding; dequantize first")
        weights[f"{arch.head}.weight"] = weights[f"{arch.embed}.weight"]
        config[arch.tie_key] = False

    folded_norms = []
    for norm, linears in norm_pairs(config, weights):
        stored = weights[f"{norm}.weight"]
        # Gemma: 1 + w (docs/design.md section 2h); a gated norm's per head (2k).
        gain = arch.folded_gain(config, norm, stored)
        for linear in linears:
            weights = fold_into(weights, gain, linear, arch)
        folded_norms.append(norm)
        if compat:
            weights[f"{norm}.weight"] = arch.unit_weight(stored)
        else:
            del weights[f"{norm}.weight"]

    config[MARKER] = {
        "folded": True,
        "format": FORMAT_VERSION,
        "compat": compat,
        # The final norm keeps its gain when the head is tied to the embedding.
        "final_norm_folded": arch.final_norm in folded_norms,
    }
    return weights, config


def restore_unit_norms(weights: Weights, config: dict) -> Weights:
    """Give a folded checkpoint unit-gain norm tensors (all ones, Gemma's all
    zeros), so stock classes run it.

    A folded model with unit gains is the same function as the original one.
    """
    if not is_folded(config):
        return weights
    weights = dict(weights)
    arch = models.architecture(config)
    for norm, _ in norm_pairs(config, weights):
        key = f"{norm}.weight"
        if key not in weights:
            like = mx.zeros((arch.norm_width(config, norm),), dtype=mx.float32)
            weights[key] = arch.unit_weight(like)
    return weights


def drop_unit_norms(weights: Weights, config: dict) -> Weights:
    """Remove the placeholder ones that `--compat` keeps in a folded checkpoint."""
    if not is_folded(config):
        return weights
    weights = dict(weights)
    for norm, _ in norm_pairs(config, weights):
        weights.pop(f"{norm}.weight", None)
    return weights


def map_floats(weights: Weights, fn: Callable[[mx.array], mx.array]) -> Weights:
    """Apply fn to every floating-point tensor (quantized uint32 packs untouched)."""
    return {
        k: fn(v) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
