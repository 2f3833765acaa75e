"""Backend choice, the picker, lazy kernel objects and the deferred scalar.

Shared by every op in this package. Op modules call `_common.pick` and pass
`_common.make_kernel` through attribute access at call time, so tests and
`dispatch.gpu_like` can replace them here.
"""

import contextlib
import functools
import os
from typing import Optional

import mlx.core as mx

from .render import render


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _available_backend() -> Optional[str]:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def gpu_backend() -> Optional[str]:
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
    return gpu_backend()


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


@contextlib.contextmanager
def picking(choose):
    """Within: every op runs `choose(op, kernel, ops)` instead of the picker's
    choice (`dispatch.gpu_like` counts launches this way)."""
    global pick
    saved, pick = pick, choose
    try:
        yield
    finally:
        pick = saved


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


def make_kernel(name: str, body: str, inputs, outputs, **flags):
    b = gpu_backend()
    if b is None:
        raise RuntimeError(
            f"{name}_kernel needs a Metal or CUDA backend; use {name}_ops"
        )
    return _make_kernel(
        name, b, body, tuple(inputs), tuple(outputs), tuple(sorted(flags.items()))
    )


@functools.cache
def consts(*values: float) -> mx.array:
    # Float parameters travel as a small float32 array (templates take ints only).
    return mx.array(values, dtype=mx.float32)


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
