"""The deferred-scaling ops FlashNorm models call, as custom kernels and plain ops.

Each op `<op>` is what the models call: it picks `<op>_kernel` (one `mx.fast`
kernel launch) where a Metal or CUDA backend runs it, else `<op>_ops`, its
plain-MLX twin with the same signature. FLASHNORM_KERNELS=0 forces the twins;
FLASHNORM_KERNELS=op1,op2 enables only those kernels (for measuring one at a time).

On Metal and CUDA a decode step costs about 10 µs per launched primitive
(DESIGN.md 4a), so the ops are cut along launches, not along the math: a block
is qkv matmul -> `qkv_epilogue` -> cache -> attention -> o_proj -> `residual`
-> gate/up matmul -> `deferred_glu` -> down matmul -> `residual`. Every small
piece of math (rsqrt, the float16 power-of-two prescale, casts) happens inside
those kernels: they take ms = mean(x^2) + eps, never a precomputed s.

float16 prescale: wherever the compute dtype is float16, the residual x reaches
the matmuls as x * p with p = `pow2_prescale(ms)`, an exact power of two near
1/RMS, and the deferred scalar is s = rsqrt(ms) / p. Every op derives p from ms
with the same integer arithmetic on its exponent bits, so producer and consumer
agree bit for bit on every backend.

Each kernel body is written once, below, in a small dialect: FN_* macros for
thread indices, shared memory, barriers and math, `T` for the output type, and
`#if FN_<FLAG>` for render-time variants. `render` puts a per-backend prelude
that defines those macros in front of the body; the result is the `source` of
`mx.fast.metal_kernel` or `mx.fast.cuda_kernel` (created lazily, once, since
creating a cuda_kernel raises on a build without CUDA). All kernel arithmetic
is float32; outputs take the input dtype.
"""

import functools
import math
import os
from typing import Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

Offset = Union[int, mx.array]

# --- rendering -----------------------------------------------------------------

BODY_MARK = "// ---- body ----\n"

# Metal finds thread attributes by name in the source, so they must appear here.
PRELUDES = {
    "metal": """\
#define FN_LANE ((int)thread_position_in_threadgroup.x)
#define FN_GROUP ((int)threadgroup_position_in_grid.x)
#define FN_GLOBAL ((int)thread_position_in_grid.x)
#define FN_SHARED threadgroup
#define FN_SYNC() threadgroup_barrier(mem_flags::mem_threadgroup)
#define FN_RSQRT(x) metal::precise::rsqrt(x)
#define FN_EXP(x) metal::precise::exp(x)
#define FN_COS(x) metal::precise::cos(x)
#define FN_SIN(x) metal::precise::sin(x)
#define FN_AS_INT(x) as_type<int>(x)
#define FN_AS_FLOAT(x) as_type<float>(x)
""",
    "cuda": """\
#define FN_LANE ((int)threadIdx.x)
#define FN_GROUP ((int)blockIdx.x)
#define FN_GLOBAL ((int)(blockIdx.x * blockDim.x + threadIdx.x))
#define FN_SHARED __shared__
#define FN_SYNC() __syncthreads()
#define FN_RSQRT(x) rsqrtf(x)
#define FN_EXP(x) expf(x)
#define FN_COS(x) cosf(x)
#define FN_SIN(x) sinf(x)
#define FN_AS_INT(x) __float_as_int(x)
#define FN_AS_FLOAT(x) __int_as_float(x)
""",
}

# Backend-independent helpers, after the prelude. p = 2^-floor(e/2) for
# ms = m * 2^e (m in [1, 2), ms > 0), from the float32 exponent bits: the same
# integers as `pow2_prescale`, so s = rsqrt(ms) / p lies in (0.5, 1].
COMMON = """\
#define FN_POW2_PRESCALE(ms) \\
  FN_AS_FLOAT((255 - (((FN_AS_INT(ms) >> 23) & 0xff) + 129) / 2) << 23)
"""


