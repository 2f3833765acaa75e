"""`decode_attention`: one query per head over the first n positions of a KV buffer.

The compiled engine's decode step (engine.py) attends over the cache's whole fixed
capacity C and must hide the positions past the write offset. As a mask that
costs a launch or more per layer, and on CUDA an array mask leaves MLX's
single-query attention kernel for a slower path (docs/design.md section 3e).
This kernel reads n = offset + 1 from an array instead: positions past it are
never read, and no mask exists.

`scaled_dot_product_attention` is the one attention call of every model the
engine runs, ours and mlx-lm's classes alike (the engine hands it to mlx-lm's
model modules): mlx-lm's own for every cache, `decode_attention` for the
compiled step's fixed-capacity one. So on one engine every variant attends with
the same kernel (docs/design.md section 4c).
"""

import functools

import mlx.core as mx
from mlx_lm.models import base

from . import _common

NT = 256  # threads per (batch, query head); the head dim must not exceed it

# One threadgroup per (batch, query head). Keys are taken NT at a time: thread t
# scores key c0 + t (its whole dot product), the group's max and sum update an
# online softmax, then G = NT / D groups of D threads sum p * v, thread (g, d)
# owning output dim d of keys g, g + G, ... of the chunk; the G partial outputs
# add up at the end. The query is scaled as it is read, in float32, as MLX's own
# single-query attention does (FlashNorm's q' already carries 1/sqrt(h): scale 1).
DECODE_ATTENTION_BODY = """\
  const int lane = FN_LANE;
  const int bh = FN_GROUP;  // b * HQ + query head
  const int b = bh / HQ;
  const int kv_head = (bh - b * HQ) / (HQ / HKV);
  const int C = k_shape[2];
  const int n = offset[0] + 1;
  const int kv_base = (b * HKV + kv_head) * C * D;
  const int G = NT / D;
  const int g = lane / D;
  const int d = lane - g * D;
  FN_SHARED float qs[RP];
  FN_SHARED float p[RP];
  FN_SHARED float red[RP];
  if (lane < D) {
    qs[lane] = static_cast<float>(q[bh * D + lane]) * scale[0];
  }
  float m = -3.0e38f;  // running max, sum and this thread's partial output
  float z = 0.0f;
  float acc = 0.0f;
  for (int c0 = 0; c0 < n; c0 += NT) {
    FN_SYNC();  // qs written; the last chunk's p and red[0] read by everyone
    const int j = c0 + lane;
    float s = -3.0e38f;
    if (j < n) {
      s = 0.0f;
      for (int e = 0; e < D; ++e) {
        s += qs[e] * static_cast<float>(k[kv_base + j * D + e]);
      }
    }
    red[lane] = s;
    for (int stride = RP / 2; stride > 0; stride /= 2) {
      FN_SYNC();
      if (lane < stride && lane + stride < NT && red[lane + stride] > red[lane]) {
        red[lane] = red[lane + stride];
      }
    }
    FN_SYNC();
    const float m_new = red[0] > m ? red[0] : m;
    const float pj = j < n ? FN_EXP(s - m_new) : 0.0f;
    p[lane] = pj;
    FN_SYNC();  // red[0] read by everyone before the sum reuses red
    red[lane] = pj;
    for (int stride = RP / 2; stride > 0; stride /= 2) {
      FN_SYNC();
      if (lane < stride && lane + stride < NT) {
        red[lane] += red[lane + stride];
      }
    }
    FN_SYNC();
    const float corr = FN_EXP(m - m_new);
    z = z * corr + red[0];
    acc *= corr;
    if (g < G) {
      const int last = n - c0 < NT ? n - c0 : NT;
      for (int jj = g; jj < last; jj += G) {
        acc += p[jj] * static_cast<float>(v[kv_base + (c0 + jj) * D + d]);
      }
    }
    m = m_new;
  }
  FN_SYNC();
  p[lane] = acc;  // G partial outputs of D
  FN_SYNC();
  if (lane < D) {
    float o = 0.0f;
    for (int gg = 0; gg < G; ++gg) {
      o += p[gg * D + lane];
    }
    out[bh * D + lane] = static_cast<T>(o / z);
  }
"""


def decode_attention_ops(
    q: mx.array, k: mx.array, v: mx.array, offset: mx.array, scale: float = 1.0
) -> mx.array:
    """softmax(scale q k^T) v over positions 0..offset of k and v (B, Hkv, C, h),
    for q (B, Hq, 1, h): MLX's attention with the rest masked out."""
    mask = (mx.arange(k.shape[2]) <= offset).reshape(1, 1, 1, -1)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@functools.lru_cache(maxsize=16)
def _scale_array(scale: float) -> mx.array:
    # One small constant per scale, not a new array per layer and step.
    return mx.array([scale], dtype=mx.float32)


@functools.lru_cache(maxsize=512)
def _attention_plan(q_shape, kv_heads, dtype, inputs, make_kernel, backend):
    B, Hq, _, D = q_shape
    kernel = make_kernel(
        "decode_attention",
        DECODE_ATTENTION_BODY,
        inputs,
        ["out"],
    )
    launch = dict(
        template=[
            ("T", dtype),
            ("D", D),
            ("HQ", Hq),
            ("HKV", kv_heads),
            ("NT", NT),
            ("RP", NT),
        ],
        grid=(B * Hq * NT, 1, 1),
        threadgroup=(NT, 1, 1),
        output_shapes=[q_shape],
        output_dtypes=[dtype],
    )
    return kernel, launch


def decode_attention_kernel(
    q: mx.array, k: mx.array, v: mx.array, offset: mx.array, scale: float = 1.0
) -> mx.array:
    names, inputs = _common.kernel_inputs(
        ("q", q), ("k", k), ("v", v), ("offset", offset), ("scale", _scale_array(scale))
    )
    kernel, launch = _attention_plan(
        q.shape,
        k.shape[1],
        q.dtype,
        names,
        _common.make_kernel,
        _common.gpu_backend(),
    )
    return kernel(inputs=inputs, **launch)[0]


def decode_attention(
    q: mx.array, k: mx.array, v: mx.array, offset: mx.array, scale: float = 1.0
) -> mx.array:
    if q.shape[2] != 1 or q.shape[3] > NT or k.dtype != q.dtype:
        return decode_attention_ops(q, k, v, offset, scale)
    return _common.pick(
        "decode_attention", decode_attention_kernel, decode_attention_ops
    )(q, k, v, offset, scale)


def scaled_dot_product_attention(
    queries, keys, values, cache, scale: float, mask, sinks=None
):
    """mlx-lm's `scaled_dot_product_attention` (its signature), except over a
    cache that holds whole fixed-capacity buffers and its write position as an
    array (`fixed_capacity`, the compiled engine's step cache): that one is read
    by `decode_attention`, which needs no mask."""
    if getattr(cache, "fixed_capacity", False) and sinks is None:
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            # An additive mask over the whole buffer (DeepSeek's MLA passes its
            # rotary scores as one): positions past the offset masked out.
            live = mx.arange(keys.shape[2]) <= cache.offset
            low = mx.array(mx.finfo(mask.dtype).min, mask.dtype)
            mask = mx.where(live, mask, low)
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask
            )
        return decode_attention(queries, keys, values, cache.offset, scale)
    return base.scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )
