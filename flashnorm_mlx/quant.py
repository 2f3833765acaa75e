"""Float weights, quantization and compute dtype: one decision for load and convert.

A quantized source has three ways through FlashNorm (`QUANTIZED_WAYS`):
- "stored" (the default): the checkpoint's quantized weights as they are, for
  stock and FlashNorm alike. Folding would change them, so FlashNorm does not
  fold: the norm gains ride in its kernels instead (models/blocks.py). Stock's
  exact function, stock's bytes per token.
- "dequantize": dequantized to float32 and folded; the same function in float,
  at 2-4x the bytes per token.
- "requantize": dequantized, folded in float32, quantized again with the
  source's own settings (stock requantized alike): the folded weights'
  quantization, a slightly different function.
A float source is quantized only when asked (`quantize=(bits, group_size)`,
which on a quantized source requantizes to those settings). Stock, nonorm and
`convert` take the same path without or with the fold, so every variant is
quantized from the same float weights with the same settings. A checkpoint
folded already (by `convert`) is never folded or quantized again.
"""

from collections import Counter
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import fold
from .errors import LoadError

Weights = Dict[str, mx.array]


QUANTIZED_WAYS = ("stored", "dequantize", "requantize")


@dataclass
class WeightPlan:
    """What to build from a checkpoint's weights.

    weights: float tensors, or with `stored_quantized` the checkpoint's own
    quantized ones; config: without a quantization block unless
    `stored_quantized`;
    qspec: module -> {"bits", "group_size", "mode"} to quantize after the fold,
    or None; note: one line for the user when the choice is not the obvious one.
    """

    weights: Weights
    config: dict
    dtype: mx.Dtype
    qspec: Optional[dict] = None
    stored_quantized: bool = False
    note: Optional[str] = None


def source_dtype(weights: Weights) -> mx.Dtype:
    """The dtype a checkpoint stores its float tensors in (scales for quantized ones)."""
    for k, v in weights.items():
        if (k.endswith(".scales") or k.endswith(".weight")) and mx.issubdtype(
            v.dtype, mx.floating
        ):
            if k.endswith(".scales") or f"{k[:-7]}.scales" not in weights:
                return v.dtype
    return mx.float32


def compute_dtype(weights: Weights) -> mx.Dtype:
    """Default compute dtype: the checkpoint's, but float32 on MLX's CPU backend,
    whose float16/bfloat16 kernels are slow (quantized matmul ~30x/8x slower)."""
    return mx.float32 if mx.default_device() == mx.cpu else source_dtype(weights)


def plan_weights(
    weights: Weights,
    config: dict,
    dtype: Optional[mx.Dtype] = None,
    quantize: Optional[Tuple[int, int]] = None,
    quantized: str = "stored",
    output: bool = False,
) -> WeightPlan:
    """The one decision (see the module docstring). quantized: how a quantized
    source is taken, one of QUANTIZED_WAYS. output=True: for a checkpoint to
    write (`convert`), whose dtype defaults to the source's."""
    if quantized not in QUANTIZED_WAYS:
        raise LoadError(
            f"unknown way {quantized!r} for a quantized source; choose from "
            f"{', '.join(QUANTIZED_WAYS)}"
        )
    default = source_dtype(weights) if output else compute_dtype(weights)
    dtype = dtype or default
    if fold.is_folded(config):
        return _plan_folded(weights, config, dtype, quantize, quantized)
    if not fold.is_quantized(weights):
        qspec = uniform_qspec(weights, *quantize) if quantize else None
        return WeightPlan(weights, config, dtype, qspec)
    if quantize is None and quantized == "stored":
        return WeightPlan(
            weights, config, dtype, stored_quantized=True, note=stored_note(config)
        )
    qspec = source_qspec(weights, config) if quantized == "requantize" else None
    weights, config = fold.dequantize_weights(weights, config, mx.float32)
    if quantize:
        qspec = uniform_qspec(weights, *quantize)
    return WeightPlan(weights, config, dtype, qspec)


GROUP_SIZES = (32, 64, 128)  # what -q/--q-group-size offers


