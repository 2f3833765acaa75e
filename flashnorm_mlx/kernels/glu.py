"""`deferred_glu`: act(s * gate) * up from the fused gate|up matmul output.

act is the architecture's (`Architecture.activation`): SiLU (Llama, Qwen,
OpenELM) or GELU with the tanh approximation (Gemma: mlx's `nn.gelu_approx`),
one render-time form of the kernel each.
"""

import functools

import mlx.core as mx
import mlx.nn as nn

from . import _common
from ._common import deferred_scale, prescaled

DEFERRED_GLU_BODY = """\
  // out = act(s * gate) * up; gate_up (B, L, 2F) = [gate | up], s from ms (B, L, 1).
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
#if defined(FN_GELU) && FN_GELU
  // nn.gelu_approx: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
  const float a = 0.5f * g * (1.0f + FN_TANH(0.7978845608028654f * (g + 0.044715f * g * g * g)));
#else
  const float a = g / (1.0f + FN_EXP(-g));
#endif
  out[i] = static_cast<T>(a * u);
"""

ACTIVATIONS = ("silu", "gelu_tanh")  # models/arch.py's, in the same order


def activate(g: mx.array, activation: str) -> mx.array:
    """The gate activation in plain MLX (float32 in, float32 out)."""
    if activation == "silu":
        return g * mx.sigmoid(g)
    if activation == "gelu_tanh":
        return nn.gelu_approx(g)
    raise ValueError(f"unknown GLU activation {activation!r}; one of {ACTIVATIONS}")


def deferred_glu_ops(
    gate_up: mx.array, ms: mx.array, activation: str = "silu"
) -> mx.array:
    """act(s * gate) * up from the fused (B, L, 2F) gate/up output -> (B, L, F),
    s = `deferred_scale(ms)`, act one of `ACTIVATIONS`. The second s (on up) is
    deferred past the down projection: the caller's `residual` applies it."""
    gate, up = mx.split(gate_up, 2, axis=-1)
    g = gate * deferred_scale(ms, gate_up.dtype)
    return (activate(g, activation) * up).astype(gate_up.dtype)


@functools.lru_cache(maxsize=512)
def _glu_plan(shape, dtype, inputs, activation, make_kernel, backend):
    F = shape[-1] // 2
    B, L, _ = shape
    kernel = make_kernel(
        "deferred_glu",
        DEFERRED_GLU_BODY,
        inputs,
        ["out"],
        prescale=prescaled(dtype),
        # Only GELU names a flag: SiLU's kernels keep their names and sources.
        **({"gelu": True} if activation == "gelu_tanh" else {}),
    )
    launch = dict(
        template=[("T", dtype), ("F", F)],
        grid=(B * L * F, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(*shape[:-1], F)],
        output_dtypes=[dtype],
    )
    return kernel, launch


def deferred_glu_kernel(
    gate_up: mx.array, ms: mx.array, activation: str = "silu"
) -> mx.array:
    # gate_up (B, L, 2F), ms (B, L, 1): the kernel indexes them in flat memory.
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown GLU activation {activation!r}; one of {ACTIVATIONS}")
    names, inputs = _common.kernel_inputs(("gate_up", gate_up), ("ms", ms))
    kernel, launch = _glu_plan(
        gate_up.shape,
        gate_up.dtype,
        names,
        activation,
        _common.make_kernel,
        _common.gpu_backend(),
    )
    return kernel(inputs=inputs, **launch)[0]


def deferred_glu(gate_up: mx.array, ms: mx.array, activation: str = "silu"):
    return _common.pick("deferred_glu", deferred_glu_kernel, deferred_glu_ops)(
        gate_up, ms, activation
    )
