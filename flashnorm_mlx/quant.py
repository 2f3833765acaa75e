"""Float weights, quantization and compute dtype: one decision for load and convert.

Folding changes a weight, so a quantized source cannot stay bit-for-bit
quantized: it is dequantized to float32, folded, then quantized again with its
own settings (or kept float with `dequantize`); a float source is quantized only
when asked (`quantize=(bits, group_size)`). Stock, nonorm and `convert` take
the same path without or with the fold, so every variant is quantized from the
same float weights with the same settings. A checkpoint folded already (by
`convert`) is never folded or quantized again.
"""

from collections import Counter
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import fold
from .errors import LoadError

Weights = Dict[str, mx.array]


@dataclass
class WeightPlan:
    """What to build from a checkpoint's weights.

    weights: float (or, for a folded quantized checkpoint, stored) tensors;
    config: without a quantization block unless `stored_quantized`;
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
    dequantize: bool = False,
    output: bool = False,
) -> WeightPlan:
    """The one decision (see the module docstring). output=True: for a
    checkpoint to write (`convert`), whose dtype defaults to the source's."""
    default = source_dtype(weights) if output else compute_dtype(weights)
    dtype = dtype or default
    if fold.is_folded(config):
        return _plan_folded(weights, config, dtype, quantize, dequantize)
    qspec = None
    if fold.is_quantized(weights):
        if not dequantize and not quantize:
            qspec = source_qspec(weights, config)
        weights, config = fold.dequantize_weights(weights, config, mx.float32)
    if quantize:
        qspec = uniform_qspec(weights, *quantize)
    return WeightPlan(weights, config, dtype, qspec)


def _plan_folded(weights, config, dtype, quantize, dequantize) -> WeightPlan:
    if not fold.is_quantized(weights):
        qspec = uniform_qspec(weights, *quantize) if quantize else None
        return WeightPlan(weights, config, dtype, qspec)
    if quantize:
        raise LoadError(
            "this checkpoint is folded and quantized already: quantizing it again "
            "would quantize twice; drop -q (or convert from the unfolded source)"
        )
    if dequantize:
        # Exact: the stored quantized function, run in float.
        weights, config = fold.dequantize_weights(weights, config, mx.float32)
        note = "folded quantized checkpoint: dequantized to run in float (exact)"
        return WeightPlan(weights, config, dtype, note=note)
    note = "folded quantized checkpoint: run as stored (nothing is requantized)"
    return WeightPlan(weights, config, dtype, stored_quantized=True, note=note)


# --- quantization specs ------------------------------------------------------------


def uniform_qspec(weights: Weights, bits: int, group_size: int) -> dict:
    """Quantize every 2-D weight whose input width the group size divides, as
    mlx-lm does."""
    return {
        k[: -len(".weight")]: {"group_size": group_size, "bits": bits, "mode": "affine"}
        for k, v in weights.items()
        if k.endswith(".weight") and v.ndim == 2 and v.shape[-1] % group_size == 0
    }


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
