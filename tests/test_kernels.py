"""Deferred-scaling kernels, their plain-MLX twins, the pickers and the renderings.

Three kinds of evidence, against independent references:
- twins (what runs on CPU) vs the unfused model math: mlx-lm's RoPE modules,
  mx.fast.rms_norm, numpy float64;
- kernels vs twins on a real Metal/CUDA backend, where this MLX build has one;
- kernel bodies vs twins everywhere a C++ compiler exists: the CUDA rendering's
  body, with a host prelude instead of the CUDA one, compiled with g++ and run with
  one fiber per GPU thread (barriers and shared memory included), called
  through the real `<op>_kernel` wrappers (inputs, template ints, grid); the
  Metal rendering's whole generated source likewise in tests/test_metal_host.py.
"""

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.rope_utils import SuScaledRoPE, initialize_rope

from flashnorm_mlx import kernels as K
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM

HAS_GPU_KERNELS = mx.metal.is_available() or mx.cuda.is_available()
needs_backend = pytest.mark.skipif(
    not HAS_GPU_KERNELS,
    reason="no Metal or CUDA backend in this MLX build: kernels cannot run here; "
    "twins are tested against the model math",
)
HOST_CXX = shutil.which("g++") or shutil.which("clang++")
needs_cxx = pytest.mark.skipif(
    HOST_CXX is None, reason="no C++ compiler to run the kernel bodies on the CPU"
)

DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
# Max |error| / max |reference| per output: one rounding to the dtype, with room.
TOL = {mx.float32: 2e-6, mx.float16: 1.5e-3, mx.bfloat16: 1.2e-2}

