"""Backend choice, the picker, lazy kernel objects and the deferred scalar.

Shared by every op in this package. Op modules call `_common.pick` and pass
`_common.make_kernel` through attribute access at call time, so tests and
`dispatch.gpu_like` can replace them here.
"""

import contextlib
import functools
import os
import sys
from typing import Dict, List, Optional, Tuple

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
    """The picker: `kernel` where a Metal or CUDA backend runs it now, else `ops`.

    A kernel is checked against its twin at the first use of each form
    (`_first_use_checked`); one that fails is not picked again on that backend.
    """
    if _CHOOSER.choose is not None:  # within `picking`
        return _CHOOSER.choose(op, kernel, ops)
    b = backend(op)
    if b is None or (op, b) in FAILED:
        return ops
    return _first_use_checked(op, b, kernel, ops)


# (op, backend) -> the one line said when its kernel failed its first-use check.
FAILED: Dict[Tuple[str, str], str] = {}
# Relative error (of max |twin|) past which a kernel disagrees with its twin:
# far above rounding, so only a broken kernel or compiler trips it.
CHECK_TOL = {mx.float32: 1e-3, mx.float16: 2e-2, mx.bfloat16: 1e-1}


def failures() -> List[str]:
    """One line per kernel this process fell back from (bench's notes)."""
    return list(FAILED.values())


def _form(args) -> tuple:
    """What selects a kernel's form: dtypes and which optional inputs are given."""
    key = []
    for a in args:
        if isinstance(a, mx.array):
            key.append(a.dtype)
        elif a is None or isinstance(a, (int, float)):
            key.append(a is None)
        elif isinstance(a, str):  # a named form (the GLU's activation)
            key.append(a)
        else:  # an Epilogue: its form (optional inputs, rotated dims)
            key.append(a.form())
    return tuple(key)


@functools.lru_cache(maxsize=64)
def _first_use_checked(op: str, b: str, kernel, ops):
    """`kernel`, run once per form beside `ops` on the same inputs first: if it
    fails to compile, raises or disagrees, the twin's result is used, and the
    twin from then on, with one line on stderr naming the op, backend, error."""
    seen = set()

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        key = _form(args)
        if key in seen:
            return kernel(*args, **kwargs)
        if _TRACING:
            # A check evaluates, which a trace cannot: this trace runs the twin,
            # and the kernel stays on for the eager call that checks it.
            return ops(*args, **kwargs)
        want = ops(*args, **kwargs)
        try:
            got = kernel(*args, **kwargs)
            mx.eval(got, want)
            err = _disagreement(got, want)
        except Exception as e:  # compile errors surface at evaluation
            err = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if err is None:
            seen.add(key)
            return got
        _fail(op, b, err)
        return want

    return run


