"""Kernel bodies written once, rendered for Metal and CUDA.

A body is written in a small dialect: FN_* macros for thread indices, shared
memory, barriers and math, `T` for the output type, and `#if FN_<FLAG>` for
render-time forms. `render` puts a per-backend prelude that defines those
macros in front of the body; the result is the `source` of
`mx.fast.metal_kernel` or `mx.fast.cuda_kernel`. All kernel arithmetic is
float32; outputs take the input dtype.
"""

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
#define FN_TANH(x) metal::precise::tanh(x)
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
#define FN_TANH(x) tanhf(x)
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


# Tree sum over the NT threads of a threadgroup into red[0] (RP: a power of
# two >= NT). Every thread of the group must reach it: no early return before.
TREE_SUM = """\
  for (int stride = RP / 2; stride > 0; stride /= 2) {
    FN_SYNC();
    if (lane < stride && lane + stride < NT) {
      red[lane] += red[lane + stride];
    }
  }
  FN_SYNC();
"""