def uniform_qspec(weights: Weights, bits: int, group_size: int) -> dict:
    """Quantize every 2-D weight whose input width the group size divides, as
    mlx-lm does; LoadError where that is none of them (-q would do nothing)."""
    widths = {
        k[: -len(".weight")]: v.shape[-1]
        for k, v in weights.items()
        if k.endswith(".weight") and v.ndim == 2
    }
    qspec = {
        m: {"group_size": group_size, "bits": bits, "mode": "affine"}
        for m, w in widths.items()
        if w % group_size == 0
    }
    if widths and not qspec:
        sizes = sorted(set(widths.values()))
        fits = [g for g in GROUP_SIZES if any(w % g == 0 for w in sizes)]
        raise LoadError(
            f"-q: group size {group_size} divides no weight's input width "
            f"({', '.join(map(str, sizes))}), so nothing would be quantized; "
            + (
                f"--q-group-size {' or '.join(map(str, fits))} would work"
                if fits
                else f"no group size -q offers ({', '.join(map(str, GROUP_SIZES))}) does"
            )
        )
    return qspec


def requantizes(
    weights: Weights, config: dict, quantize: Optional[Tuple[int, int]], quantized: str
) -> bool:
    """Whether the models built this way run weights quantized by us (-q, or
    --requantize on an unfolded quantized source), not the checkpoint's own."""
    return bool(quantize) or (
        quantized == "requantize"
        and fold.is_quantized(weights)
        and not fold.is_folded(config)
    )


def describe(config: dict) -> str:
    """'4-bit group 32' (or 'mxfp4 group 32'): a quantization block in words."""
    q = config.get("quantization") or {}

    def words(spec):
        mode = spec.get("mode", "affine")
        bits = f"{spec.get('bits')}-bit" if mode == "affine" else mode
        return f"{bits} group {spec.get('group_size')}"

    rest = [f"{words(v)} for {k}" for k, v in q.items() if isinstance(v, dict)]
    return words(q) + (
        f" ({', '.join(rest[:2])}{', ...' if rest[2:] else ''})" if rest else ""
    )


def stored_note(config: dict) -> str:
    return (
        f"{describe(config)} checkpoint run as stored: stock and FlashNorm on the "
        "same quantized weights, the norm gains applied in FlashNorm's kernels "
        "(--dequantize: float; --requantize: fold, then quantize again)"
    )


def _plan_folded(weights, config, dtype, quantize, quantized) -> WeightPlan:
    if not fold.is_quantized(weights):
        qspec = uniform_qspec(weights, *quantize) if quantize else None
        return WeightPlan(weights, config, dtype, qspec)
    if quantize or quantized == "requantize":
        raise LoadError(
            "this checkpoint is folded and quantized already: quantizing it again "
            "would quantize twice; drop -q/--requantize (or convert from the "
            "unfolded source)"
        )
    if quantized == "dequantize":
        # Exact: the stored quantized function, run in float.
        weights, config = fold.dequantize_weights(weights, config, mx.float32)
        note = "folded quantized checkpoint: dequantized to run in float (exact)"
        return WeightPlan(weights, config, dtype, note=note)
    note = "folded quantized checkpoint: run as stored (nothing is requantized)"
    return WeightPlan(weights, config, dtype, stored_quantized=True, note=note)


# --- quantization specs ------------------------------------------------------------


def source_qspec(weights: Weights, config: dict) -> dict:
    """The settings each quantized module of a checkpoint was stored with."""
    return {
        k[: -len(".scales")]: fold.quant_params(config, k[: -len(".scales")])
        for k in weights
        if k.endswith(".scales")
    }


def _lookup(qspec: dict, path: str, fused: Dict[str, str]) -> Optional[dict]:
    # A stacked q|k|v or gate|up linear takes the quantization of its first part.
    if path in qspec:
        return qspec[path]
    for name, part in fused.items():
        if path.endswith(name):
            return qspec.get(path[: -len(name)] + part)
    return None


def apply_qspec(model: nn.Module, qspec: dict, config: dict) -> dict:
    """Quantize `model`'s modules as `qspec` says; returns the config with the
    quantization block."""
    fused = fold.architecture(config).fused_first_part()

    def predicate(path, module):
        return hasattr(module, "to_quantized") and (
            _lookup(qspec, path, fused) or False
        )

    nn.quantize(model, class_predicate=predicate)
    return with_quantization(config, qspec)


def quantization_block(qspec: dict) -> dict:
    """mlx-lm's quantization block: the most common setting, per-module exceptions."""
    bits, group_size = Counter(
        (v["bits"], v["group_size"]) for v in qspec.values()
    ).most_common(1)[0][0]
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    q.update(
        {
            k: v
            for k, v in qspec.items()
            if v["bits"] != bits or v["group_size"] != group_size
        }
    )
    return q


def with_quantization(config: dict, qspec: dict) -> dict:
    """`config` with the block under both names mlx-lm reads."""
    q = quantization_block(qspec)
    return {**config, "quantization": q, "quantization_config": q}