def render(body: str, backend: str, **flags: bool) -> str:
    """Kernel source for `backend`: prelude, helpers, `#define FN_<FLAG> 0|1`, body."""
    defines = "".join(
        f"#define FN_{name.upper()} {int(bool(value))}\n"
        for name, value in sorted(flags.items())
    )
    return PRELUDES[backend] + COMMON + defines + BODY_MARK + body


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _available_backend() -> Optional[str]:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def _gpu_backend() -> Optional[str]:
    """The build's GPU backend ("metal", "cuda") if arrays go to the GPU, else None."""
    available = _available_backend()
    return available if available and mx.default_device() == mx.gpu else None


def backend(op: Optional[str] = None) -> Optional[str]:
    """Where `op`'s kernel would run now: "metal", "cuda" or None (use the twin).

    FLASHNORM_KERNELS=0 turns every kernel off; a comma list of op names turns
    on only those.
    """
    if not _enabled(os.environ.get("FLASHNORM_KERNELS", "1"), op):
        return None
    return _gpu_backend()


@functools.lru_cache(maxsize=64)
def _enabled(env: str, op: Optional[str]) -> bool:
    # Parsed once per setting: every op call of a decode step asks.
    env = env.strip()
    if env == "0":
        return False
    return op is None or env in ("", "1") or op in env.split(",")


def pick(op: str, kernel, ops):
    """The picker: `kernel` where a Metal or CUDA backend runs it now, else `ops`."""
    return kernel if backend(op) is not None else ops


@functools.cache
def _make_kernel(name: str, backend_name: str, body: str, inputs, outputs, flags):
    source = render(body, backend_name, **dict(flags))
    make = mx.fast.metal_kernel if backend_name == "metal" else mx.fast.cuda_kernel
    variant = "".join(f"_{k}{int(v)}" for k, v in flags)
    return make(
        name=f"flashnorm_{name}{variant}",
        input_names=list(inputs),
        output_names=list(outputs),
        source=source,
    )


def _kernel(name: str, body: str, inputs, outputs, **flags):
    b = _gpu_backend()
    if b is None:
        raise RuntimeError(
            f"{name}_kernel needs a Metal or CUDA backend; use {name}_ops"
        )
    return _make_kernel(
        name, b, body, tuple(inputs), tuple(outputs), tuple(sorted(flags.items()))
    )


@functools.cache
def _consts(*values: float) -> mx.array:
    # Float parameters travel as a small float32 array (templates take ints only).
    return mx.array(values, dtype=mx.float32)


# Tree sum over the NT threads of a threadgroup into red[0] (RP: a power of
# two >= NT). Every thread of the group must reach it: no early return before.
_TREE_SUM = """\
  for (int stride = RP / 2; stride > 0; stride /= 2) {
    FN_SYNC();
    if (lane < stride && lane + stride < NT) {
      red[lane] += red[lane + stride];
    }
  }
  FN_SYNC();
"""

# --- float16 prescale and the deferred scalar ------------------------------------


