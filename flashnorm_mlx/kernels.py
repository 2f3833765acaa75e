"""The deferred-scaling ops FlashNorm models call.

Each op `<op>` is what the models use; `<op>_ops` is its plain-MLX twin. Custom
`mx.fast` kernels (`<op>_kernel`) are picked by `<op>` where a GPU backend exists.
"""

import mlx.core as mx


def mean_square_ops(x: mx.array, eps: float) -> mx.array:
    """ms = mean(x^2) + eps over the last axis, in float32: (B, L, D) -> (B, L, 1)."""
    x = x.astype(mx.float32)
    return mx.mean(x * x, axis=-1, keepdims=True) + eps


def mean_square(x: mx.array, eps: float) -> mx.array:
    return mean_square_ops(x, eps)


def pow2_prescale(ms: mx.array, dtype: mx.Dtype):
    """(p, s/p) with p = 2^round(log2(s)), s = rsqrt(ms), both float32 (B, L, 1).

    float16 has too little range for x @ W* with an unnormalized x; scaling x by a
    power of two is exact, so x*p goes through the matmuls and s/p ~ 1 comes after.
    bfloat16 and float32 have the range, so p = 1 there and costs nothing.
    """
    s = mx.rsqrt(ms)
    if dtype != mx.float16:
        return None, s
    # 2^k from its float32 exponent bits: exact on every backend, unlike pow/exp.
    k = mx.clip(mx.round(-0.5 * mx.log2(ms)), -126, 127).astype(mx.int32)
    p = mx.left_shift(k + 127, 23).view(mx.float32)
    return p, s / p


def deferred_residual_ops(h: mx.array, y: mx.array, s: mx.array) -> mx.array:
    """h + s * y: the deferred scaling of a block's output, s (B, L, 1)."""
    return h + (y * s).astype(h.dtype)


def deferred_residual(h: mx.array, y: mx.array, s: mx.array) -> mx.array:
    return deferred_residual_ops(h, y, s)


def deferred_glu_ops(gate_up: mx.array, s: mx.array) -> mx.array:
    """silu(s * gate) * up from the fused (B, L, 2F) gate/up output -> (B, L, F).

    The second s (on up) is deferred past the down projection by the caller.
    """
    gate, up = mx.split(gate_up, 2, axis=-1)
    g = gate * s
    return (g * mx.sigmoid(g) * up).astype(gate_up.dtype)


def deferred_glu(gate_up: mx.array, s: mx.array) -> mx.array:
    return deferred_glu_ops(gate_up, s)
