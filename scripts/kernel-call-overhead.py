"""Python time per kernel call (graph building only, no kernel runs), any build.

At ~10 µs a launch on Metal/CUDA, the Python that builds a decode step must stay
below the GPU's time for it (mlx-lm overlaps the two). A stand-in replaces the
mx.fast kernel object, so this measures only our wrappers: pickers, plans,
inputs. Usage: python scripts/kernel-call-overhead.py [CALLS]
"""

import time

import mlx.core as mx

from flashnorm_mlx import kernels as K

D, F, HQ, HKV, HD = 576, 1536, 9, 3, 64  # SmolLM2-135M shapes


def main(n: int = 5000):
    outs = [mx.zeros((1, 1, D)), mx.zeros((1, 1, 1)), mx.zeros((1, 1, D))]
    K._common.gpu_backend = lambda: "cuda"  # pick the kernels on any build
    K._common.make_kernel = lambda *a, **k: lambda **kw: outs[
        : len(kw["output_shapes"])
    ]
    h, ms = mx.zeros((1, 1, D)), mx.ones((1, 1, 1))
    gu, qkv = mx.zeros((1, 1, 2 * F)), mx.zeros((1, 1, (HQ + 2 * HKV) * HD))
    inv = K.rope_inv_freq(K.epilogue.nn.RoPE(HD), HD)
    epi = K.Epilogue(HQ, HKV, inv, scale=0.125)
    cases = {
        "residual": lambda: K.residual(h, h, ms, 1e-5),
        "residual_norm": lambda: K.residual_norm(h, h, ms, 1e-5),
        "deferred_glu": lambda: K.deferred_glu(gu, ms),
        "qkv_epilogue": lambda: K.qkv_epilogue(qkv, ms, 5, epi),
        "mx add (reference)": lambda: h + h,
    }
    # The stand-in kernel would fail its first-use check against the twin: the
    # picker's own cost is measured apart (it checks each variant once).
    with K.picking(lambda op, kernel, ops: kernel):
        for name, fn in cases.items():
            fn()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            print(f"{name:20s} {(time.perf_counter() - t) / n * 1e6:6.1f} µs per call")


if __name__ == "__main__":
    import sys

    main(*(int(a) for a in sys.argv[1:2]))
