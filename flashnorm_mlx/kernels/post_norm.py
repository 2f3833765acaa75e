"""A post-norm's residual: h + RMSNorm(y) with its gain, then what `residual` makes.

Gemma normalizes each sublayer's output before the residual add (its sandwich
norms). That norm feeds an add, not a linear layer, so FlashNorm cannot fold
its gain nor defer its 1/RMS: it is computed, in the one launch that closes
the half-block anyway (docs/design.md section 2h). Where y still owes a
deferred scale s_y (the FFN output), the norm cancels it as the QK-norm does:
rms_norm(s_y * y) = y * rsqrt(mean(y^2) + eps / s_y^2). In float16 the sum is
clipped to float16's range, as mlx-lm's `clip_residual` does.

`post_residual` returns (out, ms, xs) as `block_residual.residual` does;
`post_residual_norm` is the last block's, fused with the final RMSNorm.
"""

import functools
from typing import Optional, Tuple

import mlx.core as mx

from . import _common
from ._common import pow2_prescale, prescaled
from .block_residual import NEXT_NORM, residual_ops, row_launch
from .render import TREE_SUM

F16_MAX = 65504.0

# One threadgroup of NT threads per row of D: two reductions, mean(y^2) for the
# post-norm and mean(out^2) for the next norm. FN_ROW(i): element i of the
# residual, rounded as the twin rounds it: T(h + T(post_gain * T(y * r))).
POST_RESIDUAL_BODY = (
    """\
  const int lane = FN_LANE;
  const int base = FN_GROUP * D;
  FN_SHARED float red[RP];
  float acc = 0.0f;
  for (int i = lane; i < D; i += NT) {
    const float v = static_cast<float>(y[base + i]);
    acc += v * v;
  }
  red[lane] = acc;
"""
    + TREE_SUM
    + """\
#if FN_SCALE_Y
  // y owes s_y = rsqrt(ms_y) / p: the norm cancels it, eps scales by 1/s_y^2.
  const float msy = ms_y[FN_GROUP];
#if FN_PRESCALE
  const float py = FN_POW2_PRESCALE(msy);
  const float inv_s2 = msy * py * py;
#else
  const float inv_s2 = msy;
#endif
#else
  const float inv_s2 = 1.0f;
#endif
  const float ry = FN_RSQRT(red[0] / static_cast<float>(D) + params[0] * inv_s2);
  FN_SYNC();  // every thread has read red[0] before it is written again
#if FN_PRESCALE
  // float16: the sum in float32, clipped to float16's range (clip_residual).
#define FN_CLIP(v) ((v) < -65504.0f ? -65504.0f : ((v) > 65504.0f ? 65504.0f : (v)))
#else
#define FN_CLIP(v) (v)
#endif
#define FN_NORMED(i) static_cast<float>(static_cast<T>(static_cast<float>(post_gain[i]) \\
    * static_cast<float>(static_cast<T>(static_cast<float>(y[base + (i)]) * ry))))
#define FN_ROW(i) static_cast<float>(static_cast<T>(FN_CLIP( \\
    static_cast<float>(h[base + (i)]) + FN_NORMED(i))))
  acc = 0.0f;
  for (int i = lane; i < D; i += NT) {
    const float v = FN_ROW(i);
#if !FN_NORM
    out[base + i] = static_cast<T>(v);
#endif
    acc += v * v;
  }
  red[lane] = acc;
"""
    + TREE_SUM
    + """\
"""
    + NEXT_NORM
    + """\
#undef FN_ROW
#undef FN_NORMED
#undef FN_CLIP
"""
)


