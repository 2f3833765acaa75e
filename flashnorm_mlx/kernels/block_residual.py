"""The block's residual: its sum, its mean square and the next matmul's input.

`residual` closes each half of a block (h = x + s_y * y) and hands the next
matmul xs, the row it reads; `residual_norm` is the last block's residual fused
with the final RMSNorm (docs/design.md section 3b).
"""

import functools
import math
from typing import Optional, Tuple

import mlx.core as mx

from . import _common
from ._common import deferred_scale, pow2_prescale, prescaled
from .render import TREE_SUM

# After the row sums: the row's mean square (ms) for the next block, with the
# next norm's gain or float16 prescale applied to the row it reads (xs), or with
# FN_NORM the final RMSNorm itself. FN_ROW(i) recomputes row element i; shared
# by `residual_ops` and post_norm.py's kernel.
NEXT_NORM = """\
  const float msr = red[0] / static_cast<float>(D) + params[0];
#if FN_NORM
  // The final RMSNorm, as mx.fast.rms_norm rounds it: T(v * r), then the gain.
  const float r = FN_RSQRT(msr);
  for (int i = lane; i < D; i += NT) {
#if FN_GAIN
    out[base + i] = static_cast<T>(
        static_cast<float>(gain[i]) * static_cast<float>(static_cast<T>(FN_ROW(i) * r)));
#else
    out[base + i] = static_cast<T>(FN_ROW(i) * r);
#endif
  }
#else
  if (lane == 0) {
    ms[FN_GROUP] = msr;
  }
#if FN_GAIN
  // The next norm's gain, applied where the row the next matmul reads is formed
  // (unfolded weights, e.g. a quantized checkpoint as stored).
#if FN_PRESCALE
  const float p = FN_POW2_PRESCALE(msr);
#else
  const float p = 1.0f;
#endif
  for (int i = lane; i < D; i += NT) {
    xs[base + i] = static_cast<T>(FN_ROW(i) * static_cast<float>(gain[i]) * p);
  }
#elif FN_PRESCALE
  const float p = FN_POW2_PRESCALE(msr);
  for (int i = lane; i < D; i += NT) {
    xs[base + i] = static_cast<T>(FN_ROW(i) * p);
  }
#endif
#endif
"""

# One threadgroup of NT threads per row of D. FN_ROW(i) is element i of the
# residual row, rounded to T exactly as the twin rounds it. FN_GAIN: `gain` is
# the final norm's (with FN_NORM) or the next norm's, on xs (without).
RESIDUAL_BODY = (
    """\
  const int lane = FN_LANE;
  const int base = FN_GROUP * D;
#if FN_SCALE_Y
  // y is a block output still owing its deferred 1/RMS: s = rsqrt(ms_y) / p.
  const float msy = ms_y[FN_GROUP];
#if FN_PRESCALE
  const float sy = FN_RSQRT(msy) / FN_POW2_PRESCALE(msy);
#else
  const float sy = FN_RSQRT(msy);
#endif
#define FN_ROW(i) static_cast<float>(static_cast<T>(static_cast<float>(h[base + (i)]) \\
    + static_cast<float>(static_cast<T>(static_cast<float>(y[base + (i)]) * sy))))
#elif FN_HAS_Y
#define FN_ROW(i) static_cast<float>(static_cast<T>(static_cast<float>(h[base + (i)]) \\
    + static_cast<float>(y[base + (i)])))
#else
#define FN_ROW(i) static_cast<float>(h[base + (i)])
#endif
  float acc = 0.0f;
  for (int i = lane; i < D; i += NT) {
    const float v = FN_ROW(i);
#if FN_HAS_Y && !FN_NORM
    out[base + i] = static_cast<T>(v);
#endif
    acc += v * v;
  }
  FN_SHARED float red[RP];
  red[lane] = acc;
"""
    + TREE_SUM
    + """\
"""
    + NEXT_NORM
    + """\
#undef FN_ROW
"""
)


def _residual_sum(h, y, ms_y):
    if y is None:
        return h
    if ms_y is None:
        return h + y
    return h + (y * deferred_scale(ms_y, y.dtype)).astype(h.dtype)


