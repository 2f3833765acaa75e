"""Float weights, quantization and compute dtype: one decision for load and convert,
so every mode and `convert` run on the same weights. A quantized source is taken
"stored", "dequantize"d or "requantize"d (`QUANTIZED_WAYS`; docs/design.md
section 1). A float source read whole and held for its life (a GGUF,
`read_whole`) is taken "stored" too: folded, its model would hold each weight
beside the source's, so the gains ride in the kernels (docs/design.md 2i).
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from .. import fold
from ..errors import LoadError
from ..fold import Weights
from ..limits import AFFINE, q_mode_of
from . import gptq, kquant
from .specs import dequantize_weights, is_quantized, source_qspec, uniform_qspec

QUANTIZED_WAYS = ("stored", "dequantize", "requantize")


@dataclass
class WeightPlan:
    """What to build from a checkpoint's weights.

    weights: float tensors, or with `as_stored` the checkpoint's own
    quantized ones; config: without a quantization block unless
    `as_stored`;
    qspec: module -> {"bits", "group_size", q_mode} to quantize after the fold,
    or None; note: one line for the user when the choice is not the obvious one;
    cast_stored: stored tensors cast to `dtype` all the same (a GGUF: llama.cpp
    computes in float32 from its float16 scales, exact when widened).
    """

    weights: Weights
    config: dict
    dtype: mx.Dtype
    qspec: Optional[dict] = None
    as_stored: bool = False
    note: Optional[str] = None
    cast_stored: bool = False


def source_dtype(weights: Weights, config: Optional[dict] = None) -> mx.Dtype:
    """The dtype a checkpoint stores its float tensors in (scales for quantized
    ones; a GGUF's float16 where its K-quants were read in float32)."""
    given = kquant.file_dtype(config)
    if given is not None:
        return given
    for k, v in weights.items():
        if (k.endswith(".scales") or k.endswith(".weight")) and mx.issubdtype(
            v.dtype, mx.floating
        ):
            if k.endswith(".scales") or f"{k[:-7]}.scales" not in weights:
                return v.dtype
    return mx.float32


def compute_dtype(weights: Weights, config: Optional[dict] = None) -> mx.Dtype:
    """Default compute dtype: the checkpoint's, but float32 on MLX's CPU backend,
    whose float16/bfloat16 kernels are slow (quantized matmul ~30x/8x slower)."""
    if mx.default_device() == mx.cpu:
        return mx.float32
    return source_dtype(weights, config)


def is_norm(key: str, value: mx.array) -> bool:
    """A norm's gain tensor (1-D, named *norm*.weight): what mlx-lm's norms
    multiply by, so what promotes its activations' dtype."""
    return value.ndim == 1 and "norm" in key and key.endswith(".weight")


def activation_dtype(weights: Weights, dtype: mx.Dtype) -> mx.Dtype:
    """mlx-lm's activation dtype on stored weights, at least `dtype`.

    mlx-lm's load casts nothing: its activations start in the embedding's
    dtype (its scales' when quantized) and the first norm promotes them with
    its gain's (mx.fast.rms_norm, like a matmul, returns the promoted dtype),
    so float16 weights with float32 norms run in float32 (docs/design.md
    section 1). `dtype` (--dtype, or the backend's default) joins the promotion:
    float32 on a CPU stays float32, and widening is exact."""
    out = dtype
    for k, v in weights.items():
        if not mx.issubdtype(v.dtype, mx.floating):
            continue
        if is_norm(k, v) or "embed" in k:
            # MLX's promotion, read off a lazy add (nothing is computed).
            out = (mx.zeros((), out) + mx.zeros((), v.dtype)).dtype
    return out


def slow_note(dtype: mx.Dtype) -> Optional[str]:
    """One line where activations in `dtype` are slow on this backend."""
    if mx.default_device() != mx.cpu or dtype not in (mx.float16, mx.bfloat16):
        return None
    name = str(dtype).replace("mlx.core.", "")
    return (
        f"activations run in {name}, which MLX's CPU backend computes many times "
        "slower than float32 (a 4-bit matmul ~35x); --dtype float32 is the fast "
        "choice here"
    )


def plan_weights(
    weights: Weights,
    config: dict,
    dtype: Optional[mx.Dtype] = None,
    quantize: Optional[Tuple[int, int]] = None,
    quantized_way: str = "stored",
    output: bool = False,
    q_method: str = "rtn",
    read_whole: bool = False,
) -> WeightPlan:
    """The one decision (see the module docstring). quantized_way: how a quantized
    source is taken, one of QUANTIZED_WAYS. output=True: for a checkpoint to
    write (`convert`), whose dtype defaults to the source's. q_method: how we
    quantize, "rtn" or "gptq" (gptq.py); settings it cannot write are a
    LoadError here, before any work. read_whole: `weights` stay held for the
    source's life (a GGUF): float ones are taken as stored too, not folded."""
    plan = _plan(weights, config, dtype, quantize, quantized_way, output, read_whole)
    if q_method == "gptq" and plan.qspec:
        gptq.check_qspec(plan.qspec)
    return plan


def _plan(
    weights, config, dtype, quantize, quantized_way, output, read_whole=False
) -> WeightPlan:
    if quantized_way not in QUANTIZED_WAYS:
        raise LoadError(
            f"unknown way {quantized_way!r} for a quantized source; choose from "
            f"{', '.join(QUANTIZED_WAYS)}"
        )
    default = (
        source_dtype(weights, config) if output else compute_dtype(weights, config)
    )
    given_dtype, dtype = dtype, dtype or default
    if fold.is_folded(config):
        return _plan_folded(
            weights, config, dtype, given_dtype, quantize, quantized_way, output
        )
    # GGUF K-quants read as float (Q6_K, ...): --requantize rounds them to the
    # nearest MLX setting (kquant.py), as the quantized ones.
    floats = kquant.requantize_spec(config) if quantized_way == "requantize" else {}
    # A GGUF's float tensors (its F32/F16 ones, and its Q6_K/Q3_K/Q2_K read as
    # float) are held by the source, read whole, for its life: folded, a model
    # would hold a second copy of each beside them (docs/design.md section
    # 2i). FlashNorm takes them as stored; `convert` folds them as before.
    whole = kquant.floats_of(config) or read_whole
    stored_floats = whole and not (quantize or output)
    if not is_quantized(weights) and not (stored_floats and quantized_way == "stored"):
        qspec = (
            uniform_qspec(weights, *quantize, config) if quantize else (floats or None)
        )
        return WeightPlan(weights, config, dtype, qspec)
    if quantize is None and quantized_way == "stored":
        # The file's own function and bytes, as the user asked: nothing to say.
        return WeightPlan(
            weights, config, dtype, as_stored=True, cast_stored=bool(whole)
        )
    requantize = quantized_way == "requantize"
    qspec = {**source_qspec(weights, config), **floats} if requantize else None
    if floats:  # one setting per stacked q|k|v, gate|up
        qspec = kquant.same_in_stacks(qspec, config)
    note = _changed_note(weights, config, dtype, quantize, quantized_way)
    weights, config = dequantize_weights(weights, config, mx.float32)
    if quantize:
        qspec = uniform_qspec(weights, *quantize, config)
    return WeightPlan(weights, config, dtype, qspec, note=note)


def requantizes(
    weights: Weights,
    config: dict,
    quantize: Optional[Tuple[int, int]],
    quantized_way: str,
) -> bool:
    """Whether the models built this way run weights quantized by us (-q, or
    --requantize on an unfolded quantized source), not the checkpoint's own."""
    return bool(quantize) or (
        quantized_way == "requantize"
        and (is_quantized(weights) or bool(kquant.requantize_spec(config)))
        and not fold.is_folded(config)
    )


def bits_words(spec: dict) -> str:
    """'4-bit' for affine settings, else the format's name ('mxfp4'): every
    quantization in words starts here."""
    q_mode = q_mode_of(spec)
    return f"{spec.get('bits')}-bit" if q_mode == AFFINE else q_mode


def describe(config: dict) -> str:
    """'4-bit group 32' (or 'mxfp4 group 32'): a quantization block in words."""
    q = config.get("quantization") or {}

    def words(spec):
        return f"{bits_words(spec)} group {spec.get('group_size')}"

    rest = [f"{words(v)} for {k}" for k, v in q.items() if isinstance(v, dict)]
    return words(q) + (
        f" ({', '.join(rest[:2])}{', ...' if rest[2:] else ''})" if rest else ""
    )


def _weights_words(config: dict) -> str:
    """'4-bit weights', '4-bit weights (some 8-bit)': the source's, in words."""
    q = config.get("quantization") or {}
    others = {bits_words(v) for v in q.values() if isinstance(v, dict)}
    others -= {bits_words(q)}
    some = f" (some {', '.join(sorted(others))})" if others else ""
    return f"{bits_words(q)} weights{some}"


def _changed_note(weights, config, dtype, quantize, quantized_way) -> str:
    """The one line where a quantized source is not run as the file holds it:
    what the user gets instead, in plain words (docs/design.md section 1)."""
    words = _weights_words(config)
    if quantize:
        return (
            f"the model's {words} are dequantized and rounded again to "
            f"{quantize[0]}-bit (-q): results differ from the file's"
        )
    if quantized_way == "requantize":
        return (
            f"the model's {words} are dequantized and rounded again "
            "(--requantize): results close to the file's, not identical"
        )
    return _float_note(weights, config, dtype)


def _float_note(weights, config, dtype) -> str:
    """--dequantize: the file's results in float, at a memory cost."""
    q = config.get("quantization") or {}
    name = str(dtype).replace("mlx.core.", "")
    # Stored bits per weight: the bits, plus a scale (and an affine bias) a group.
    size = source_dtype(weights, config).size
    extra = 8 * size * (2 if q_mode_of(q) == AFFINE else 1)
    stored = q.get("bits", 4) + extra / q.get("group_size", 64)
    times = 8 * dtype.size / stored
    return (
        f"the model's {_weights_words(config)} run in {name} (--dequantize): the "
        f"file's results, about {times:.0f}x the memory for the weights"
    )


def mark_norm_gains(config: dict) -> dict:
    """`config` marked as run unfolded, the gains in the kernels (the stored
    way, for FlashNorm): what `convert` writes for a quantized checkpoint."""
    marker = {"folded": False, "format": fold.FORMAT_VERSION, "norm_gains": "kernels"}
    return {**config, fold.MARKER: marker}


def has_norm_gains(config: dict) -> bool:
    """Unfolded weights whose norm gains FlashNorm applies in its kernels."""
    return config.get(fold.MARKER, {}).get("norm_gains") == "kernels"


def _plan_folded(weights, config, dtype, given_dtype, quantize, quantized_way, output):
    """The folded-source rule, for loading and `convert` alike: a checkpoint that
    `convert` folded is never folded again, and its quantized tensors are never
    quantized again (that would quantize twice)."""
    if is_quantized(weights):
        if quantize or quantized_way == "requantize" or output:
            raise LoadError(
                "this checkpoint is already folded and quantized: nothing to fold, "
                "and quantizing it again would quantize twice; "
                + (
                    "convert from the unfolded source"
                    if output
                    else "drop -q/--requantize"
                )
            )
        if quantized_way == "dequantize":
            # Exact: the stored quantized function, run in float.
            note = _float_note(weights, config, dtype)
            weights, config = dequantize_weights(weights, config, mx.float32)
            return WeightPlan(weights, config, dtype, note=note)
        return WeightPlan(weights, config, dtype, as_stored=True)
    if output and quantize is None and given_dtype is None:
        raise LoadError(
            "source is already folded (config.json has 'flashnorm'); "
            "pass -q or --dtype to quantize or cast it"
        )
    qspec = uniform_qspec(weights, *quantize, config) if quantize else None
    return WeightPlan(weights, config, dtype, qspec)
