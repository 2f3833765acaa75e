"""Host and device time per call of FlashNorm's ops and the built-ins they replace.

Two measurements (docs/design.md section 4a: a step costs host build per op, plus
MLX's encoding per primitive, plus the GPU):
- wrappers (any build): Python time per call of our wrappers alone (pickers,
  plans, inputs) with a stand-in for the mx.fast kernel object, so no kernel
  runs; `mx add` for scale;
- real calls (`--real`, the default where a Metal or CUDA backend runs the
  kernels): a chain of calls, each reading the previous output, timed as build
  (until the calls return) and eval (mx.eval of the chain) per call, for each
  op and for what stock mlx-lm runs in its place: `mx.fast.rms_norm` after an
  add, silu(gate) * up, two `mx.fast.rope` with head reshapes. Without a GPU
  the ops run their twins and the built-ins their CPU forms.

Usage: python scripts/kernel-call-overhead.py [--real | --wrappers] [CALLS]
"""

import sys
import time

import mlx.core as mx
import mlx.nn as nn

from flashnorm_mlx import kernels as K

D, F, HQ, HKV, HD = 576, 1536, 9, 3, 64  # SmolLM2-135M shapes
EPS = 1e-5


def wrappers(n: int) -> None:
    outs = [mx.zeros((1, 1, D)), mx.zeros((1, 1, 1)), mx.zeros((1, 1, D))]
    K._common.gpu_backend = lambda: "cuda"  # pick the kernels on any build
    K._common.make_kernel = lambda *a, **k: lambda **kw: outs[
        : len(kw["output_shapes"])
    ]
    h, ms = mx.zeros((1, 1, D)), mx.ones((1, 1, 1))
    gu, qkv = mx.zeros((1, 1, 2 * F)), mx.zeros((1, 1, (HQ + 2 * HKV) * HD))
    epi = K.Epilogue(HQ, HKV, K.rope_angles(nn.RoPE(HD), HD), scale=0.125)
    cases = {
        "residual": lambda: K.residual(h, h, ms, EPS),
        "residual_norm": lambda: K.residual_norm(h, h, ms, EPS),
        "deferred_glu": lambda: K.deferred_glu(gu, ms),
        "qkv_epilogue": lambda: K.qkv_epilogue(qkv, ms, 5, epi),
        "mx add (reference)": lambda: h + h,
    }
    print("wrappers: Python µs per call, a stand-in kernel (nothing runs)")
    # The stand-in kernel would fail its first-use check against the twin: the
    # picker's own cost is measured apart (it checks each kernel form once).
    with K.picking(lambda op, kernel, ops: kernel):
        for name, fn in cases.items():
            fn()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            print(f"{name:20s} {(time.perf_counter() - t) / n * 1e6:6.1f} µs per call")


def _chain(name: str, step, x: mx.array, n: int) -> None:
    """`step(y) -> y'` n times, each call reading the last output."""
    mx.eval(step(x))  # the first call of a shape checks and compiles: untimed
    t0 = time.perf_counter()
    y = x
    for _ in range(n):
        y = step(y)
    t1 = time.perf_counter()
    mx.eval(y)
    t2 = time.perf_counter()
    build, run = (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6
    print(f"{name:44s} build {build:7.1f} µs  eval {run:7.1f} µs  per call")


def real(n: int) -> None:
    dt = mx.bfloat16 if K.backend() else mx.float32
    x = mx.random.normal((1, 1, D)).astype(dt)
    w = (1 + mx.random.uniform(shape=(D,))).astype(dt)
    ms = mx.ones((1, 1, 1))
    gu = mx.random.normal((1, 1, 2 * F)).astype(dt)
    qkv = mx.random.normal((1, 1, (HQ + 2 * HKV) * HD)).astype(dt)
    angles = K.rope_angles(nn.RoPE(HD), HD)
    epi = K.Epilogue(HQ, HKV, angles, scale=HD**-0.5)
    offset = mx.array([5], dtype=mx.int32)
    mx.eval(x, w, gu, qkv, angles.inv_freq, offset)
    where = K.backend() or "no GPU backend: twins and the CPU forms of built-ins"
    name = str(dt).replace("mlx.core.", "")
    print(f"real calls ({where}; {name}, SmolLM2-135M shapes, chains of {n})")

    def stock_heads(y):  # what stock runs for q and k: head layout, two ropes
        q, k, v = mx.split(y, [HQ * HD, (HQ + HKV) * HD], axis=-1)
        q = q.reshape(1, 1, HQ, HD).transpose(0, 2, 1, 3)
        k = k.reshape(1, 1, HKV, HD).transpose(0, 2, 1, 3)
        rope = dict(traditional=False, base=1e4, scale=1.0, offset=offset)
        q, k = mx.fast.rope(q, HD, **rope), mx.fast.rope(k, HD, **rope)
        v = v.reshape(1, 1, HKV, HD).transpose(0, 2, 1, 3)
        return q, k, v

    def heads_back(q, k, v):  # the chain's next input, from the three outputs
        return mx.concatenate([a.reshape(1, 1, -1) for a in (q, k, v)], axis=-1)

    g = gu[..., :F]
    cases = [
        (
            "residual (h + s*y, ms, xs with gain)",
            x,
            lambda y: K.residual(y, x, ms, EPS, w)[2],
        ),
        (
            "stock: h + y, mx.fast.rms_norm",
            x,
            lambda y: mx.fast.rms_norm(y + x, w, EPS),
        ),
        (
            "residual_norm (last block + final norm)",
            x,
            lambda y: K.residual_norm(y, x, ms, EPS, w),
        ),
        ("deferred_glu", g, lambda y: K.deferred_glu(mx.concatenate([y, y], -1), ms)),
        ("stock: silu(gate) * up", g, lambda y: nn.silu(y) * y),
        (
            "qkv_epilogue",
            qkv,
            lambda y: heads_back(*K.qkv_epilogue(y, ms, offset, epi)),
        ),
        (
            "stock: head reshapes + 2 mx.fast.rope",
            qkv,
            lambda y: heads_back(*stock_heads(y)),
        ),
        ("mx add (reference)", x, lambda y: y + x),
    ]
    for name, start, step in cases:
        _chain(name, step, start, n)


def main(argv) -> None:
    how = "--real" if K.backend() else "--wrappers"
    if argv and argv[0] in ("--real", "--wrappers"):
        how, argv = argv[0], argv[1:]
    n = int(argv[0]) if argv else 5000
    (real if how == "--real" else wrappers)(n if how == "--wrappers" else min(n, 300))


if __name__ == "__main__":
    main(sys.argv[1:])
