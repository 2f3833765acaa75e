"""`qkv_epilogue`: q', k', v' in attention's layout from the fused qkv matmul output.

One pass splits the heads, applies the deferred 1/RMS (and 1/sqrt(h) on q),
RoPE, a q|k|v bias after the scaling (Qwen2) or the QK-norm with its gains in
the rotation (OpenELM, Qwen3): docs/design.md sections 2b to 2e.
"""

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from ..mlx_lm_compat import rope_freqs
from . import _common
from ._common import deferred_scale, pow2_prescale, prescaled
from .render import TREE_SUM

Offset = Union[int, mx.array]

QKV_EPILOGUE_BODY = (
    """\
  // qkv (B, L, NH * HD) -> q (B, HQ, L, HD), k and v (B, HKV, L, HD), HD = 2 * HALF.
  // One threadgroup of HALF threads per (token, head). RoPE rotates the first
  // 2 * RH dims, pairs (i, i + RH) as mx.fast.rope pairs them; the rest pass
  // through at angle 0 (docs/design.md section 2e). Thread `lane` owns dims
  // j1, j2: the pair (lane, lane + RH) if lane < RH, else two pass-through dims.
  const int lane = FN_LANE;
  const int group = FN_GROUP;
  const int NH = HQ + 2 * HKV;
  const int HD = 2 * HALF;
  const int L = qkv_shape[1];
  const int head = group % NH;
  const int token = group / NH;
  const int b = token / L;
  const int l = token - b * L;
  const bool rot = lane < RH;
  const int j1 = rot ? lane : lane + RH;
  const int j2 = rot ? lane + RH : lane + HALF;
  const int src = token * NH * HD + head * HD;
  const float x1 = static_cast<float>(qkv[src + j1]);
  const float x2 = static_cast<float>(qkv[src + j2]);
  const float mst = ms[token];
#if FN_PRESCALE
  // x was pre-scaled by the power of two p: s = rsqrt(ms) / p, 1/s^2 = ms * p^2.
  const float pt = FN_POW2_PRESCALE(mst);
  const float s = FN_RSQRT(mst) / pt;
#if FN_QK_NORM
  const float inv_s2 = mst * pt * pt;
#endif
#else
  const float s = FN_RSQRT(mst);
#if FN_QK_NORM
  const float inv_s2 = mst;
#endif
#endif
#if FN_BIAS
  // A q/k/v bias (Qwen2) comes after the deferred scaling and before RoPE.
  const float b1 = static_cast<float>(bias[head * HD + j1]);
  const float b2 = static_cast<float>(bias[head * HD + j2]);
#else
  const float b1 = 0.0f;
  const float b2 = 0.0f;
#endif
  if (head >= HQ + HKV) {
    const int dst = ((b * HKV + head - HQ - HKV) * L + l) * HD;
    v[dst + j1] = static_cast<T>(x1 * s + b1);
    v[dst + j2] = static_cast<T>(x2 * s + b2);
    return;
  }
  const bool is_q = head < HQ;
#if FN_QK_NORM
  const float m = params[2];
#else
  const float m = params[1];
#endif
  // m: the module's factor on the rotated dims (SuScaledRoPE, YaRN), linear, so
  // it rides with cos and sin; pass-through dims: cos 1, sin 0, no m.
  const float theta =
      rot ? static_cast<float>(offset[b * OFS] + l) * inv_freq[lane] : 0.0f;
  const float c = rot ? FN_COS(theta) * m : 1.0f;
  const float sn = rot ? FN_SIN(theta) * m : 0.0f;
#if FN_QK_NORM
  // rms_norm(s * y, eps) = y * rsqrt(mean(y^2) + eps / s^2): s cancels and only
  // the epsilon changes. The gains (1/sqrt(h) in q's) go with cos and sin.
  FN_SHARED float red[RP];
  red[lane] = x1 * x1 + x2 * x2;
"""
    + TREE_SUM
    + """\
  const float eps = is_q ? params[0] : params[1];
  const float r = FN_RSQRT(red[0] / static_cast<float>(HD) + eps * inv_s2);
  const float g1 =
      is_q ? static_cast<float>(q_gain[j1]) : static_cast<float>(k_gain[j1]);
  const float g2 =
      is_q ? static_cast<float>(q_gain[j2]) : static_cast<float>(k_gain[j2]);
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
    const int dst = ((b * HQ + head) * L + l) * HD;
    q[dst + j1] = static_cast<T>(o1);
    q[dst + j2] = static_cast<T>(o2);
  } else {
    const int dst = ((b * HKV + head - HQ) * L + l) * HD;
    k[dst + j1] = static_cast<T>(o1);
    k[dst + j2] = static_cast<T>(o2);
  }
"""
)