def residual_ops(
    h: mx.array,
    y: Optional[mx.array],
    ms_y: Optional[mx.array],
    eps: float,
    gain: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """(out, ms, xs): out = h + s_y * y, ms = mean(out^2) + eps in float32, and xs
    what the next matmul reads: out * gain * p, without the gain where it was
    folded into the weights (gain None), without p but in float16.

    h, y (B, L, D); s_y from ms_y (B, L, 1) by `deferred_scale`, or 1 when ms_y is
    None (y already scaled); y None: out = h (a block's input, e.g. embeddings);
    gain (D,): the next RMSNorm's gain.
    """
    out = _residual_sum(h, y, ms_y)
    x = out.astype(mx.float32)
    ms = mx.mean(x * x, axis=-1, keepdims=True) + eps
    xs = x * gain.astype(mx.float32) if gain is not None else x
    if prescaled(out.dtype):
        xs = xs * pow2_prescale(ms)
    elif gain is None:
        return out, ms, out  # the matmuls read the residual itself
    return out, ms, xs.astype(out.dtype)


@functools.lru_cache(maxsize=512)
def _residual_plan(shape, dtype, inputs, norm, make_kernel, backend):
    """(kernel, launch keywords, where out, ms and xs are among the outputs)
    for one call signature, built once: a step makes this call twice per
    block, and where it is not compiled (prefill, a shape's first step) the
    Python around it is host time. Keyed on the kernel factory and backend
    too, so tests that swap either get fresh plans."""
    D = shape[-1]
    nt = min(256, max(32, _common.next_pow2(D) // 4))
    # inputs: the names `_residual_call` gives, which say the form.
    has_y, scale_y, has_gain = ("y" in inputs), ("ms_y" in inputs), ("gain" in inputs)
    if norm:
        outputs = {"out": (shape, dtype)}
    else:
        outputs = {"out": (shape, dtype)} if has_y else {}
        outputs["ms"] = ((*shape[:-1], 1), mx.float32)
        if prescaled(dtype) or has_gain:
            outputs["xs"] = (shape, dtype)
    kernel = make_kernel(
        "residual",
        RESIDUAL_BODY,
        inputs,
        list(outputs),
        has_y=has_y,
        scale_y=scale_y,
        prescale=prescaled(dtype),
        norm=norm,
        gain=has_gain,
    )
    launch = row_launch(shape, dtype, nt, outputs)
    names = list(outputs)
    # Output positions of (out, ms, xs); None where the kernel does not write it.
    where = tuple(names.index(n) if n in names else None for n in ("out", "ms", "xs"))
    return kernel, launch, where


def _residual_call(h, y, ms_y, eps, norm, gain=None):
    # The kernel indexes rows of D in flat memory: no reshapes needed.
    names, inputs = _common.kernel_inputs(
        ("h", h),
        ("y", y),
        ("ms_y", ms_y),
        ("params", _common.consts(float(eps))),
        ("gain", gain),
    )
    kernel, launch, where = _residual_plan(
        h.shape, h.dtype, names, norm, _common.make_kernel, _common.gpu_backend()
    )
    return kernel(inputs=inputs, **launch), where


def residual_kernel(h, y, ms_y, eps, gain=None):
    outs, (i_out, i_ms, i_xs) = _residual_call(h, y, ms_y, eps, norm=False, gain=gain)
    out = h if i_out is None else outs[i_out]  # y None: the residual is h itself
    return out, outs[i_ms], out if i_xs is None else outs[i_xs]


def residual(h, y, ms_y, eps, gain=None):
    return _common.pick("residual", residual_kernel, residual_ops)(
        h, y, ms_y, eps, gain
    )


def residual_norm_ops(
    h: mx.array,
    y: Optional[mx.array],
    ms_y: Optional[mx.array],
    eps: float,
    gain: Optional[mx.array] = None,
) -> mx.array:
    """RMSNorm(h + s_y * y) with `gain` (None: no gain, it was folded into the head):
    the last block's residual and the final norm in one pass (the residual sum
    as in `residual_ops`)."""
    return mx.fast.rms_norm(_residual_sum(h, y, ms_y), gain, eps)


def residual_norm_kernel(h, y, ms_y, eps, gain=None):
    return _residual_call(h, y, ms_y, eps, norm=True, gain=gain)[0][0]


def residual_norm(h, y, ms_y, eps, gain=None):
    fn = _common.pick("residual_norm", residual_norm_kernel, residual_norm_ops)
    return fn(h, y, ms_y, eps, gain)


def row_launch(shape, dtype, nt: int, outputs: dict) -> dict:
    """The launch of a row kernel: one threadgroup of `nt` threads per row of
    the last axis, `outputs` {name: (shape, dtype)} in the kernel's order."""
    return dict(
        template=[("T", dtype), ("D", shape[-1]), ("NT", nt), ("RP", nt)],
        grid=(math.prod(shape[:-1]) * nt, 1, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[s for s, _ in outputs.values()],
        output_dtypes=[d for _, d in outputs.values()],
    )
