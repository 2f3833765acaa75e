"""Quantization settings: reading a checkpoint's, making uniform ones, applying them.

A qspec maps a module path to {"bits", "group_size", and the q_mode under
mlx's key (limits.MLX_Q_MODE)}; the config's quantization block (mlx-lm's
format) holds the most common setting plus per-module exceptions.
"""

from collections import Counter
from typing import Optional, Tuple

import mlx.core as mx

from ..errors import FoldError, LoadError
from ..fold import Weights
from ..limits import AFFINE, GROUP_SIZES, MLX_Q_MODE, q_mode_of


def is_quantized(weights: Weights) -> bool:
    return any(k.endswith(".scales") for k in weights)


def quant_params(config: dict, module: str) -> Optional[dict]:
    """The (group_size, bits, q_mode) a quantized module was stored with."""
    q = config.get("quantization")
    if not q:
        return None
    per = q.get(module)
    spec = per if isinstance(per, dict) else q
    return {
        "group_size": spec["group_size"],
        "bits": spec["bits"],
        MLX_Q_MODE: q_mode_of(spec),
    }


def affine_spec(bits: int, group_size: int) -> dict:
    """An affine setting, as a qspec entry and mlx-lm's block hold it."""
    return {"group_size": group_size, "bits": bits, MLX_Q_MODE: AFFINE}


def q_settings(q: dict) -> dict:
    """bench's and convert's JSON words for a quantization block."""
    return {
        "bits": q.get("bits"),
        "group_size": q.get("group_size"),
        "q_mode": q_mode_of(q),
    }


def dequantize_weights(
    weights: Weights, config: dict, dtype: mx.Dtype = mx.float32
) -> Tuple[Weights, dict]:
    """Quantized (weight, scales, biases) triples -> float weights in `dtype`,
    computed in float32 from the stored scales and biases, then cast once."""
    out: Weights = {}
    for key, value in weights.items():
        if key.endswith(".scales") or key.endswith(".biases"):
            continue
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module is not None and f"{module}.scales" in weights:
            qp = quant_params(config, module)
            if qp is None:
                raise FoldError(f"{module} is quantized but config has no quantization")
            scales, biases = weights[f"{module}.scales"], weights.get(
                f"{module}.biases"
            )
            # mx.dequantize computes in its scales' dtype: float16 scales would
            # round every weight to float16 before the cast (affine only).
            if mx.issubdtype(scales.dtype, mx.floating):
                scales = scales.astype(mx.float32)
                biases = None if biases is None else biases.astype(mx.float32)
            value = mx.dequantize(
                value,
                scales,
                biases,
                group_size=qp["group_size"],
                bits=qp["bits"],
                mode=q_mode_of(qp),
            ).astype(dtype)
        out[key] = value
    config = {
        k: v
        for k, v in config.items()
        if k not in ("quantization", "quantization_config")
    }
    return out, config


def uniform_qspec(
    weights: Weights, bits: int, group_size: int, config: Optional[dict] = None
) -> dict:
    """Quantize every linear weight (2-D, or 3-D stacked experts) whose input
    width the group size divides, as mlx-lm does, a mixture-of-experts router
    at the bits mlx-lm's quant_predicate gives it (`Architecture.moe`);
    LoadError where that is none of them (-q would do nothing)."""
    widths = {
        k[: -len(".weight")]: v.shape[-1]
        for k, v in weights.items()
        if k.endswith(".weight") and v.ndim in (2, 3)
    }
    qspec = {
        m: affine_spec(bits, group_size)
        for m, w in widths.items()
        if w % group_size == 0
    }
    router = _router_quant(config)
    if router and router[0] is None:  # a router mlx-lm keeps float
        qspec = {m: q for m, q in qspec.items() if not m.endswith(router[2])}
    elif router:
        r_bits, r_group, names = router
        for m, w in widths.items():
            if m.endswith(names) and r_bits is None:  # not a linear: kept
                qspec.pop(m, None)
            elif m.endswith(names) and w % r_group == 0:
                qspec[m] = affine_spec(r_bits, r_group)
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


def _router_quant(config: Optional[dict]):
    """(bits, group_size, (".router name", a shared expert's ".gate name")) of
    a mixture-of-experts router, as mlx-lm's quant_predicate sets it (bits
    None: it keeps the router float), or None."""
    if not config:
        return None
    from .. import models

    try:
        moe = models.architecture(config).moe
    except Exception:  # not a model this package builds: no router to set
        return None
    if moe is None or (moe.router_quant is None and not moe.router_float):
        return None
    gates = (moe.router,) + ((moe.shared_gate,) if moe.shared_gate else ())
    bits = (None, None) if moe.router_float else moe.router_quant
    return (*bits, tuple(f".{g}" for g in gates))


def source_qspec(weights: Weights, config: dict) -> dict:
    """The settings each quantized module of a checkpoint was stored with."""
    return {
        k[: -len(".scales")]: quant_params(config, k[: -len(".scales")])
        for k in weights
        if k.endswith(".scales")
    }


def rtn(weight: mx.array, q: dict) -> Weights:
    """Round-to-nearest, as nn.QuantizedLinear/Embedding quantize a weight:
    {"weight", "scales"} and, for affine settings, "biases"."""
    packed, scales, *biases = mx.quantize(
        weight, group_size=q["group_size"], bits=q["bits"], mode=q_mode_of(q)
    )
    return {
        "weight": packed,
        "scales": scales,
        **({"biases": biases[0]} if biases else {}),
    }


def quantize_weights(weights: Weights, qspec: dict) -> Weights:
    """Every module in `qspec` quantized by `rtn`, the other tensors as they are."""
    out: Weights = {}
    for key, value in weights.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        if module in qspec:
            out.update(
                {f"{module}.{k}": v for k, v in rtn(value, qspec[module]).items()}
            )
        else:
            out[key] = value
    return out


def quantization_block(qspec: dict) -> dict:
    """mlx-lm's quantization block: the most common setting, per-module exceptions."""
    bits, group_size = Counter(
        (v["bits"], v["group_size"]) for v in qspec.values()
    ).most_common(1)[0][0]
    q = affine_spec(bits, group_size)
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