class RopeAngles(NamedTuple):
    """What the fused epilogue needs of a RoPE module (docs/design.md section 2e):
    inv_freq (dims/2,) float32, the angle per position of each rotary pair;
    dims, the rotated dims R (pairs (i, i + R/2), the first R dims of a head,
    the rest passed through); mscale, the factor the module puts on those R
    dims before rotating them (SuScaledRoPE's, YaRN's), 1.0 for the others."""

    inv_freq: mx.array
    dims: int
    mscale: float = 1.0


def rope_angles(rope: nn.Module, head_dim: int) -> Optional[RopeAngles]:
    """The `RopeAngles` of an mlx-lm RoPE module, or None where the epilogue
    cannot reproduce it: the interleaved (traditional) layout, or a module it
    does not know (its angles could depend on the offset, e.g. dynamic NTK)."""
    if getattr(rope, "traditional", False):
        return None
    if type(rope) is nn.RoPE:
        dims = rope.dims
        if not (0 < dims <= head_dim and dims % 2 == 0):
            return None
        return _plain_angles(dims, float(rope.base), float(rope.scale))
    scaled = rope_freqs(rope)  # mlx-lm's scaled modules (Llama 3, YaRN, SuScaled)
    if scaled is None:
        return None
    freqs, mscale, dims = scaled
    if not (0 < dims <= head_dim and dims % 2 == 0) or freqs.shape != (dims // 2,):
        return None
    return RopeAngles(mx.reciprocal(freqs.astype(mx.float32)), dims, mscale)


@functools.lru_cache(maxsize=None)
def _plain_angles(dims: int, base: float, scale: float) -> RopeAngles:
    # One object per RoPE config, shared by every layer, so `_rope_tables` hits.
    half = dims // 2
    # mx.fast.rope's own float32 formula; nn.RoPE's scale multiplies positions.
    inv = mx.exp(mx.arange(half, dtype=mx.float32) * (-math.log(base) / half))
    return RopeAngles(inv if scale == 1.0 else inv * scale, dims)


class _LastTables:
    """The last cos/sin tables made. Every layer of a decode step asks for the
    same (angles, head_dim, offset, L), and on the CPU each op costs more than
    its arithmetic. One entry that holds its keys, so a hit is that very
    inv_freq and offset (an array offset: a compiled step's position, a batch's
    offsets, the same object in every layer of one step) with the same rotated
    dims, mscale and head width; tables depend on no weight, and layers share
    an inv_freq only where their RoPE is the same."""

    def __init__(self):
        self.last = None

    def __call__(self, offset: Offset, L: int, angles: RopeAngles, head_dim: int):
        last = self.last
        if (
            last is not None
            and last[0] is angles.inv_freq
            and last[1] == (angles.dims, angles.mscale, head_dim, L)
            and (last[2] is offset or _same_int(last[2], offset))
        ):
            return last[3], last[4]
        cos, sin = _compute_rope_tables(offset, L, angles, head_dim)
        key = (angles.dims, angles.mscale, head_dim, L)
        self.last = (angles.inv_freq, key, offset, cos, sin)
        return cos, sin


def _same_int(a, b) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a == b


# cos, sin of (offset + l) * inv_freq, float32: (L, h) or (B, 1, L, h).
_rope_tables = _LastTables()


def _compute_rope_tables(offset: Offset, L: int, angles: RopeAngles, head_dim: int):
    """Full-width [cos, cos, 1] * m and [-sin, sin, 0] * m (rotate_half's sign
    folded in, 1 and 0 on the pass-through dims), so RoPE(y) = y * cos_t +
    swap_halves(y, R) * sin_t: few ops, which the CPU rewards."""
    inv_freq, dims, m = angles
    pos = mx.arange(L, dtype=mx.float32)
    if isinstance(offset, mx.array) and offset.size > 1:
        pos = (pos + offset.reshape(-1, 1, 1)).reshape(-1, 1, L, 1)
    else:
        pos = (pos + offset)[:, None]
    theta = pos * inv_freq
    cos, sin = mx.cos(theta), mx.sin(theta)
    if m != 1.0:  # after cos and sin, as stock scales x before it rotates
        cos, sin = cos * m, sin * m
    cos_t, sin_t = [cos, cos], [-sin, sin]
    if dims < head_dim:
        rest = (*theta.shape[:-1], head_dim - dims)
        cos_t.append(mx.ones(rest, mx.float32))
        sin_t.append(mx.zeros(rest, mx.float32))
    return mx.concatenate(cos_t, axis=-1), mx.concatenate(sin_t, axis=-1)


def _swap_halves(y, dims: Optional[int] = None):
    # The two halves of the first `dims` (default: all) swapped, the rest as is.
    width = y.shape[-1]
    dims = width if dims is None else dims
    half = dims // 2
    parts = [y[..., half:dims], y[..., :half]]
    if dims < width:
        parts.append(y[..., dims:])
    return mx.concatenate(parts, axis=-1)


def _rope(y, cos_t, sin_t, dims: int):
    # Half-split RoPE with float32 tables, as mx.fast.rope computes it (bit for bit:
    # y1*cos - y2*sin and y2*cos + y1*sin, term for term, where m is 1).
    return y * cos_t + _swap_halves(y, dims) * sin_t


def _gain_rope(y, gains, cos_t, sin_t, dims: int):
    # RoPE(y * g) = y * (g*cos) + rotate_half(y) * (swap_halves(g)*sin), half-split:
    # the gain lives in the tables; y itself is never multiplied by it.
    g, swapped = gains  # `Epilogue.rope_gains`: float32 g and swap_halves(g, R)
    return y * (cos_t * g) + _swap_halves(y, dims) * (sin_t * swapped)


@dataclass(frozen=True, eq=False)
class Epilogue:
    """One attention's epilogue settings: the one signature kernel, twin and the
    unfused path share (the tensors of a call come apart: qkv, ms, offset).

    angles: the RoPE, `rope_angles(rope, h)`: angles per position, rotated dims
    R and input factor m (RoPE below rotates the first R dims of a head by
    those angles, times m, and passes the rest through); None where the fused
    path cannot reproduce `rope` (then the model's own module runs).
    Llama form (no gains): q' = RoPE(q) * s * scale (default h**-0.5),
        k' = RoPE(k) * s,  v' = v * s; with a q|k|v `bias` ((Hq+2Hkv)h,), added
        after the deferred scaling: q' = RoPE(q * s + bq) * scale, k', v' alike.
    QK-norm form (q_gain, k_gain (h,), 1/sqrt(h) folded into q_gain by the caller):
        q' = RoPE(rms_norm(s * q, eps_q) * q_gain), k' likewise, v' = v * s.
    """

    n_heads: int
    n_kv_heads: int
    angles: Optional[RopeAngles]
    rope: Optional[nn.Module] = None
    scale: Optional[float] = None
    bias: Optional[mx.array] = None
    q_gain: Optional[mx.array] = None
    k_gain: Optional[mx.array] = None
    eps_q: float = 0.0
    eps_k: float = 0.0

    def __post_init__(self):
        if self.bias is not None and self.q_gain is not None:
            raise ValueError("qkv_epilogue: a q/k/v bias with QK-norm is not supported")
        a = self.angles
        if a is not None and (a.dims % 2 or a.inv_freq.shape != (a.dims // 2,)):
            raise ValueError(
                f"qkv_epilogue: {a.inv_freq.shape} angles for {a.dims} dims"
            )

    @property
    def inv_freq(self) -> Optional[mx.array]:
        """The angles per position, None where the model's own RoPE module runs."""
        return None if self.angles is None else self.angles.inv_freq

    @property
    def rope_dims(self) -> Optional[int]:
        """The rotated dims R (None: the model's own module decides)."""
        return None if self.angles is None else self.angles.dims

    def form(self) -> tuple:
        """What selects a kernel's form beside the dtypes (the first-use check's
        key): which optional inputs are given, and the rotated dims."""
        nones = (self.bias is None, self.q_gain is None, self.angles is None)
        return (*nones, self.rope_dims)

    def q_scale(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else float(self.scale)

    def rope_gains(self, i: int) -> Tuple[mx.array, mx.array]:
        """(g, swap_halves(g, R)) in float32 of the QK-norm gain i (0: q, 1: k),
        the twins' RoPE-with-gain factors. Made once per Epilogue, which its
        attention rebuilds whenever a gain array is replaced (loading, a cast),
        so no other model's gains and no stale ones are ever read; not kept
        when made inside a trace (a trace must never leave arrays behind)."""
        held = self.__dict__.get("_rope_gains")  # frozen: state set directly
        if held is not None:
            return held[i]
        made = tuple(
            (g32, _swap_halves(g32, self.rope_dims))
            for g32 in (g.astype(mx.float32) for g in (self.q_gain, self.k_gain))
        )
        if not _common.is_tracing():
            mx.eval(made)
            self.__dict__["_rope_gains"] = made
        return made[i]


def _epilogue_math(qkv, ms, e: Epilogue, rope, gain_rope):
    """The epilogue in float32 plain ops, RoPE given as `rope(y)` and
    `gain_rope(y, i)` = RoPE(y * g_i), g_0 = q_gain and g_1 = k_gain: the
    twin's and the unfused path's body."""
    B, L, _ = qkv.shape
    heads = e.n_heads + 2 * e.n_kv_heads
    h = qkv.shape[-1] // heads
    dtype = qkv.dtype
    s = deferred_scale(ms, dtype)
    # float32 math as the kernel does it; one cast here (none for float32 input)
    # rather than one per mixed-dtype product.
    x = qkv.astype(mx.float32).reshape(B, L, heads, h)
    if e.bias is not None:
        # The bias comes after the deferred scaling: s is applied here, once.
        x = x * s[..., None] + e.bias.astype(mx.float32).reshape(heads, h)
    x = x.transpose(0, 2, 1, 3)
    q, k, v = mx.split(x, [e.n_heads, e.n_heads + e.n_kv_heads], axis=1)
    s = s[:, None]  # (B, 1, L, 1)
    if e.bias is not None:
        q = rope(q) * e.q_scale(h)
        return q.astype(dtype), rope(k).astype(dtype), v.astype(dtype)
    if e.q_gain is None:
        q = rope(q) * (s * e.q_scale(h))
        k = rope(k) * s
    else:
        # The incoming s cancels in the QK-norm; only its epsilon scales by 1/s^2.
        # 1/s^2 = ms * p^2, exactly (p a power of two).
        p = pow2_prescale(ms) if prescaled(dtype) else None
        inv_s2 = ms[:, None] if p is None else ms[:, None] * (p * p)[:, None]
        q = q * mx.rsqrt(mx.mean(q * q, axis=-1, keepdims=True) + e.eps_q * inv_s2)
        k = k * mx.rsqrt(mx.mean(k * k, axis=-1, keepdims=True) + e.eps_k * inv_s2)
        q, k = gain_rope(q, 0), gain_rope(k, 1)
    return q.astype(dtype), k.astype(dtype), (v * s).astype(dtype)


def qkv_epilogue_ops(
    qkv: mx.array, ms: mx.array, offset: Offset, e: Epilogue
) -> Tuple[mx.array, mx.array, mx.array]:
    """q', k', v' in (B, H, L, h) from the fused qkv matmul output (B, L, (Hq+2Hkv)h).

    ms (B, L, 1) float32 is mean(x^2) + eps of the block input x; the deferred
    scalar is s = `deferred_scale(ms)` (in float16 x came pre-scaled by
    `pow2_prescale(ms)`). RoPE (half-split) angle at position offset + l is
    (offset + l) * e.angles.inv_freq, offset an int or a (B,) array, on the first
    e.angles.dims dims, times e.angles.mscale. Forms: `Epilogue`.
    """
    h = qkv.shape[-1] // (e.n_heads + 2 * e.n_kv_heads)
    _check_dims(e.angles, h)
    cos, sin = _rope_tables(offset, qkv.shape[1], e.angles, h)
    R = e.angles.dims
    return _epilogue_math(
        qkv,
        ms,
        e,
        lambda y: _rope(y, cos, sin, R),
        lambda y, i: _gain_rope(y, e.rope_gains(i), cos, sin, R),
    )


def _check_dims(angles: RopeAngles, head_dim: int) -> None:
    if angles.dims > head_dim:
        raise ValueError(
            f"qkv_epilogue: {angles.dims} rotary dims, head_dim {head_dim}"
        )


def qkv_epilogue_unfused(
    qkv: mx.array, ms: mx.array, offset: Offset, e: Epilogue
) -> Tuple[mx.array, mx.array, mx.array]:
    """The same outputs through the model's own RoPE module `e.rope`, for the
    RoPE kinds the fused path does not reproduce (interleaved pairs, a module
    `rope_angles` does not know): RoPE(y * g) with the QK-norm gain applied first."""

    def rope(y):
        return e.rope(y, offset=offset)

    return _epilogue_math(qkv, ms, e, rope, lambda y, i: rope(y * e.rope_gains(i)[0]))


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
    qkv: mx.array, ms: mx.array, offset: Offset, e: Epilogue
) -> Tuple[mx.array, mx.array, mx.array]:
    offset = _offset_array(offset)
    h = qkv.shape[-1] // (e.n_heads + 2 * e.n_kv_heads)
    m = e.angles.mscale
    if e.q_gain is not None:  # QK-norm form (an Epilogue has no bias with it)
        form = [("q_gain", e.q_gain), ("k_gain", e.k_gain)]
        form.append(("params", _common.consts(e.eps_q, e.eps_k, m)))
    else:
        form = [("params", _common.consts(e.q_scale(h), m)), ("bias", e.bias)]
    names, inputs = _common.kernel_inputs(
        ("qkv", qkv),
        ("ms", ms),
        ("offset", offset),
        ("inv_freq", e.angles.inv_freq),
        *form,
    )
    kernel, launch = _epilogue_plan(
        qkv.shape,
        qkv.dtype,
        e.n_heads,
        e.n_kv_heads,
        e.angles.dims,
        names,
        offset.size > 1,
        _common.make_kernel,
        _common.gpu_backend(),
    )
    return tuple(kernel(inputs=inputs, **launch))


@functools.lru_cache(maxsize=512)
def _epilogue_plan(
    shape,
    dtype,
    n_heads,
    n_kv_heads,
    rope_dims,
    inputs,
    per_batch,
    make_kernel,
    backend,
):
    # inputs: the names `qkv_epilogue_kernel` gives, which say the form.
    qk_norm, has_bias = "q_gain" in inputs, "bias" in inputs
    B, L, _ = shape
    heads = n_heads + 2 * n_kv_heads
    h = shape[-1] // heads
    half = h // 2
    if not 0 <= rope_dims <= h:
        raise ValueError(f"qkv_epilogue: {rope_dims} rotary dims, head_dim {h}")
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
    # RH: half the rotated dims, the kernel's pairing (lane, lane + RH).
    template += [("OFS", int(per_batch)), ("RH", rope_dims // 2)]
    if qk_norm:  # the per-head reduction: NT threads, shared array of RP floats
        template += [("NT", half), ("RP", _common.next_pow2(half))]
    q_shape, kv_shape = (B, n_heads, L, h), (B, n_kv_heads, L, h)
    launch = dict(
        template=template,
        grid=(B * L * heads * half, 1, 1),
        threadgroup=(half, 1, 1),
        output_shapes=[q_shape, kv_shape, kv_shape],
        output_dtypes=[dtype] * 3,
    )
    return kernel, launch


def qkv_epilogue(qkv: mx.array, ms: mx.array, offset: Offset, e: Epilogue):
    if e.angles is None:  # a RoPE kind only the model's module computes
        return qkv_epilogue_unfused(qkv, ms, offset, e)
    fn = _common.pick("qkv_epilogue", qkv_epilogue_kernel, qkv_epilogue_ops)
    return fn(qkv, ms, offset, e)