def pow2_prescale(ms: mx.array) -> mx.array:
    """p = 2^-floor(log2(ms) / 2) near 1/RMS, float32 like ms (B, L, 1).

    float16 has too little range for x @ W* with an unnormalized x; scaling x by a
    power of two is exact, so x*p goes through the matmuls and s/p in (0.5, 1]
    comes after. Integer math on ms's exponent bits (ms > 0), the same as the
    kernels' FN_POW2_PRESCALE: exact on every backend, unlike pow/exp/round.
    """
    biased = mx.right_shift(ms.view(mx.int32), 23)
    return mx.left_shift(255 - (biased + 129) // 2, 23).view(mx.float32)


def prescaled(dtype: mx.Dtype) -> bool:
    """Whether activations of this dtype reach the matmuls as x * p (float16 only:
    bfloat16 and float32 have float32's range)."""
    return dtype == mx.float16


def deferred_scale(ms: mx.array, dtype: mx.Dtype) -> mx.array:
    """The deferred scalar s = rsqrt(ms), divided by p where `prescaled(dtype)`."""
    s = mx.rsqrt(ms)
    return s / pow2_prescale(ms) if prescaled(dtype) else s


# --- residual: the block's sum, its mean square and the next matmul's input -------

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
    + _TREE_SUM
    + """\
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
#if FN_PRESCALE
  const float p = FN_POW2_PRESCALE(msr);
#else
  const float p = 1.0f;
#endif
#if FN_GAIN
  // The next norm's gain, applied where the row the next matmul reads is formed
  // (unfolded weights, e.g. a quantized checkpoint as stored).
  for (int i = lane; i < D; i += NT) {
    xs[base + i] = static_cast<T>(FN_ROW(i) * static_cast<float>(gain[i]) * p);
  }
#elif FN_PRESCALE
  for (int i = lane; i < D; i += NT) {
    xs[base + i] = static_cast<T>(FN_ROW(i) * p);
  }
#endif
#endif
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
def _residual_plan(shape, dtype, has_y, scale_y, norm, has_gain, make_kernel, backend):
    """(kernel, launch keywords, output names) for one call signature, built once:
    a decode step makes this call twice per block, and at ~10 µs a launch the
    Python around it must stay small. Keyed on the kernel factory and backend
    too, so tests that swap either get fresh plans."""
    D = shape[-1]
    nt = min(256, max(32, _next_pow2(D) // 4))
    inputs = ["h"] + ["y"] * has_y + ["ms_y"] * scale_y + ["params"]
    inputs += ["gain"] * has_gain
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
    launch = dict(
        template=[("T", dtype), ("D", D), ("NT", nt), ("RP", nt)],
        grid=(math.prod(shape[:-1]) * nt, 1, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[s for s, _ in outputs.values()],
        output_dtypes=[d for _, d in outputs.values()],
    )
    return kernel, launch, tuple(outputs)


def _residual_call(h, y, ms_y, eps, norm, gain=None):
    # The kernel indexes rows of D in flat memory: no reshapes needed.
    kernel, launch, names = _residual_plan(
        h.shape,
        h.dtype,
        y is not None,
        ms_y is not None,
        norm,
        gain is not None,
        _kernel,
        _gpu_backend(),
    )
    inputs = [h]
    if y is not None:
        inputs.append(y)
    if ms_y is not None:
        inputs.append(ms_y)
    inputs.append(_consts(float(eps)))
    if gain is not None:
        inputs.append(gain)
    return dict(zip(names, kernel(inputs=inputs, **launch)))


def residual_kernel(h, y, ms_y, eps, gain=None):
    r = _residual_call(h, y, ms_y, eps, norm=False, gain=gain)
    out = r.get("out", h)
    return out, r["ms"], r.get("xs", out)


def residual(h, y, ms_y, eps, gain=None):
    return pick("residual", residual_kernel, residual_ops)(h, y, ms_y, eps, gain)


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
    return _residual_call(h, y, ms_y, eps, norm=True, gain=gain)["out"]


def residual_norm(h, y, ms_y, eps, gain=None):
    fn = pick("residual_norm", residual_norm_kernel, residual_norm_ops)
    return fn(h, y, ms_y, eps, gain)


# --- deferred GLU ----------------------------------------------------------------

DEFERRED_GLU_BODY = """\
  // out = silu(s * gate) * up; gate_up (B, L, 2F) = [gate | up], s from ms (B, L, 1).
  const int i = FN_GLOBAL;
  if (i >= gate_up_shape[0] * gate_up_shape[1] * F) {
    return;
  }
  const int row = i / F;
  const int col = i - row * F;
  const float msr = ms[row];
#if FN_PRESCALE
  const float s = FN_RSQRT(msr) / FN_POW2_PRESCALE(msr);
#else
  const float s = FN_RSQRT(msr);
#endif
  const float g = static_cast<float>(gate_up[row * 2 * F + col]) * s;
  const float u = static_cast<float>(gate_up[row * 2 * F + F + col]);
  out[i] = static_cast<T>(g / (1.0f + FN_EXP(-g)) * u);
"""


def deferred_glu_ops(gate_up: mx.array, ms: mx.array) -> mx.array:
    """silu(s * gate) * up from the fused (B, L, 2F) gate/up output -> (B, L, F),
    s = `deferred_scale(ms)`. The second s (on up) is deferred past the down
    projection: the caller's `residual` applies it."""
    gate, up = mx.split(gate_up, 2, axis=-1)
    g = gate * deferred_scale(ms, gate_up.dtype)
    return (g * mx.sigmoid(g) * up).astype(gate_up.dtype)


@functools.lru_cache(maxsize=512)
def _glu_plan(shape, dtype, make_kernel, backend):
    F = shape[-1] // 2
    B, L, _ = shape
    kernel = make_kernel(
        "deferred_glu",
        DEFERRED_GLU_BODY,
        ["gate_up", "ms"],
        ["out"],
        prescale=prescaled(dtype),
    )
    launch = dict(
        template=[("T", dtype), ("F", F)],
        grid=(B * L * F, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(*shape[:-1], F)],
        output_dtypes=[dtype],
    )
    return kernel, launch


def deferred_glu_kernel(gate_up: mx.array, ms: mx.array) -> mx.array:
    # gate_up (B, L, 2F), ms (B, L, 1): the kernel indexes them in flat memory.
    kernel, launch = _glu_plan(gate_up.shape, gate_up.dtype, _kernel, _gpu_backend())
    return kernel(inputs=[gate_up, ms], **launch)[0]


def deferred_glu(gate_up: mx.array, ms: mx.array) -> mx.array:
    return pick("deferred_glu", deferred_glu_kernel, deferred_glu_ops)(gate_up, ms)


# --- qkv epilogue --------------------------------------------------------------

QKV_EPILOGUE_BODY = (
    """\
  // qkv (B, L, NH * HD) -> q (B, HQ, L, HD), k and v (B, HKV, L, HD), HD = 2 * HALF.
  // One threadgroup of HALF threads per (token, head); thread `lane` owns the
  // half-split rotary pair (lane, lane + HALF).
  const int lane = FN_LANE;
  const int group = FN_GROUP;
  const int NH = HQ + 2 * HKV;
  const int HD = 2 * HALF;
  const int L = qkv_shape[1];
  const int head = group % NH;
  const int token = group / NH;
  const int b = token / L;
  const int l = token - b * L;
  const int src = token * NH * HD + head * HD + lane;
  const float x1 = static_cast<float>(qkv[src]);
  const float x2 = static_cast<float>(qkv[src + HALF]);
  const float mst = ms[token];
#if FN_PRESCALE
  // x was pre-scaled by the power of two p: s = rsqrt(ms) / p, 1/s^2 = ms * p^2.
  const float pt = FN_POW2_PRESCALE(mst);
  const float s = FN_RSQRT(mst) / pt;
  const float inv_s2 = mst * pt * pt;
#else
  const float s = FN_RSQRT(mst);
  const float inv_s2 = mst;
#endif
#if FN_BIAS
  // A q/k/v bias (Qwen2) comes after the deferred scaling and before RoPE.
  const float b1 = static_cast<float>(bias[head * HD + lane]);
  const float b2 = static_cast<float>(bias[head * HD + lane + HALF]);
#else
  const float b1 = 0.0f;
  const float b2 = 0.0f;
#endif
  if (head >= HQ + HKV) {
    const int dst = ((b * HKV + head - HQ - HKV) * L + l) * HD + lane;
    v[dst] = static_cast<T>(x1 * s + b1);
    v[dst + HALF] = static_cast<T>(x2 * s + b2);
    return;
  }
  const bool is_q = head < HQ;
  const float theta = static_cast<float>(offset[b * OFS] + l) * inv_freq[lane];
  const float c = FN_COS(theta);
  const float sn = FN_SIN(theta);
#if FN_QK_NORM
  // rms_norm(s * y, eps) = y * rsqrt(mean(y^2) + eps / s^2): s cancels and only
  // the epsilon changes. The gains (1/sqrt(h) in q's) go with cos and sin.
  FN_SHARED float red[RP];
  red[lane] = x1 * x1 + x2 * x2;
"""
    + _TREE_SUM
    + """\
  const float eps = is_q ? params[0] : params[1];
  const float r = FN_RSQRT(red[0] / static_cast<float>(HD) + eps * inv_s2);
  const int j = lane + HALF;
  const float g1 = is_q ? static_cast<float>(q_gain[lane]) : static_cast<float>(k_gain[lane]);
  const float g2 = is_q ? static_cast<float>(q_gain[j]) : static_cast<float>(k_gain[j]);
  const float y1 = x1 * r;
  const float y2 = x2 * r;
  const float o1 = y1 * (g1 * c) - y2 * (g2 * sn);
  const float o2 = y2 * (g2 * c) + y1 * (g1 * sn);
#elif FN_BIAS
  const float y1 = x1 * s + b1;
  const float y2 = x2 * s + b2;
  const float qs = is_q ? params[0] : 1.0f;
  const float o1 = (y1 * c - y2 * sn) * qs;
  const float o2 = (y1 * sn + y2 * c) * qs;
#else
  // RoPE is linear per token: s (and q's 1/sqrt(h) in params[0]) ride along.
  const float scale = is_q ? s * params[0] : s;
  const float o1 = (x1 * c - x2 * sn) * scale;
  const float o2 = (x1 * sn + x2 * c) * scale;
#endif
  if (is_q) {
    const int dst = ((b * HQ + head) * L + l) * HD + lane;
    q[dst] = static_cast<T>(o1);
    q[dst + HALF] = static_cast<T>(o2);
  } else {
    const int dst = ((b * HKV + head - HQ) * L + l) * HD + lane;
    k[dst] = static_cast<T>(o1);
    k[dst + HALF] = static_cast<T>(o2);
  }
"""
)


def rope_inv_freq(rope: nn.Module, head_dim: int) -> Optional[mx.array]:
    """(head_dim/2,) float32 angles per position of an mlx-lm RoPE module, or None.

    None where the epilogue cannot reproduce the module: interleaved (traditional)
    layout, partial rotary dims, or a module that also scales its input.
    """
    if getattr(rope, "traditional", False):
        return None
    if type(rope) is nn.RoPE:
        if rope.dims != head_dim:
            return None
        return _plain_inv_freq(head_dim, float(rope.base), float(rope.scale))
    freqs = getattr(rope, "_freqs", None)
    dims = getattr(rope, "dims", getattr(rope, "dim", None))
    if freqs is None or dims != head_dim or freqs.shape != (head_dim // 2,):
        return None
    if getattr(rope, "mscale", 1.0) != 1.0 or getattr(rope, "_scale", 1.0) != 1.0:
        return None
    return mx.reciprocal(freqs.astype(mx.float32))


@functools.lru_cache(maxsize=None)
def _plain_inv_freq(head_dim: int, base: float, scale: float) -> mx.array:
    # One array per RoPE config, shared by every layer, so _rope_tables' cache hits.
    half = head_dim // 2
    # mx.fast.rope's own float32 formula; nn.RoPE's scale multiplies positions.
    inv = mx.exp(mx.arange(half, dtype=mx.float32) * (-math.log(base) / half))
    return inv if scale == 1.0 else inv * scale


# The last (inv_freq, offset, L) tables: every layer of a decode step asks for the
# same ones, and on the CPU each op costs more than its arithmetic.
_last_tables: dict = {}


def _rope_tables(offset: Offset, L: int, inv_freq: mx.array):
    """cos, sin of (offset + l) * inv_freq, float32: (L, h/2) or (B, 1, L, h/2)."""
    if isinstance(offset, int):
        hit = _last_tables.get((offset, L))
        if hit is not None and hit[0] is inv_freq:
            return hit[1], hit[2]
        cos, sin = _compute_rope_tables(offset, L, inv_freq)
        _last_tables.clear()
        _last_tables[(offset, L)] = (inv_freq, cos, sin)
        return cos, sin
    return _compute_rope_tables(offset, L, inv_freq)


def _compute_rope_tables(offset: Offset, L: int, inv_freq: mx.array):
    """Full-width [cos, cos] and [-sin, sin] (rotate_half's sign folded in), so
    RoPE(y) = y * cos_t + swap_halves(y) * sin_t: few ops, which the CPU rewards."""
    pos = mx.arange(L, dtype=mx.float32)
    if isinstance(offset, mx.array) and offset.size > 1:
        pos = (pos + offset.reshape(-1, 1, 1)).reshape(-1, 1, L, 1)
    else:
        pos = (pos + offset)[:, None]
    theta = pos * inv_freq
    cos, sin = mx.cos(theta), mx.sin(theta)
    return mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1)


def _swap_halves(y):
    half = y.shape[-1] // 2
    return mx.concatenate([y[..., half:], y[..., :half]], axis=-1)


def _rope(y, cos_t, sin_t):
    # Half-split RoPE with float32 tables, as mx.fast.rope computes it (bit for bit:
    # y1*cos - y2*sin and y2*cos + y1*sin, term for term).
    return y * cos_t + _swap_halves(y) * sin_t


# The last gain's swap_halves: a model passes the same gain array every step.
_last_swapped: dict = {}


def _gain_rope(y, gain, cos_t, sin_t):
    # RoPE(y * g) = y * (g*cos) + rotate_half(y) * (swap_halves(g)*sin), half-split:
    # the gain lives in the tables; y itself is never multiplied by it.
    g = gain.astype(mx.float32)
    hit = _last_swapped.get(id(gain))
    if hit is None or hit[0] is not gain:
        if len(_last_swapped) > 256:
            _last_swapped.clear()
        hit = _last_swapped[id(gain)] = (gain, _swap_halves(g))
    return y * (cos_t * g) + _swap_halves(y) * (sin_t * hit[1])


def qkv_epilogue_ops(
    qkv: mx.array,
    ms: mx.array,
    offset: Offset,
    inv_freq: mx.array,
    n_heads: int,
    n_kv_heads: int,
    *,
    scale: Optional[float] = None,
    bias: Optional[mx.array] = None,
    q_gain: Optional[mx.array] = None,
    k_gain: Optional[mx.array] = None,
    eps_q: float = 0.0,
    eps_k: float = 0.0,
) -> Tuple[mx.array, mx.array, mx.array]:
    """q', k', v' in (B, H, L, h) from the fused qkv matmul output (B, L, (Hq+2Hkv)h).

    ms (B, L, 1) float32 is mean(x^2) + eps of the block input x; the deferred
    scalar is s = `deferred_scale(ms)` (in float16 x came pre-scaled by
    `pow2_prescale(ms)`). RoPE (half-split) angle at position offset + l is
    (offset + l) * inv_freq, offset an int or a (B,) array.
    Llama mode (no gains):  q' = RoPE(q) * s * scale (scale default h**-0.5),
        k' = RoPE(k) * s,  v' = v * s; with a q|k|v `bias` ((Hq+2Hkv)h,), added
        after the deferred scaling: q' = RoPE(q * s + bq) * scale, k', v' alike.
    OpenELM mode (q_gain, k_gain (h,), 1/sqrt(h) folded into q_gain by the caller):
        q' = RoPE(rms_norm(s * q, eps_q) * q_gain), k' likewise, v' = v * s.
    """
    B, L, _ = qkv.shape
    heads = n_heads + 2 * n_kv_heads
    h = qkv.shape[-1] // heads
    dtype = qkv.dtype
    s = deferred_scale(ms, dtype)
    # float32 math as the kernel does it; one cast here (none for float32 input)
    # rather than one per mixed-dtype product.
    x = qkv.astype(mx.float32).reshape(B, L, heads, h)
    if bias is not None:
        # The bias comes after the deferred scaling: s is applied here, once.
        _check_bias_mode(q_gain)
        x = x * s[..., None] + bias.astype(mx.float32).reshape(heads, h)
    x = x.transpose(0, 2, 1, 3)
    q, k, v = mx.split(x, [n_heads, n_heads + n_kv_heads], axis=1)
    s = s[:, None]  # (B, 1, L, 1)
    cos, sin = _rope_tables(offset, L, inv_freq)
    if bias is not None:
        scale = h**-0.5 if scale is None else scale
        q = (_rope(q, cos, sin) * scale).astype(dtype)
        return q, _rope(k, cos, sin).astype(dtype), v.astype(dtype)
    if q_gain is None:
        scale = h**-0.5 if scale is None else scale
        q = (_rope(q, cos, sin) * (s * scale)).astype(dtype)
        k = (_rope(k, cos, sin) * s).astype(dtype)
    else:
        # The incoming s cancels in the QK-norm; only its epsilon scales by 1/s^2.
        # 1/s^2 = ms * p^2, exactly (p a power of two).
        p = pow2_prescale(ms) if prescaled(dtype) else None
        inv_s2 = ms[:, None] if p is None else ms[:, None] * (p * p)[:, None]
        q = q * mx.rsqrt(mx.mean(q * q, axis=-1, keepdims=True) + eps_q * inv_s2)
        k = k * mx.rsqrt(mx.mean(k * k, axis=-1, keepdims=True) + eps_k * inv_s2)
        q = _gain_rope(q, q_gain, cos, sin).astype(dtype)
        k = _gain_rope(k, k_gain, cos, sin).astype(dtype)
    v = (v * s).astype(dtype)
    return q, k, v


def _offset_array(offset: Offset) -> mx.array:
    if isinstance(offset, mx.array):
        offset = offset.reshape(-1)
        return offset if offset.dtype == mx.int32 else offset.astype(mx.int32)
    return _int_offset_array(offset)


@functools.lru_cache(maxsize=4)
def _int_offset_array(offset: int) -> mx.array:
    # Every layer of a step asks for the same offset: one host array per step.
    return mx.array([offset], dtype=mx.int32)


def qkv_epilogue_kernel(
    qkv: mx.array,
    ms: mx.array,
    offset: Offset,
    inv_freq: mx.array,
    n_heads: int,
    n_kv_heads: int,
    *,
    scale: Optional[float] = None,
    bias: Optional[mx.array] = None,
    q_gain: Optional[mx.array] = None,
    k_gain: Optional[mx.array] = None,
    eps_q: float = 0.0,
    eps_k: float = 0.0,
) -> Tuple[mx.array, mx.array, mx.array]:
    offset = _offset_array(offset)
    qk_norm = q_gain is not None
    if bias is not None:
        _check_bias_mode(q_gain)
    kernel, launch = _epilogue_plan(
        qkv.shape,
        qkv.dtype,
        n_heads,
        n_kv_heads,
        qk_norm,
        bias is not None,
        offset.size > 1,
        _kernel,
        _gpu_backend(),
    )
    if qk_norm:
        inputs = [qkv, ms, offset, inv_freq, q_gain, k_gain, _consts(eps_q, eps_k)]
    else:
        h = qkv.shape[-1] // (n_heads + 2 * n_kv_heads)
        scale = h**-0.5 if scale is None else float(scale)
        inputs = [qkv, ms, offset, inv_freq, _consts(scale)]
        if bias is not None:
            inputs.append(bias)
    return tuple(kernel(inputs=inputs, **launch))


def _check_bias_mode(q_gain):
    if q_gain is not None:
        raise ValueError("qkv_epilogue: a q/k/v bias with QK-norm is not supported")


@functools.lru_cache(maxsize=512)
def _epilogue_plan(
    shape,
    dtype,
    n_heads,
    n_kv_heads,
    qk_norm,
    has_bias,
    per_batch,
    make_kernel,
    backend,
):
    B, L, _ = shape
    heads = n_heads + 2 * n_kv_heads
    h = shape[-1] // heads
    half = h // 2
    inputs = ["qkv", "ms", "offset", "inv_freq"]
    inputs += ["q_gain", "k_gain", "params"] if qk_norm else ["params"]
    inputs += ["bias"] * has_bias
    kernel = make_kernel(
        "qkv_epilogue",
        QKV_EPILOGUE_BODY,
        inputs,
        ["q", "k", "v"],
        qk_norm=qk_norm,
        prescale=prescaled(dtype),
        bias=has_bias,
    )
    template = [("T", dtype), ("HQ", n_heads), ("HKV", n_kv_heads), ("HALF", half)]
    template.append(("OFS", int(per_batch)))
    if qk_norm:  # the per-head reduction: NT threads, shared array of RP floats
        template += [("NT", half), ("RP", _next_pow2(half))]
    q_shape, kv_shape = (B, n_heads, L, h), (B, n_kv_heads, L, h)
    launch = dict(
        template=template,
        grid=(B * L * heads * half, 1, 1),
        threadgroup=(half, 1, 1),
        output_shapes=[q_shape, kv_shape, kv_shape],
        output_dtypes=[dtype] * 3,
    )
    return kernel, launch


def qkv_epilogue(qkv, ms, offset, inv_freq, n_heads, n_kv_heads, **kw):
    fn = pick("qkv_epilogue", qkv_epilogue_kernel, qkv_epilogue_ops)
    return fn(qkv, ms, offset, inv_freq, n_heads, n_kv_heads, **kw)