def _disagreement(got, want) -> Optional[str]:
    got = [got] if isinstance(got, mx.array) else list(got)
    want = [want] if isinstance(want, mx.array) else list(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {i} is {g.dtype}{g.shape}, its twin's {w.dtype}{w.shape}"
        g32, w32 = g.astype(mx.float32), w.astype(mx.float32)
        both_nan = mx.isnan(g32) & mx.isnan(w32)  # NaN in, NaN out: no verdict
        diff = mx.where(both_nan, 0.0, mx.abs(g32 - w32)).max().item()
        scale = mx.where(both_nan, 0.0, mx.abs(w32)).max().item()
        err = diff / scale if diff else 0.0
        if not err <= CHECK_TOL.get(w.dtype, 1e-3):  # a NaN of its own disagrees
            return f"output {i} differs from its twin by {err:.2e} (relative)"
    return None


def _fail(op: str, b: str, err: str) -> None:
    line = (
        f"the {op} kernel failed its first-use check on {b} ({err}); using its "
        "plain-MLX twin from now on. Please report this with `flashnorm-mlx bench` "
        "output."
    )
    FAILED[(op, b)] = line
    print(f"flashnorm-mlx: note: {line}", file=sys.stderr, flush=True)


_TRACING = False


def is_tracing() -> bool:
    """Whether calls now may be traced by `mx.compile` (so must not evaluate)."""
    return _TRACING


@contextlib.contextmanager
def tracing():
    """Within: calls may be traced by `mx.compile`, so no first-use check runs
    (it would evaluate). The compiled decode step runs each shape eagerly once
    first, so every form it uses is checked before it is traced."""
    global _TRACING
    saved, _TRACING = _TRACING, True
    try:
        yield
    finally:
        _TRACING = saved


@contextlib.contextmanager
def picking(choose):
    """Within: every op runs `choose(op, kernel, ops)` instead of the picker's
    choice (`dispatch.gpu_like` counts launches this way). The choice is state
    `pick` reads, not a rebinding of `pick`, so a caller that holds `pick` gets
    it too."""
    saved, _CHOOSER.choose = _CHOOSER.choose, choose
    try:
        yield
    finally:
        _CHOOSER.choose = saved


class _Chooser:
    # `picking`'s choice while one is active (None: the picker's own).
    choose = None


_CHOOSER = _Chooser()


@functools.cache
def _make_kernel(name: str, backend_name: str, body: str, inputs, outputs, flags):
    source = render(body, backend_name, **dict(flags))
    make = mx.fast.metal_kernel if backend_name == "metal" else mx.fast.cuda_kernel
    form = "".join(f"_{k}{int(v)}" for k, v in flags)
    return make(
        name=f"flashnorm_{name}{form}",
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


def kernel_inputs(*pairs) -> Tuple[Tuple[str, ...], List[mx.array]]:
    """A kernel's input names and arrays from one list of (name, array) pairs, so
    the two cannot fall out of order; a pair whose array is None is left out
    (the kernel's form without that input). The names key the launch plan."""
    names, arrays = [], []
    for name, a in pairs:  # a plain loop: every op call of a step pays for it
        if a is not None:
            names.append(name)
            arrays.append(a)
    return tuple(names), arrays


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


def scaled(
    y: mx.array, ms: mx.array, bias: Optional[mx.array] = None, relu2: bool = False
) -> mx.array:
    """y * deferred_scale(ms) in y's dtype, y (..., n) and ms (..., 1), then
    + bias (n,) and relu² where asked: one launch where rsqrt, the product,
    the bias and the activation are several (mx.compile fuses them, as
    mlx-lm's own compiled SwiGLU), for a matmul output s must reach before a
    nonlinearity or a convolution (docs/design.md sections 2k, 2p). float16's
    prescale reads ms's bits (a view a shapeless trace cannot shape): plain ops."""
    if prescaled(y.dtype):
        y = (y * deferred_scale(ms, y.dtype)).astype(y.dtype)
        y = y if bias is None else y + bias
        return mx.square(mx.maximum(y, 0)) if relu2 else y
    if bias is None:
        return _scaled_relu2(y, ms) if relu2 else _scaled(y, ms)
    return _scaled_bias_relu2(y, ms, bias) if relu2 else _scaled_bias(y, ms, bias)


@functools.partial(mx.compile, shapeless=True)
def _scaled(y, ms):
    return (y * mx.rsqrt(ms)).astype(y.dtype)


@functools.partial(mx.compile, shapeless=True)
def _scaled_bias(y, ms, bias):
    return (y * mx.rsqrt(ms)).astype(y.dtype) + bias


@functools.partial(mx.compile, shapeless=True)
def _scaled_relu2(y, ms):  # relu² as mlx's nn.relu2: max(y, 0)²
    return mx.square(mx.maximum((y * mx.rsqrt(ms)).astype(y.dtype), 0))


@functools.partial(mx.compile, shapeless=True)
def _scaled_bias_relu2(y, ms, bias):
    return mx.square(mx.maximum((y * mx.rsqrt(ms)).astype(y.dtype) + bias, 0))