# GQA ratio -> (Hq, Hkv, head_dim, rope_theta, rope_scaling): each ratio also
# brings its own RoPE kind and a head_dim whose half is not a power of two.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
HEADS = {
    1: (4, 4, 64, 10000.0, None),
    2: (4, 2, 24, 500000.0, LLAMA3),
    4: (8, 2, 16, 10000.0, {"type": "linear", "factor": 2.0}),
}
OFFSETS = {"off0": 0, "off5": 5, "per_batch": [3, 11]}
EPS_Q, EPS_K = 0.5, 1e-2  # large eps_q: dropping the eps adjustment would show
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def su_scaled(dims):
    # Past its original length (4096 > 256): the long factors and _scale 1.22.
    return SuScaledRoPE(
        dims,
        max_position_embeddings=4096,
        original_max_position_embeddings=256,
        long_factor=[1.0 + 0.5 * i for i in range(dims // 2)],
    )


# Partial rotary and input-scaled RoPE on head_dim 64 (Hq 4, Hkv 2): the
# rotated dims R and the stock module that rotates them, as the 4th grid value
# in place of a GQA ratio. R = 16 and 48: pass-through dims; SuScaled and YaRN:
# the factor m on the rotated dims (1.22, 1.14); R = 64 with m alone.
PARTIAL_HEADS = (4, 2, 64)
PARTIAL_ROPES = {
    "r16": lambda: nn.RoPE(16, base=10000.0),
    "r32-su": lambda: su_scaled(32),
    "r48-yarn": lambda: initialize_rope(48, 10000.0, False, YARN, 512),
    "r64-su": lambda: su_scaled(64),
}

GRID = [
    pytest.param(dt, L, off, ratio, mode, id=f"{mode}-{dn}-L{L}-{off}-gqa{ratio}")
    for mode in ("llama", "openelm", "qwen2")
    for dn, dt in DTYPES.items()
    for L in (1, 7)
    for off in OFFSETS
    for ratio in HEADS
] + [
    pytest.param(dt, L, off, rope, mode, id=f"{mode}-{dn}-L{L}-{off}-{rope}")
    for mode in ("llama", "openelm", "qwen2")
    for dn, dt in DTYPES.items()
    for L, off in ((1, "per_batch"), (7, "off5"))
    for rope in PARTIAL_ROPES
]


def rel_err(out: mx.array, ref: mx.array) -> float:
    out, ref = out.astype(mx.float32), ref.astype(mx.float32)
    return (mx.abs(out - ref).max() / mx.abs(ref).max()).item()


def make_case(dtype, L, off, ratio, mode, seed=0):
    """ratio: a GQA ratio of HEADS, or a name of PARTIAL_ROPES."""
    if ratio in PARTIAL_ROPES:
        (hq, hkv, h), rope = PARTIAL_HEADS, PARTIAL_ROPES[ratio]()
        seed += 10 + list(PARTIAL_ROPES).index(ratio)
    else:
        hq, hkv, h, theta, scaling = HEADS[ratio]
        rope = initialize_rope(h, theta, False, scaling, 512)
        seed += ratio
    B = 2
    k = mx.random.split(mx.random.key(seed + 7 * L), 4)
    qkv = (mx.random.normal((B, L, (hq + 2 * hkv) * h), key=k[0]) * 3).astype(dtype)
    ms = mx.random.uniform(0.05, 20.0, (B, L, 1), key=k[1])
    p = (
        K._common.pow2_prescale(ms) if K._common.prescaled(dtype) else None
    )  # float16 only
    offset = OFFSETS[off]
    offset = mx.array(offset, mx.int32) if isinstance(offset, list) else offset
    case = dict(qkv=qkv, ms=ms, p=p, offset=offset, rope=rope, hq=hq, hkv=hkv, h=h)
    if mode == "openelm":
        case["gq"] = mx.random.uniform(0.25, 4.0, (h,), key=k[2])
        case["gk"] = mx.random.uniform(0.25, 4.0, (h,), key=k[3])
    if mode == "qwen2":  # a q|k|v bias, far from 0, added after the scaling
        bias = mx.random.uniform(-2.0, 2.0, (qkv.shape[-1],), key=k[2])
        case["bias"] = bias.astype(dtype)  # stored in the model's dtype
    return case


def epilogue_args(c) -> K.Epilogue:
    kw = {"bias": c["bias"]} if "bias" in c else {}
    if "gq" in c:  # 1/sqrt(h) folded into q's gain, as the OpenELM model does at load
        kw.update(
            q_gain=c["gq"] * c["h"] ** -0.5, k_gain=c["gk"], eps_q=EPS_Q, eps_k=EPS_K
        )
    angles = K.rope_angles(c["rope"], c["h"])
    return K.Epilogue(c["hq"], c["hkv"], angles, c["rope"], **kw)


def run_epilogue(fn, c):
    return fn(c["qkv"], c["ms"], c["offset"], epilogue_args(c))


def reference(c):
    """The unfused model math in float32: split, stock norm, mlx-lm RoPE module, scale."""
    B, L, _ = c["qkv"].shape
    hq, hkv, h = c["hq"], c["hkv"], c["h"]
    x = c["qkv"].astype(mx.float32)
    s = mx.rsqrt(c["ms"]) if c["p"] is None else mx.rsqrt(c["ms"]) / c["p"]
    s = s[:, None]  # (B, 1, L, 1)

    def heads(lo, n):
        return x[..., lo * h : (lo + n) * h].reshape(B, L, n, h).transpose(0, 2, 1, 3)

    if "bias" in c:  # Qwen2: the bias on the normalized-input projection
        x = x * s[:, 0] + c["bias"]
    q, k, v = heads(0, hq), heads(hq, hkv), heads(hq + hkv, hkv)
    rope = lambda y: c["rope"](y, offset=c["offset"])  # noqa: E731
    if "bias" in c:
        return rope(q) * h**-0.5, rope(k), v
    if "gq" not in c:  # Llama: RoPE, then s / sqrt(h) on q and s on k
        return rope(q) * s * h**-0.5, rope(k) * s, v * s
    # OpenELM: stock QK-norm of the normalized-input projections, RoPE, 1/sqrt(h)
    q = rope(mx.fast.rms_norm(q * s, c["gq"], EPS_Q)) * h**-0.5
    k = rope(mx.fast.rms_norm(k * s, c["gk"], EPS_K))
    return q, k, v * s


def check_against(outs, refs, dtype, tol, label):
    for name, out, ref in zip("qkv", outs, refs):
        assert out.shape == ref.shape and out.dtype == dtype, (
            name,
            out.shape,
            ref.shape,
        )
        err = rel_err(out, ref)
        assert err < tol, f"{label} {name}: max rel err {err:.3e} >= {tol:.1e}"


# --- twins vs the model math -------------------------------------------------------


@pytest.mark.parametrize("dtype,L,off,ratio,mode", GRID)
def test_qkv_epilogue_twin_matches_unfused_model_math(dtype, L, off, ratio, mode):
    c = make_case(dtype, L, off, ratio, mode)
    outs = run_epilogue(K.epilogue.qkv_epilogue_ops, c)
    check_against(outs, reference(c), dtype, TOL[dtype], "twin vs reference")


# RoPE kinds the fused path does not reproduce (interleaved pairs): the
# model's own module runs; and ones it does, forced through that path too.
UNFUSED_ROPES = {
    "traditional": lambda h: nn.RoPE(h, traditional=True, base=10000.0),
    "yarn": lambda h: initialize_rope(h, 10000.0, False, YARN, 512),
    "partial": lambda h: nn.RoPE(h // 2, base=10000.0),
}


@pytest.mark.parametrize("rope", UNFUSED_ROPES)
@pytest.mark.parametrize("mode", ["llama", "openelm", "qwen2"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("off", ["off5", "per_batch"])
def test_qkv_epilogue_unfused_matches_unfused_model_math(dtype, off, mode, rope):
    """`qkv_epilogue_unfused`: the same split, scaling, bias, QK-norm (eps * ms)
    and gains, with the model's RoPE. The picker sends interleaved RoPE there;
    YaRN and partial rotary, which it fuses, are sent there by hand."""
    c = make_case(dtype, 7, off, 2, mode)
    c["rope"] = UNFUSED_ROPES[rope](c["h"])
    e = epilogue_args(c)
    if rope == "traditional":
        assert e.angles is None, rope
        outs = K.qkv_epilogue(c["qkv"], c["ms"], c["offset"], e)
    else:
        assert e.angles is not None, rope
        outs = K.epilogue.qkv_epilogue_unfused(c["qkv"], c["ms"], c["offset"], e)
    check_against(outs, reference(c), dtype, TOL[dtype], f"unfused {rope}")


def test_openelm_epsilon_adjustment_matters():
    """Without eps * ms the QK-norm of s*q is wrong: the test grid would see it."""
    c = make_case(mx.float32, 7, "off5", 2, "openelm")
    q_ref = reference(c)[0]
    c_naive = dict(c, ms=mx.ones_like(c["ms"]))  # eps unadjusted (and s = 1)
    q_naive = run_epilogue(K.epilogue.qkv_epilogue_ops, c_naive)[0]
    assert rel_err(q_naive, q_ref) > 1e-2, rel_err(q_naive, q_ref)


@pytest.mark.parametrize("name", ["gqa_untied", "head_dim_llama3", "linear_bias"])
@pytest.mark.parametrize("partial", [1, 4], ids=["full", "quarter"])
def test_rope_angles_reproduce_the_models_rope_bit_for_bit(name, partial):
    """The twin's tables and pairing are mx.fast.rope's, the whole head rotated
    or its first quarter (the rest passed through)."""
    cfg = tiny.llama_config(name)
    h = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    R = h // partial
    rope = initialize_rope(R, cfg["rope_theta"], False, cfg.get("rope_scaling"), 512)
    angles = K.rope_angles(rope, h)
    assert angles.dims == R and angles.mscale == 1.0, angles
    x = mx.random.normal((2, 3, 5, h), key=mx.random.key(1))
    for offset in (0, 9, 300, mx.array([4, 100], mx.int32)):
        # On the CPU stream mx.fast.rope is plain float32 ops: bit for bit there.
        with mx.stream(mx.cpu):
            cos, sin = K.epilogue._rope_tables(offset, 5, angles, h)
            ours, ref = K.epilogue._rope(x, cos, sin, R), rope(x, offset=offset)
            assert mx.array_equal(ours, ref).item(), (
                offset,
                mx.abs(ours - ref).max().item(),
            )
        # A GPU's rope kernel computes its angles its own way (exp2, fast cos).
        cos, sin = K.epilogue._rope_tables(offset, 5, angles, h)
        ours, ref = K.epilogue._rope(x, cos, sin, R), rope(x, offset=offset)
        top = offset if isinstance(offset, int) else offset.max().item()
        assert rel_err(ours, ref) <= 1e-5 + 4 * (top + 5) * 2**-24, offset


@pytest.mark.parametrize("rope", PARTIAL_ROPES)
def test_rope_angles_take_partial_dims_and_the_input_factor(rope):
    """Each module's rotated dims and input factor, and the twin's RoPE with
    them against the module itself (m applied after cos and sin here, before
    the rotation in stock: rounding apart)."""
    module, h = PARTIAL_ROPES[rope](), PARTIAL_HEADS[2]
    angles = K.rope_angles(module, h)
    want_m = getattr(module, "_scale", getattr(module, "mscale", 1.0))
    assert (angles.dims, angles.mscale) == (int(rope[1:3]), want_m), angles
    assert (angles.mscale != 1.0) == ("-" in rope), angles
    x = mx.random.normal((2, 3, 5, h), key=mx.random.key(2))
    for offset in (0, 300, mx.array([4, 100], mx.int32)):
        cos, sin = K.epilogue._rope_tables(offset, 5, angles, h)
        ours = K.epilogue._rope(x, cos, sin, angles.dims)
        assert rel_err(ours, module(x, offset=offset)) < TOL[mx.float32], offset


def test_rope_angles_decline_what_the_epilogue_cannot_do():
    assert K.rope_angles(nn.RoPE(16, traditional=True), 16) is None
    assert K.rope_angles(nn.RoPE(32), 16) is None  # more dims than the head
    yarn = initialize_rope(16, 10000.0, True, YARN, 512)
    assert K.rope_angles(yarn, 16) is None  # interleaved, scaled or not
    # Dynamic NTK: its base (so its angles) depends on the offset.
    ntk = {"type": "dynamic", "factor": 2.0}
    assert K.rope_angles(initialize_rope(16, 10000.0, False, ntk, 512), 16) is None

    class Unknown(nn.Module):  # frequencies, but a __call__ nobody has read
        _freqs = mx.ones((8,))
        dims = 16

    assert K.rope_angles(Unknown(), 16) is None


SHAPES = [(1, 1, 64), (2, 7, 40), (1, 5, 576)]


def np64(x):
    return np.array(x.astype(mx.float32), dtype=np.float64)


def np_pow2(ms):
    """p = 2^-floor(log2(ms) / 2), from its definition (float64)."""
    return 2.0 ** -np.floor(np.log2(np64(ms)) / 2)


def test_pow2_prescale_is_the_power_of_two_below_one_over_rms():
    ms = mx.array(
        [1e-6, 1e-5, 0.37, 0.5, 0.999, 1.0, 1.5, 2.0, 3.99, 4.0, 1e4, 3e30, 1e38]
    ).reshape(-1, 1)
    p = K._common.pow2_prescale(ms)
    want = np_pow2(ms)
    assert p.dtype == mx.float32 and np.array_equal(np64(p), want), (np64(p), want)
    s_over_p = np64(mx.rsqrt(ms)) / np64(p)
    assert ((s_over_p > 0.5) & (s_over_p <= 1.0)).all(), s_over_p


def np_scale(ms, dtype):
    """The deferred scalar from its definition: rsqrt(ms), over p in float16."""
    s = 1 / np.sqrt(np64(ms))
    return s / np_pow2(ms) if dtype == mx.float16 else s


def glu_case(dtype, shape):
    k = mx.random.split(mx.random.key(3), 2)
    gate_up = (mx.random.normal((*shape[:-1], 2 * shape[-1]), key=k[0]) * 4).astype(
        dtype
    )
    ms = mx.random.uniform(0.1, 20.0, (*shape[:-1], 1), key=k[1])
    return gate_up, ms


def residual_case(dtype, shape):
    k = mx.random.split(mx.random.key(4), 4)
    h = (mx.random.normal(shape, key=k[0]) * 10).astype(dtype)
    y = (mx.random.normal(shape, key=k[1]) * 10).astype(dtype)
    gain = mx.random.uniform(0.25, 4.0, shape[-1:], key=k[3]).astype(dtype)
    return h, y, mx.random.uniform(0.1, 20.0, (*shape[:-1], 1), key=k[2]), gain


def np_activation(g, activation):
    if activation == "silu":
        return g / (1 + np.exp(-g))
    # GELU, tanh approximation (mlx's nn.gelu_approx, Gemma's activation).
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("activation", K.glu.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_deferred_glu_twin_vs_numpy(dtype, shape, activation):
    gate_up, ms = glu_case(dtype, shape)
    out = K.glu.deferred_glu_ops(gate_up, ms, activation)
    g, u = np.split(np64(gate_up), 2, axis=-1)
    g = g * np_scale(ms, dtype)
    ref = np_activation(g, activation) * u
    err = np.abs(np64(out) - ref).max() / np.abs(ref).max()
    assert out.dtype == dtype and out.shape == shape, (out.dtype, out.shape)
    assert err < TOL[dtype], f"{dtype} {shape}: rel err {err:.3e}"


RESIDUAL_MODES = ["stats", "add", "deferred"]  # y None, y as is, y * s(ms_y)


def residual_args(dtype, shape, mode):
    h, y, ms_y, _ = residual_case(dtype, shape)
    return h, (None if mode == "stats" else y), (ms_y if mode == "deferred" else None)


def np_residual(h, y, ms_y, dtype):
    if y is None:
        return np64(h)
    s = 1.0 if ms_y is None else np_scale(ms_y, dtype)
    return np64(h) + s * np64(y)


@pytest.mark.parametrize("mode", RESIDUAL_MODES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_residual_twin_vs_numpy(dtype, shape, mode):
    h, y, ms_y = residual_args(dtype, shape, mode)
    out, ms, xs = K.block_residual.residual_ops(h, y, ms_y, 1e-5)
    ref = np_residual(h, y, ms_y, dtype)
    ref_ms = (np64(out) ** 2).mean(-1, keepdims=True) + 1e-5
    assert out.dtype == xs.dtype == dtype and out.shape == xs.shape == shape
    assert ms.dtype == mx.float32 and ms.shape == (*shape[:-1], 1), ms.shape
    # The twin rounds s*y to the dtype before the add: two roundings.
    err = np.abs(np64(out) - ref).max() / np.abs(ref).max()
    assert err < 2 * TOL[dtype], f"{dtype} {shape} out: rel err {err:.3e}"
    err_ms = np.abs(np64(ms) - ref_ms).max() / ref_ms.max()
    assert err_ms < 2e-6, f"{dtype} {shape} ms: rel err {err_ms:.3e}"
    # What the matmuls read: x * p (exact, a power of two) in float16, else x.
    p = np_pow2(ms) if dtype == mx.float16 else 1.0
    ref_xs = np64(out) * p
    assert np.abs(np64(xs) - ref_xs).max() <= TOL[dtype] * np.abs(ref_xs).max()
    # With the next norm's gain (unfolded weights): x * g * p, one rounding.
    gain = residual_case(dtype, shape)[3]
    out_g, ms_g, xs_g = K.block_residual.residual_ops(h, y, ms_y, 1e-5, gain)
    assert mx.array_equal(out_g, out) and mx.array_equal(ms_g, ms)
    ref_g = np64(out) * np64(gain) * p
    err_g = np.abs(np64(xs_g) - ref_g).max() / np.abs(ref_g).max()
    assert xs_g.dtype == dtype and err_g <= TOL[dtype], f"xs with gain: {err_g:.3e}"


@pytest.mark.parametrize("gain", [True, False], ids=["gain", "folded"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_residual_norm_twin_vs_numpy(dtype, shape, gain):
    h, y, ms_y, g = residual_case(dtype, shape)
    out = K.block_residual.residual_norm_ops(h, y, ms_y, 1e-5, g if gain else None)
    x = np_residual(h, y, ms_y, dtype)
    ref = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5)
    ref = ref * np64(g) if gain else ref
    err = np.abs(np64(out) - ref).max() / np.abs(ref).max()
    assert out.dtype == dtype and out.shape == shape, (out.dtype, out.shape)
    assert err < 3 * TOL[dtype], f"{dtype} {shape}: rel err {err:.3e}"


def test_glu_activation_is_a_form_and_unknown_ones_refuse():
    """SiLU and GELU differ (so a form mix-up shows), and a name outside
    ACTIVATIONS is an error, not SiLU."""
    gate_up, ms = glu_case(mx.float32, (1, 5, 64))
    silu = K.glu.deferred_glu_ops(gate_up, ms, "silu")
    gelu = K.glu.deferred_glu_ops(gate_up, ms, "gelu_tanh")
    assert rel_err(gelu, silu) > 0.05
    assert K._common._form((gate_up, ms, "silu")) != K._common._form(
        (gate_up, ms, "gelu_tanh")
    )
    with pytest.raises(ValueError, match="activation"):
        K.glu.deferred_glu_ops(gate_up, ms, "relu")


# --- the post-norm residual (Gemma's sandwich norms) -------------------------------


def post_case(dtype, shape, mode):
    """(h, y, ms_y, post_gain): mode "attn" (y as is) or "ffn" (y * s(ms_y))."""
    h, y, ms_y, gain = residual_case(dtype, shape)
    return h, y, (ms_y if mode == "ffn" else None), (gain * 0.5 + 0.1).astype(dtype)


def np_post_sum(h, y, ms_y, post_gain, eps, dtype):
    """h + RMSNorm(s_y * y) * post_gain in float64, clipped for float16."""
    real = np64(y) * (1.0 if ms_y is None else np_scale(ms_y, dtype))
    normed = real / np.sqrt((real**2).mean(-1, keepdims=True) + eps)
    out = np64(h) + normed * np64(post_gain)
    return np.clip(out, -65504, 65504) if dtype == mx.float16 else out


@pytest.mark.parametrize("eps", [1e-5, 0.5], ids=["eps", "big_eps"])
@pytest.mark.parametrize("mode", ["attn", "ffn"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_post_residual_twin_vs_numpy(dtype, shape, mode, eps):
    h, y, ms_y, pg = post_case(dtype, shape, mode)
    gain = residual_case(dtype, shape)[3]
    out, ms, xs = K.post_norm.post_residual_ops(h, y, ms_y, pg, eps, gain)
    ref = np_post_sum(h, y, ms_y, pg, eps, dtype)
    err = np.abs(np64(out) - ref).max() / np.abs(ref).max()
    assert out.dtype == xs.dtype == dtype and out.shape == shape
    assert err < 3 * TOL[dtype], f"{dtype} {shape} {mode}: rel err {err:.3e}"
    ref_ms = (np64(out) ** 2).mean(-1, keepdims=True) + eps
    assert np.abs(np64(ms) - ref_ms).max() / ref_ms.max() < 2e-6
    p = np_pow2(ms) if dtype == mx.float16 else 1.0
    ref_xs = np64(out) * np64(gain) * p
    assert np.abs(np64(xs) - ref_xs).max() <= TOL[dtype] * np.abs(ref_xs).max()
    final = K.post_norm.post_residual_norm_ops(h, y, ms_y, pg, eps, gain)
    x = np64(out)
    ref_f = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * np64(gain)
    err_f = np.abs(np64(final) - ref_f).max() / np.abs(ref_f).max()
    assert err_f < 3 * TOL[dtype], f"final norm: rel err {err_f:.3e}"


def test_post_residual_clips_float16_as_mlx_lm_does():
    """mlx-lm's Gemma (clip_residual): the float16 sum clipped to +-65504, not inf."""
    h = mx.full((1, 1, 64), 65504.0, mx.float16)
    y = mx.ones((1, 1, 64), mx.float16)
    out, ms, _ = K.post_norm.post_residual_ops(h, y, None, mx.full((64,), 40.0), 1e-6)
    assert mx.isfinite(out).all().item() and out.max().item() == 65504.0
    assert mx.isfinite(ms).all().item()


# --- pickers -----------------------------------------------------------------------

OPS = [
    "qkv_epilogue",
    "deferred_glu",
    "residual",
    "residual_norm",
    "post_residual",
    "post_residual_norm",
    "decode_attention",
]
MODULES = {
    "decode_attention": K.attention,
    "qkv_epilogue": K.epilogue,
    "deferred_glu": K.glu,
    "residual": K.block_residual,
    "residual_norm": K.block_residual,
    "post_residual": K.post_norm,
    "post_residual_norm": K.post_norm,
}


def impls(op):
    return getattr(MODULES[op], f"{op}_kernel"), getattr(MODULES[op], f"{op}_ops")


@pytest.mark.skipif(HAS_GPU_KERNELS, reason="this MLX build has a GPU backend")
@pytest.mark.parametrize("op", OPS)
def test_picker_returns_twin_on_cpu_build(op, monkeypatch):
    monkeypatch.delenv("FLASHNORM_KERNELS", raising=False)
    kernel, ops = impls(op)
    assert K.backend(op) is None
    assert K._common.pick(op, kernel, ops) is ops
    with pytest.raises(RuntimeError, match="Metal or CUDA"):
        K._common.make_kernel(op, "", ["x"], ["y"])


@pytest.mark.parametrize("env", ["1", "0"])
def test_picked_op_runs_the_twin_without_backend_or_with_kernels_off(env, monkeypatch):
    if env == "1" and HAS_GPU_KERNELS:
        pytest.skip("this MLX build has a GPU backend: the kernel runs")
    monkeypatch.setenv("FLASHNORM_KERNELS", env)
    c = make_case(mx.float16, 7, "per_batch", 2, "llama")
    picked = run_epilogue(K.qkv_epilogue, c)
    twin = run_epilogue(K.epilogue.qkv_epilogue_ops, c)
    assert all(mx.array_equal(a, b).item() for a, b in zip(picked, twin))


def picked(op):
    """What the picker runs for `op` (a kernel comes wrapped in its check)."""
    fn = K._common.pick(op, *impls(op))
    return getattr(fn, "__wrapped__", fn)


@pytest.mark.parametrize("fake", ["metal", "cuda"])
def test_picker_honours_flashnorm_kernels_env(fake, monkeypatch):
    monkeypatch.setattr(K._common, "gpu_backend", lambda: fake)
    monkeypatch.delenv("FLASHNORM_KERNELS", raising=False)
    for op in OPS:
        assert picked(op) is impls(op)[0], op
    monkeypatch.setenv("FLASHNORM_KERNELS", "0")
    for op in OPS:
        assert picked(op) is impls(op)[1], op
    monkeypatch.setenv("FLASHNORM_KERNELS", "deferred_glu,residual")
    for op in OPS:
        want = impls(op)[0 if op in ("deferred_glu", "residual") else 1]
        assert picked(op) is want, op


@pytest.fixture
def fake_backend(monkeypatch):
    """A GPU backend that is not there: kernels come from the test's factory,
    and no check or failure of an earlier test is remembered."""
    monkeypatch.setattr(K._common, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("FLASHNORM_KERNELS", raising=False)
    monkeypatch.setattr(K._common, "FAILED", {})
    K._common._first_use_checked.cache_clear()
    yield
    K._common._first_use_checked.cache_clear()


def _raising_kernel(*a, **k):
    def launch(**call):
        raise RuntimeError("nvrtc: error: identifier 'FN_LANE' is undefined")

    return launch


def _wrong_kernel(*a, **k):
    def launch(inputs=None, output_shapes=(), output_dtypes=(), **call):
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    return launch


@pytest.mark.parametrize(
    "factory,why",
    [(_raising_kernel, "nvrtc: error"), (_wrong_kernel, "differs from its twin")],
    ids=["fails", "disagrees"],
)
def test_a_failing_kernel_falls_back_to_its_twin_with_one_line(
    fake_backend, monkeypatch, capsys, factory, why
):
    """A kernel that cannot compile, raises or disagrees on the backend does not
    take the model down: the first call returns the twin's result, says so in
    one line (op, backend, error), and the twin runs from then on."""
    monkeypatch.setattr(K._common, "make_kernel", factory)
    h, y, ms_y, _ = residual_case(mx.float32, (2, 3, 64))
    want = K.block_residual.residual_ops(h, y, ms_y, 1e-5)
    got = K.residual(h, y, ms_y, 1e-5)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashnorm-mlx: note: the residual"), err
    assert "cuda" in err[0] and why in err[0], err
    assert K.failures() == [err[0][len("flashnorm-mlx: note: ") :]]
    assert (
        K._common.pick("residual", *impls("residual")) is K.block_residual.residual_ops
    )
    K.residual(h, y, ms_y, 1e-5)
    assert capsys.readouterr().err == ""  # said once
    # Other ops are checked on their own: deferred_glu still tries its kernel.
    assert picked("deferred_glu") is K.glu.deferred_glu_kernel


@needs_cxx
def test_a_working_kernel_is_checked_once_per_form(
    host_kernels, fake_backend, monkeypatch, capsys
):
    """The host-compiled body passes its first-use check and runs from then on;
    each form (dtype, which inputs are given) is checked once."""
    monkeypatch.setattr(K._common, "make_kernel", host_kernels.run)
    calls = []
    real = K.block_residual.residual_ops
    monkeypatch.setattr(
        K.block_residual, "residual_ops", lambda *a: calls.append(1) or real(*a)
    )
    h, y, ms_y, gain = residual_case(mx.float32, (1, 2, 8))
    for _ in range(3):
        K.residual(h, y, ms_y, 1e-5)
    K.residual(h, y, ms_y, 1e-5, gain)
    assert len(calls) == 2 and not K.failures(), (calls, K.failures())
    assert capsys.readouterr().err == ""


# --- renderings --------------------------------------------------------------------

BODIES = {
    "qkv_epilogue": K.epilogue.QKV_EPILOGUE_BODY,
    "deferred_glu": K.glu.DEFERRED_GLU_BODY,
    "residual": K.block_residual.RESIDUAL_BODY,
    "post_residual": K.post_norm.POST_RESIDUAL_BODY,
    "decode_attention": K.attention.DECODE_ATTENTION_BODY,
}
FORMS = [
    ("qkv_epilogue", dict(qk_norm=a, prescale=b, bias=c))
    for a in (0, 1)
    for b in (0, 1)
    for c in (0, 1)
    if not (a and c)
]
FORMS += [("deferred_glu", dict(prescale=b)) for b in (0, 1)]
FORMS += [("deferred_glu", dict(prescale=b, gelu=1)) for b in (0, 1)]
FORMS += [("decode_attention", dict())]
FORMS += [
    ("residual", dict(has_y=y, scale_y=sy, prescale=p, norm=n, gain=g))
    for y, sy in ((0, 0), (1, 0), (1, 1))
    for p in (0, 1)
    for n, g in ((0, 0), (0, 1), (1, 0), (1, 1))
]
FORMS += [
    ("post_residual", dict(scale_y=sy, prescale=p, norm=n, gain=g))
    for sy in (0, 1)
    for p in (0, 1)
    for n in (0, 1)
    for g in (0, 1)
]


@pytest.mark.parametrize("op,flags", FORMS, ids=lambda v: str(v))
def test_metal_and_cuda_renderings_differ_only_in_prelude(op, flags):
    metal = K.render.render(BODIES[op], "metal", **flags)
    cuda = K.render.render(BODIES[op], "cuda", **flags)
    metal_prelude, metal_body = metal.split(K.render.BODY_MARK)
    cuda_prelude, cuda_body = cuda.split(K.render.BODY_MARK)
    assert metal_body == cuda_body == BODIES[op]
    assert metal_prelude != cuda_prelude
    assert (
        "thread_position_in_threadgroup" in metal_prelude
        and "threadIdx" in cuda_prelude
    )
    for backend_only in (
        "threadIdx",
        "blockIdx",
        "__syncthreads",
        "__shared__",
        "metal::",
        "threadgroup_barrier",
        "thread_position",
    ):
        assert backend_only not in metal_body, backend_only


def test_metal_rendering_builds_full_kernel_source(monkeypatch, capfd, tmp_path):
    """Creating metal_kernel objects works without Metal; exporting a graph records
    the call without running it, and verbose=True prints MLX's full Metal source."""
    real = mx.fast.metal_kernel

    def verbose_metal_kernel(**kw):
        kernel = real(**kw)
        return lambda **call: kernel(**call, verbose=True)

    monkeypatch.setattr(mx.fast, "metal_kernel", verbose_metal_kernel)
    monkeypatch.setattr(K._common, "gpu_backend", lambda: "metal")
    K._common._make_kernel.cache_clear()
    c = make_case(mx.float16, 7, "per_batch", 2, "openelm")
    c_llama = make_case(mx.bfloat16, 1, "off5", 4, "llama")
    gate_up, ms = glu_case(mx.float16, (2, 7, 40))
    att = attention_case(mx.float16, "gqa4-d24-mid")

    def graph(qkv, qkv2, gate_up):
        q = run_epilogue(K.epilogue.qkv_epilogue_kernel, dict(c, qkv=qkv))
        q2 = run_epilogue(K.epilogue.qkv_epilogue_kernel, dict(c_llama, qkv=qkv2))
        glu = K.glu.deferred_glu_kernel(gate_up, ms)
        res = K.block_residual.residual_kernel(glu, glu, ms, 1e-5)
        return (
            *q,
            *q2,
            glu,
            *res,
            K.block_residual.residual_norm_kernel(glu, None, None, 1e-5),
            K.attention.decode_attention_kernel(*att),
        )

    try:
        mx.export_function(
            str(tmp_path / "g.mlxfn"), graph, c["qkv"], c_llama["qkv"], gate_up
        )
    finally:
        K._common._make_kernel.cache_clear()
    text = capfd.readouterr().out
    sources = text.split("Generated source code for `")[1:]
    names = sorted(src.split("`")[0] for src in sources)
    assert names == [
        "flashnorm_decode_attention",
        "flashnorm_deferred_glu_prescale1",
        "flashnorm_qkv_epilogue_bias0_prescale0_qk_norm0",
        "flashnorm_qkv_epilogue_bias0_prescale1_qk_norm1",
        "flashnorm_residual_gain0_has_y0_norm1_prescale1_scale_y0",
        "flashnorm_residual_gain0_has_y1_norm0_prescale1_scale_y1",
    ], names
    by_name = {src.split("`")[0]: src for src in sources}
    qkv_src = by_name["flashnorm_qkv_epilogue_bias0_prescale1_qk_norm1"]
    for line in (
        "template <typename T, int HQ, int HKV, int HALF, int OFS, int RH, int NT, "
        "int RP>",
        "const device float16_t* qkv [[buffer(0)]]",
        "const constant int* qkv_shape [[buffer(1)]]",
        "const constant int32_t* offset",
        "device float16_t* v [[buffer(",
        "uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]",
        "#define FN_QK_NORM 1",
        "<float16_t, 4, 2, 12, 1, 12, 12, 16>",
    ):
        assert line in qkv_src, (line, qkv_src[:2000])
    assert (
        "<bfloat16_t, 8, 2, 8, 0, 8>"
        in by_name["flashnorm_qkv_epilogue_bias0_prescale0_qk_norm0"]
    )
    for name, src in by_name.items():
        op = next(op for op in BODIES if f"{name}_".startswith(f"flashnorm_{op}_"))
        assert K.render.BODY_MARK + BODIES[op] in src, name
        assert "[[kernel]] void custom_kernel_" + name in src, name
        assert 'template [[host_name("custom_kernel_' + name in src, name


# --- kernels vs twins on a real backend -------------------------------------------


@needs_backend
@pytest.mark.parametrize("dtype,L,off,ratio,mode", GRID)
def test_qkv_epilogue_kernel_matches_twin(dtype, L, off, ratio, mode):
    c = make_case(dtype, L, off, ratio, mode)
    outs = run_epilogue(K.epilogue.qkv_epilogue_kernel, c)
    check_against(
        outs,
        run_epilogue(K.epilogue.qkv_epilogue_ops, c),
        dtype,
        2 * TOL[dtype],
        "kernel",
    )
    check_against(outs, reference(c), dtype, TOL[dtype], "kernel vs reference")


def elementwise_checks(dtype, shape):
    """(op, args, tolerance per output) for every form the models call."""
    gate_up, ms = glu_case(dtype, shape)
    yield "deferred_glu", (gate_up, ms), [2 * TOL[dtype]]
    yield "deferred_glu", (gate_up, ms, "gelu_tanh"), [2 * TOL[dtype]]
    # out as the twin rounds it; ms: float32 sums in another order; xs: one more
    # rounding of out (an exact power of two, so only where out already differs).
    h, y, ms_y, gain = residual_case(dtype, shape)
    for mode in RESIDUAL_MODES:
        args = (*residual_args(dtype, shape, mode), 1e-5)
        yield "residual", args, [2 * TOL[dtype], 1e-5, 2 * TOL[dtype]]
        # xs = x * gain (* p): the gain of the next norm, unfolded weights.
        yield "residual", (*args, gain), [2 * TOL[dtype], 1e-5, 3 * TOL[dtype]]
        yield "residual_norm", args, [3 * TOL[dtype]]
    yield "residual_norm", (h, y, ms_y, 1e-5, gain), [3 * TOL[dtype]]
    # The post-norm residual (Gemma): after attention (y as is) and after the
    # FFN (y owing s_y), with and without the next norm's gain; the final one.
    for mode in ("attn", "ffn"):
        h, y, ms_y, pg = post_case(dtype, shape, mode)
        args = (h, y, ms_y, pg, 1e-5)
        yield "post_residual", args, [3 * TOL[dtype], 1e-5, 3 * TOL[dtype]]
        tols = [3 * TOL[dtype], 1e-5, 4 * TOL[dtype]]
        yield "post_residual", (*args, gain), tols
        yield "post_residual_norm", args, [4 * TOL[dtype]]
        yield "post_residual_norm", (*args, gain), [4 * TOL[dtype]]


def check_elementwise_kernels(dtype, shape):
    for op, args, tols in elementwise_checks(dtype, shape):
        kernel, ops = impls(op)
        outs, refs = kernel(*args), ops(*args)
        if isinstance(outs, mx.array):
            outs, refs = [outs], [refs]
        for i, (out, ref, tol) in enumerate(zip(outs, refs, tols, strict=True)):
            assert (out.shape, out.dtype) == (ref.shape, ref.dtype), (op, i, out.shape)
            err = rel_err(out, ref)
            assert err < tol, f"{op}[{i}] {dtype} {shape}: {err:.3e} >= {tol:.1e}"


@needs_backend
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_elementwise_kernels_match_twins(dtype, shape):
    check_elementwise_kernels(dtype, shape)


# --- kernel bodies run on the CPU (host C++ rendering) ------------------------------

HOST_PRELUDE = """\
#define FN_LANE lane_
#define FN_GROUP group_
#define FN_GLOBAL (group_ * nt_ + lane_)
#define FN_SHARED static
#define FN_SYNC() bar_->sync()
#define FN_RSQRT(x) (1.0f / std::sqrt(x))
#define FN_EXP(x) std::exp(x)
#define FN_TANH(x) std::tanh(x)
#define FN_COS(x) std::cos(x)
#define FN_SIN(x) std::sin(x)
#define FN_AS_INT(x) std::bit_cast<int>(x)
#define FN_AS_FLOAT(x) std::bit_cast<float>(x)
"""
HOST_HEADER = """\
#if defined(__APPLE__)
#define _XOPEN_SOURCE 600  // macOS declares the ucontext calls only with it
#endif
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>
#include <vector>
// A group's GPU threads as fibers of one OS thread: each lane runs to its next
// FN_SYNC(), then the next lane does; ascending lanes in even groups, descending
// in odd ones, so a missing barrier shows whichever way its race goes.
struct Lanes {
  using Body = void (*)(void**, const int*, int, int, int, Lanes*);
  static constexpr size_t STACK = 1 << 16;
  static inline thread_local Lanes* self = nullptr;
  Body body;
  void** bufs;
  const int* ints;
  int group = 0, nt = 0, current = 0;
  ucontext_t sched;
  std::vector<ucontext_t> ctx;
  std::vector<char> done;
  char* stacks = nullptr;  // untouched pages cost nothing
  ~Lanes() { std::free(stacks); }
  void sync() { swapcontext(&ctx[current], &sched); }
  static void entry() {
    Lanes& s = *self;
    const int lane = s.current;
    s.body(s.bufs, s.ints, lane, s.group, s.nt, &s);
    s.done[lane] = 1;  // returns to uc_link: the scheduler
  }
  void run(Body b, void** bf, const int* in, int groups, int n) {
    body = b, bufs = bf, ints = in, nt = n, self = this;
    ctx.resize(n), done.resize(n);
    stacks = (char*)std::malloc(STACK * n);
    for (group = 0; group < groups; ++group) {
      for (int l = 0; l < n; ++l) {
        getcontext(&ctx[l]);
        ctx[l].uc_stack.ss_sp = stacks + STACK * l;
        ctx[l].uc_stack.ss_size = STACK;
        ctx[l].uc_link = &sched;
        makecontext(&ctx[l], entry, 0);
        done[l] = 0;
      }
      for (int left = n; left > 0;) {  // one round: every lane to its next barrier
        left = 0;
        for (int i = 0; i < n; ++i) {
          current = group % 2 ? n - 1 - i : i;
          if (done[current]) continue;
          swapcontext(&sched, &ctx[current]);
          left += !done[current];
        }
      }
    }
  }
};
struct bf16 {  // bfloat16 storage, float32 arithmetic (round to nearest even)
  uint16_t bits;
  bf16(float f) { uint32_t u; std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? 0x7fc0 : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
  operator float() const { uint32_t u = (uint32_t)bits << 16; float f;
    std::memcpy(&f, &u, 4); return f; }
};
"""
CTYPES = {
    mx.float32: "float",
    mx.float16: "_Float16",
    mx.bfloat16: "bf16",
    mx.int32: "int",
}
NP_STORAGE = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,
    mx.int32: np.int32,
}
HOST_RP = 1024  # the host's shared array: any power of two >= the threads works


def to_numpy(x):
    x = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
    return np.ascontiguousarray(np.array(x))


def from_numpy(a, dtype):
    x = mx.array(a)
    return x.view(mx.bfloat16) if dtype == mx.bfloat16 else x


HOST_KERNEL = """\
static void {key}_body(void** bufs_, const int* ints_, int lane_, int group_, int nt_,
                       Lanes* bar_) {{
  constexpr int RP = {rp};
{decls}
{prelude}{defines}{body}}}
{undefs}
extern "C" void {key}(void** bufs, const int* ints, int groups, int nt, int threaded) {{
  if (!threaded) {{  // no barriers: the lanes of a group one after another
    for (int g = 0; g < groups; ++g)
      for (int l = 0; l < nt; ++l) {key}_body(bufs, ints, l, g, nt, nullptr);
    return;
  }}
  Lanes().run({key}_body, bufs, ints, groups, nt);  // a fiber per lane
}}
"""


class Spec(NamedTuple):
    body: str
    names: list
    outputs: list
    flags: dict
    in_dtypes: list
    template: list
    out_dtypes: list


class HostKernels:
    """Stands in for `kernels._kernel`: the same body, g++-compiled, one fiber per
    GPU thread (CUDA's grid rounding: whole blocks, so bounds checks are exercised)."""

    def __init__(self, workdir: Path):
        self.workdir, self.specs, self.lib = workdir, {}, None

    def record(self, name, body, inputs, outputs, **flags):
        """Recording pass: note the form and its dtypes, return dummy outputs."""
        names = list(inputs)

        def call(inputs=None, template=(), output_shapes=(), output_dtypes=(), **_):
            key = self.key(name, body, names, flags, inputs, template, output_dtypes)
            in_dtypes = [x.dtype for x in inputs]
            self.specs[key] = Spec(
                body, names, list(outputs), flags, in_dtypes, template, output_dtypes
            )
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return call

    @staticmethod
    def key(name, body, names, flags, inputs, template, output_dtypes):
        sig = (
            name,
            body,
            tuple(names),
            tuple(sorted(flags.items())),
            tuple(str(x.dtype) for x in inputs),
            tuple(t for t, _ in template),
            tuple(str(v) for _, v in template if isinstance(v, mx.Dtype)),
            tuple(str(d) for d in output_dtypes),
        )
        return "k" + hashlib.sha1(repr(sig).encode()).hexdigest()[:16]

    @staticmethod
    def source(key: str, spec: Spec) -> str:
        # The CUDA rendering minus its prelude: the very text the GPU compiles.
        rendered = K.render.render(spec.body, "cuda", **spec.flags)
        cuda_prelude, body = rendered.split(K.render.BODY_MARK)
        defines = cuda_prelude[len(K.render.PRELUDES["cuda"]) :]  # the form's FN_ flags
        decls = []  # buffers: input i at 2i, its shape at 2i + 1, then the outputs
        for i, (n, dt) in enumerate(zip(spec.names, spec.in_dtypes)):
            c = CTYPES[dt]
            decls.append(f"const {c}* {n} = (const {c}*)bufs_[{2 * i}];")
            decls.append(f"const int* {n}_shape = (const int*)bufs_[{2 * i + 1}];")
        for j, (n, dt) in enumerate(zip(spec.outputs, spec.out_dtypes)):
            c = CTYPES[dt]
            decls.append(f"{c}* {n} = ({c}*)bufs_[{2 * len(spec.names) + j}];")
        ints = [t for t, v in spec.template if not isinstance(v, mx.Dtype)]
        decls += [f"const int {t} = ints_[{i}];" for i, t in enumerate(ints)]
        decls = [d for d in decls if not d.startswith("const int RP ")]
        decls += [f"using T = {CTYPES[v]};" for t, v in spec.template if t == "T"]
        return HOST_KERNEL.format(
            key=key,
            rp=HOST_RP,
            decls="".join(f"  {d}\n" for d in decls),
            prelude=HOST_PRELUDE,
            defines=defines,
            body=body,
            undefs="".join(f"#undef FN_{f.upper()}\n" for f in spec.flags),
        )

    def compile(self):
        src = self.workdir / "host_kernels.cpp"
        parts = [self.source(key, spec) for key, spec in self.specs.items()]
        src.write_text(HOST_HEADER + "\n".join(parts))
        lib = self.workdir / "host_kernels.so"
        flags = ["-std=c++20", "-O1", "-shared", "-fPIC"]
        r = subprocess.run(
            [HOST_CXX, *flags, "-o", str(lib), str(src)], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-4000:]
        self.lib = ctypes.CDLL(str(lib))

    def run(self, name, body, inputs, outputs, **flags):
        names = list(inputs)

        def call(
            inputs=None,
            template=(),
            grid=None,
            threadgroup=None,
            output_shapes=(),
            output_dtypes=(),
            **_,
        ):
            key = self.key(name, body, names, flags, inputs, template, output_dtypes)
            assert key in self.specs, f"{name} {flags}: form not compiled"
            tmpl = dict(template)
            tx, gx = threadgroup[0], grid[0]
            nt, groups = min(tx, gx), -(-gx // tx)
            threaded = "FN_SYNC" in body
            if threaded:  # barriers need whole threadgroups
                assert gx % tx == 0, (gx, tx)
            if "RP" in tmpl:  # a reduction over exactly NT threads
                rp = tmpl["RP"]
                assert tmpl["NT"] == tx, (tmpl, tx)
                assert rp >= tx and rp & (rp - 1) == 0 and rp <= HOST_RP, (rp, tx)
            keep = []
            for x in inputs:
                keep += [to_numpy(x), np.array(x.shape or (1,), np.int32)]
            outs = []
            for shape, dt in zip(output_shapes, output_dtypes):
                fill = 0x7FC0 if dt == mx.bfloat16 else np.nan  # unwritten shows as NaN
                outs.append(np.full(shape, fill, NP_STORAGE[dt]))
            bufs = (ctypes.c_void_p * (len(keep) + len(outs)))(
                *[a.ctypes.data for a in keep + outs]
            )
            ints = [v for t, v in template if not isinstance(v, mx.Dtype)]
            ints = (ctypes.c_int * max(1, len(ints)))(*ints)
            getattr(self.lib, key)(bufs, ints, groups, nt, int(threaded))
            return [from_numpy(o, dt) for o, dt in zip(outs, output_dtypes)]

        return call


def record_all_forms(host, monkeypatch):
    """One call per form and dtype through the real wrappers, recording only."""
    monkeypatch.setattr(K._common, "make_kernel", host.record)
    for dtype in DTYPES.values():
        for mode in ("llama", "openelm", "qwen2"):
            for off in ("off5", "per_batch"):
                run_epilogue(
                    K.epilogue.qkv_epilogue_kernel, make_case(dtype, 1, off, 2, mode)
                )
            # partial rotary with m: the pairing over RH < HALF (template RH)
            run_epilogue(
                K.epilogue.qkv_epilogue_kernel,
                make_case(dtype, 1, "per_batch", "r48-yarn", mode),
            )
        for op, args, _ in elementwise_checks(dtype, (1, 2, 8)):
            impls(op)[0](*args)
        K.attention.decode_attention_kernel(*attention_case(dtype, "mha-d64-off0"))


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    if HOST_CXX is None:
        pytest.skip("no C++ compiler")
    host = HostKernels(tmp_path_factory.mktemp("host_kernels"))
    with pytest.MonkeyPatch.context() as mp:
        record_all_forms(host, mp)
    host.compile()
    return host


@pytest.fixture
def host_backend(host_kernels, monkeypatch):
    monkeypatch.setattr(K._common, "make_kernel", host_kernels.run)
    monkeypatch.setattr(K._common, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("FLASHNORM_KERNELS", raising=False)
    return host_kernels


@needs_cxx
@pytest.mark.parametrize("dtype,L,off,ratio,mode", GRID)
def test_qkv_epilogue_body_on_host_matches_twin(
    host_backend, dtype, L, off, ratio, mode
):
    c = make_case(dtype, L, off, ratio, mode)
    outs = run_epilogue(K.epilogue.qkv_epilogue_kernel, c)
    check_against(
        outs,
        run_epilogue(K.epilogue.qkv_epilogue_ops, c),
        dtype,
        2 * TOL[dtype],
        "body",
    )
    check_against(outs, reference(c), dtype, TOL[dtype], "body vs reference")


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES + [(3, 1, 1000)], ids=str)
def test_elementwise_bodies_on_host_match_twins(host_backend, dtype, shape):
    check_elementwise_kernels(dtype, shape)


# --- decode attention: one query over the first offset + 1 cache positions ---------

# (B, Hq, Hkv, capacity, head dim, offset): GQA ratios, head dims that are and are
# not a power of two, one position only, keys past one chunk of 256 (the online
# softmax's rescaling), a full buffer.
ATTENTION_CASES = {
    "mha-d64-off0": (1, 2, 2, 8, 64, 0),
    "gqa4-d24-mid": (2, 8, 2, 40, 24, 17),
    "gqa2-d96-two-chunks": (1, 4, 2, 512, 96, 300),
    "gqa3-d128-full": (1, 3, 1, 260, 128, 259),
}


def attention_case(dtype, case):
    B, hq, hkv, C, h, off = ATTENTION_CASES[case]
    k = mx.random.split(mx.random.key(5), 3)
    q = mx.random.normal((B, hq, 1, h), key=k[0]).astype(dtype)
    # Scores spread wider with the position: a later chunk of keys holds the
    # largest, so the online softmax must rescale what came before.
    ramp = 0.2 + 2.0 * mx.arange(C).reshape(1, 1, -1, 1) / C
    keys = mx.random.normal((B, hkv, C, h), key=k[1]) * ramp / h**0.25
    values = mx.random.normal((B, hkv, C, h), key=k[2])
    # Past the offset the buffer holds what a leak could not hide.
    past = mx.arange(C).reshape(1, 1, -1, 1) > off
    keys = mx.where(past, 200.0, keys).astype(dtype)
    values = mx.where(past, 1000.0, values).astype(dtype)
    return q, keys, values, mx.array([off], dtype=mx.int32)


def attention_reference(q, keys, values, offset, scale=1.0):
    """numpy float64: softmax over positions 0..offset of scale q k^T, query
    head i reading KV head i // (Hq / Hkv)."""
    q, keys, values = np64(q) * scale, np64(keys), np64(values)
    n, group = int(offset[0].item()) + 1, q.shape[1] // keys.shape[1]
    kv = np.repeat(np.arange(keys.shape[1]), group)
    s = np.einsum("bhd,bhnd->bhn", q[:, :, 0], keys[:, kv, :n])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhn,bhnd->bhd", p, values[:, kv, :n])[:, :, None]


def check_attention(fn, dtype, case, tol, scale=None):
    args = attention_case(dtype, case) + ((scale,) if scale is not None else ())
    out = fn(*args)
    ref = attention_reference(*args)
    err = np.abs(np64(out) - ref).max() / np.abs(ref).max()
    assert out.dtype == dtype and out.shape == args[0].shape, (out.dtype, out.shape)
    assert err < tol, f"{case} {dtype}: rel err {err:.3e} >= {tol:.1e}"


@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_decode_attention_twin_vs_numpy(dtype, case):
    # The twin is MLX's attention: on CUDA its float32 matmuls run in TF32.
    tol = tiny.f32_tol(2 * TOL[dtype]) if dtype == mx.float32 else 2 * TOL[dtype]
    check_attention(K.attention.decode_attention_ops, dtype, case, tol)


@needs_backend
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_decode_attention_kernel_vs_numpy(dtype, case):
    check_attention(K.attention.decode_attention_kernel, dtype, case, 2 * TOL[dtype])


@needs_cxx
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_decode_attention_body_on_host_vs_numpy(host_backend, dtype, case):
    check_attention(K.attention.decode_attention_kernel, dtype, case, 2 * TOL[dtype])


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_decode_attention_scales_the_query_as_mlx_lm_classes_ask(host_backend, dtype):
    """mlx-lm's classes on the compiled engine pass their 1/sqrt(h) (ours pass 1):
    kernel body and twin both take it, against numpy."""
    case = "gqa4-d24-mid"
    check_attention(K.attention.decode_attention_ops, dtype, case, 2 * TOL[dtype], 0.3)
    check_attention(
        K.attention.decode_attention_kernel, dtype, case, 2 * TOL[dtype], 0.3
    )


def test_decode_attention_takes_the_twin_where_the_kernel_does_not_apply(
    fake_backend, monkeypatch
):
    """Head dims past the kernel's threads, or keys of another dtype than q, go
    to the twin without trying the kernel (and without a failure line)."""
    monkeypatch.setattr(K._common, "make_kernel", _raising_kernel)
    q, keys, values, off = attention_case(mx.float32, "gqa4-d24-mid")
    wide = [mx.tile(a, (1, 1, 1, 12)) for a in (q, keys, values)]  # h = 288 > NT
    for args in (
        (*wide, off),
        (q, keys.astype(mx.float16), values.astype(mx.float16), off),
    ):
        got = K.decode_attention(*args)
        want = K.attention.decode_attention_ops(*args)
        assert mx.array_equal(got, want).item()
    assert not K.failures()


# --- the Llama model uses the epilogue ---------------------------------------------


@pytest.mark.parametrize("name", ["gqa_untied", "linear_bias"])
def test_llama_attention_uses_the_epilogue_biased_or_not(name, tmp_path, monkeypatch):
    """Every layer's q/k/v go through one epilogue call; a q|k|v bias rides in it."""
    source = read_source(str(tiny.make_llama(tmp_path, name, tokenizer=False)))
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    calls = []
    real = K.qkv_epilogue
    monkeypatch.setattr(K, "qkv_epilogue", lambda *a: calls.append(a[-1]) or real(*a))
    model(mx.array([[1, 2, 3]]))
    assert len(calls) == source.config["num_hidden_layers"], len(calls)
    biased = bool(source.config.get("attention_bias"))
    assert all((e.bias is not None) == biased for e in calls), calls


WHOLE_MODELS = {
    "llama-untied": (tiny.make_llama, "head_dim_llama3"),
    "llama-tied": (tiny.make_llama, "mha_tied"),
    "mistral-sliding": (tiny.make_llama, "mistral_sliding"),
    "qwen2-bias": (tiny.make_qwen, "qwen2"),
    "qwen3-qk-norm": (tiny.make_qwen, "qwen3_tied"),
    "openelm-tied": (tiny.make_openelm, "shared"),
    "openelm-untied": (tiny.make_openelm, "odd_unshared"),
    "gemma3-tied": (tiny.make_gemma3, "gemma3_tied"),
    "gemma3-untied": (tiny.make_gemma3, "gemma3_untied"),
}


@needs_cxx
@pytest.mark.parametrize("name", WHOLE_MODELS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
def test_model_with_every_kernel_body_matches_twins(
    host_backend, dtype, name, tmp_path
):
    """The whole model with every kernel (run as host C++) vs its plain-ops self,
    over a prompt and cached decode steps (int offsets through the KV cache)."""
    make, cfg = WHOLE_MODELS[name]
    source = read_source(str(make(tmp_path, cfg, tokenizer=False)))
    # Uncompiled: the host C++ bodies read their inputs into numpy, which a
    # trace cannot (test_decode.py checks the kernels inside a compiled step).
    model, _ = build_model(source, FLASHNORM, dtype=dtype, engine="eager")
    prompt = mx.array([[5, 17, 99, 3, 250, 42, 7]])
    logits = {}
    for env in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FLASHNORM_KERNELS", env)
            cache = make_prompt_cache(model)
            rows = [model(prompt, cache=cache)[0]]
            for tok in (9, 250, 31):
                rows.append(model(mx.array([[tok]]), cache=cache)[0])
            logits[env] = mx.concatenate(rows).astype(mx.float32)
    err = rel_err(logits["1"], logits["0"])
    assert err < (1e-5 if dtype == mx.float32 else 2e-2), f"{dtype}: {err:.3e}"


@pytest.mark.parametrize("mode", ["--wrappers", "--real"])
def test_kernel_call_overhead_script_runs(mode):
    """scripts/kernel-call-overhead.py drives the real wrappers with a stand-in
    kernel, and times real calls of each op beside the built-ins it replaces: it
    breaks when their signatures change."""
    import sys

    script = Path(__file__).parent.parent / "scripts" / "kernel-call-overhead.py"
    r = subprocess.run(
        [sys.executable, str(script), mode, "3"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    for op in ("residual", "residual_norm", "deferred_glu", "qkv_epilogue"):
        assert any(line.startswith(op) for line in lines), r.stdout
    if mode == "--real":
        assert sum(line.startswith("stock:") for line in lines) == 3, r.stdout
