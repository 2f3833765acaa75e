"""Quantization: the one weights decision, quantization settings, fold-aware GPTQ.

- `plan`: `plan_weights`, the one decision on weights, dtype and quantization
  that loading, nonorm and `convert` share (stored, dequantize, requantize),
  and the stored way's config marker;
- `specs`: a checkpoint's quantization settings, dequantizing, uniform ones
  for -q, and applying them to a model;
- `gptq`: fold-aware GPTQ (calibration, Hessians, one weight at a time).
"""

from .plan import (
    QUANTIZED_WAYS,
    WeightPlan,
    activation_dtype,
    compute_dtype,
    describe,
    has_norm_gains,
    is_norm,
    mark_norm_gains,
    plan_weights,
    requantizes,
    slow_note,
    source_dtype,
)
from .specs import (
    affine_spec,
    dequantize_weights,
    is_quantized,
    q_settings,
    quant_params,
    quantization_block,
    quantize_weights,
    rtn,
    source_qspec,
    with_quantization,
)

__all__ = [
    "QUANTIZED_WAYS",
    "WeightPlan",
    "activation_dtype",
    "affine_spec",
    "compute_dtype",
    "dequantize_weights",
    "describe",
    "has_norm_gains",
    "is_norm",
    "is_quantized",
    "mark_norm_gains",
    "plan_weights",
    "quant_params",
    "quantization_block",
    "quantize_weights",
    "q_settings",
    "requantizes",
    "slow_note",
    "rtn",
    "source_dtype",
    "source_qspec",
    "with_quantization",
]