def post_norm_sum(
    h: mx.array,
    y: mx.array,
    ms_y: Optional[mx.array],
    post_gain: mx.array,
    eps: float,
) -> mx.array:
    """h + RMSNorm(s_y * y) * post_gain, each step rounded as mlx-lm's Gemma
    rounds it (rms_norm's output in T, then the add, in float32 and clipped
    for float16); s_y from ms_y as `deferred_scale` makes it (None: 1)."""
    dtype = h.dtype
    yf = y.astype(mx.float32)
    if ms_y is None:
        inv_s2 = 1.0
    elif prescaled(y.dtype):
        p = pow2_prescale(ms_y)
        inv_s2 = ms_y * (p * p)
    else:
        inv_s2 = ms_y
    r = mx.rsqrt(mx.mean(yf * yf, axis=-1, keepdims=True) + eps * inv_s2)
    normed = (yf * r).astype(dtype).astype(mx.float32)
    normed = (post_gain.astype(mx.float32) * normed).astype(dtype)
    out = h.astype(mx.float32) + normed.astype(mx.float32)
    if dtype == mx.float16:
        out = mx.clip(out, -F16_MAX, F16_MAX)
    return out.astype(dtype)


def post_residual_ops(
    h: mx.array,
    y: mx.array,
    ms_y: Optional[mx.array],
    post_gain: mx.array,
    eps: float,
    gain: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array, mx.array]:
    """(out, ms, xs) of out = `post_norm_sum(h, y, ms_y, post_gain, eps)`, as
    `block_residual.residual_ops` makes them for its out (gain: the next
    norm's, None where it is folded)."""
    return residual_ops(
        post_norm_sum(h, y, ms_y, post_gain, eps), None, None, eps, gain
    )


def post_residual_norm_ops(h, y, ms_y, post_gain, eps, gain=None) -> mx.array:
    """RMSNorm(`post_norm_sum(...)`) with `gain` (None: folded into the head)."""
    return mx.fast.rms_norm(post_norm_sum(h, y, ms_y, post_gain, eps), gain, eps)


@functools.lru_cache(maxsize=512)
def _plan(shape, dtype, inputs, norm, make_kernel, backend):
    # inputs: the names `_call` gives, which say the form.
    scale_y, has_gain = "ms_y" in inputs, "gain" in inputs
    D = shape[-1]
    nt = min(256, max(32, _common.next_pow2(D) // 4))
    if norm:
        outputs = {"out": (shape, dtype)}
    else:
        outputs = {"out": (shape, dtype), "ms": ((*shape[:-1], 1), mx.float32)}
        if prescaled(dtype) or has_gain:
            outputs["xs"] = (shape, dtype)
    kernel = make_kernel(
        "post_residual",
        POST_RESIDUAL_BODY,
        inputs,
        list(outputs),
        scale_y=scale_y,
        prescale=prescaled(dtype),
        norm=norm,
        gain=has_gain,
    )
    launch = row_launch(shape, dtype, nt, outputs)
    return kernel, launch


def _call(h, y, ms_y, post_gain, eps, gain, norm):
    names, inputs = _common.kernel_inputs(
        ("h", h),
        ("y", y),
        ("ms_y", ms_y),
        ("post_gain", post_gain),
        ("params", _common.consts(float(eps))),
        ("gain", gain),
    )
    kernel, launch = _plan(
        h.shape, h.dtype, names, norm, _common.make_kernel, _common.gpu_backend()
    )
    return kernel(inputs=inputs, **launch)


def post_residual_kernel(h, y, ms_y, post_gain, eps, gain=None):
    outs = _call(h, y, ms_y, post_gain, eps, gain, norm=False)
    return outs[0], outs[1], outs[2] if len(outs) > 2 else outs[0]


def post_residual_norm_kernel(h, y, ms_y, post_gain, eps, gain=None):
    return _call(h, y, ms_y, post_gain, eps, gain, norm=True)[0]


def post_residual(h, y, ms_y, post_gain, eps, gain=None):
    fn = _common.pick("post_residual", post_residual_kernel, post_residual_ops)
    return fn(h, y, ms_y, post_gain, eps, gain)


def post_residual_norm(h, y, ms_y, post_gain, eps, gain=None):
    fn = _common.pick(
        "post_residual_norm", post_residual_norm_kernel, post_residual_norm_ops
    )
    return fn(h, y, ms_y, post_gain, eps, gain)
