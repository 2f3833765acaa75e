"""The deferred-scaling ops FlashNorm models call, as custom kernels and plain ops.

One module per op, the kernel body beside its plain-MLX twin:
- `block_residual`: `residual` (h + s*y, its mean square, the next matmul's
  input xs, with the next norm's gain where it is not folded) and
  `residual_norm` (the last one, fused with the final RMSNorm);
- `post_norm`: `post_residual` and `post_residual_norm`, the same after a
  post-norm (Gemma's norm on a sublayer's output before the residual add);
- `glu`: `deferred_glu`, act(s * gate) * up, act SiLU or GELU (tanh);
- `attention`: `decode_attention`, one query per head over the first n cache
  positions, n from an array (the compiled decode step's attention), and
  `scaled_dot_product_attention`, mlx-lm's call that sends that step's cache
  to it;
- `epilogue`: `qkv_epilogue`, q', k', v' from the fused qkv matmul output;
- `render`: the kernel dialect and its Metal and CUDA preludes;
- `_common`: backend choice, the picker, lazy kernel objects, the prescale.

The package exports what models, decode, dispatch and bench call; a kernel
(`<op>_kernel`) and its twin (`<op>_ops`) stay in their op's module.

Each op `<op>` picks `<op>_kernel` (one `mx.fast` kernel launch) where a Metal
or CUDA backend runs it, else `<op>_ops`, its twin with the same signature.
FLASHNORM_KERNELS=0 forces the twins; FLASHNORM_KERNELS=op1,op2 enables only
those kernels (for measuring one at a time).

On Metal and CUDA every launched primitive costs ~10 µs of a decode step, so
the ops are cut along launches, not along the math (docs/design.md section 3):
a block is qkv matmul -> `qkv_epilogue` -> cache -> attention -> o_proj ->
`residual` -> gate|up matmul -> `deferred_glu` -> down matmul -> `residual`.
Every small piece of math (rsqrt, the float16 power-of-two prescale, casts)
happens inside those kernels: they take ms = mean(x^2) + eps, never a
precomputed s. Wherever the compute dtype is float16 the residual x reaches
the matmuls as x * p, p = `pow2_prescale(ms)` an exact power of two near 1/RMS,
and the deferred scalar is s = rsqrt(ms) / p; every op derives p from ms with
the same integer arithmetic, so producer and consumer agree bit for bit.
"""

from ._common import (
    backend,
    deferred_scale,
    failures,
    gpu_backend,
    is_tracing,
    picking,
    scaled,
    tracing,
)
from .attention import decode_attention, scaled_dot_product_attention
from .block_residual import residual, residual_norm
from .epilogue import Epilogue, RopeAngles, qkv_epilogue, rope_angles
from .glu import deferred_glu
from .post_norm import post_residual, post_residual_norm

__all__ = [
    "Epilogue",
    "RopeAngles",
    "backend",
    "decode_attention",
    "deferred_glu",
    "deferred_scale",
    "failures",
    "gpu_backend",
    "is_tracing",
    "picking",
    "post_residual",
    "post_residual_norm",
    "qkv_epilogue",
    "residual",
    "residual_norm",
    "scaled",
    "rope_angles",
    "scaled_dot_product_attention",
    "tracing",
]
