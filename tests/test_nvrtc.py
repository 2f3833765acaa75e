"""Every kernel's CUDA rendering, compiled by NVRTC as MLX's `mx.fast.cuda_kernel`
compiles it: no GPU needed, only NVRTC and the CUDA headers from PyPI.

What is compiled: every launch the real `<op>_kernel` wrappers make (recorded with
test_kernels.py's `record_all_forms`, completed to every render-time form
`#if FN_<FLAG>` in float32, float16 and bfloat16, plus the template ints of real
model shapes), each wrapped in the source MLX 0.32.4 builds around a body
(`build_kernel` in mlx/backend/cuda/custom_kernel.cpp: its default header, namespace
`mlx::core::cu`, `__global__ void custom_kernel_<name><template hash>(...)` with a
pointer per input, `const __grid_constant__ Shape <input>_shape` where the source
names it, a pointer per output, `constexpr int` / `using T` for the template
arguments, then the source), one NVRTC program per kernel as MLX makes it
(jit_module.cpp: MLX's device headers as in-memory headers, the kernel's name
expression, `--device-as-default-execution-space`, `--gpu-architecture=sm_90a` as on
an H100 or H200, include paths: mlx/include, CCCL, the CUDA headers). The
kernels share one program (`compile_together`): NVRTC's fixed cost per program
(~0.6 s of CPU: parsing the headers) would otherwise be paid 112 times; each
kernel's text comes in verbatim after a `#line 1 "<kernel>.cu"` and is followed by
`#undef`s of the macros it defines, so its diagnostics read and its text compiles
as in its own program (MLX's options, no `-pch`). Where the program fails, the
kernels its log names are compiled alone, each in its own program as MLX does.

Where the parts come from:
- NVRTC 13 and the CUDA headers: the PyPI packages of the `nvrtc` extra
  (`pip install -e ".[nvrtc]"`, what mlx-cuda-13 itself installs, plus CCCL).
  Without them every compile test skips, saying so.
- MLX's device headers (utils.cuh and what it includes): MLX compiles them into
  libmlx.so. tests/mlx_cuda_headers/ holds them byte for byte as mlx-cuda-13 0.32.4
  embeds them (MIT, its LICENSE beside them). Where an MLX CUDA build is installed,
  or FLASHNORM_MLX_CUDA_LIB names its libmlx.so, they come from that library
  instead, and a test checks the copies and the wrapper's fixed text against it.
- CCCL: MLX's own bundle (mlx/include/cccl) where an MLX CUDA build is installed,
  else nvidia-cuda-cccl 13.1 (CCCL 3.1.4; mlx-cuda-13 0.32.4 bundles 3.1.3).

Where this may differ from a real run: one architecture (sm_90a; an A100 gets
sm_80); the CCCL patch version above; the other kernels beside a passing kernel in
its program (separate functions, their macros undefined after them); of MLX's 17
in-memory device headers only the 3 the source includes are given; the program
is named `<kernel>.cu` (its `#line` where shared), not `<kernel>_<hash>.cu`; and an
MLX newer than 0.32.4 may build other text around the body: on a CUDA machine a
test compares the reconstruction with MLX's own (`verbose=True`) for several
kernels.
A compile fails on errors and on any warning in the kernel's own text ("declared
but never referenced", #177, included).

Apple's Metal compiler runs only on macOS, so no Metal compile of this kind exists
here; tests/test_metal_host.py compiles the exact Metal source MLX generates as
host C++ against a stand-in for Metal instead, and runs it against the twins.
"""

import ctypes
import importlib.util
import os
import re
from pathlib import Path
from typing import NamedTuple, Optional

import mlx.core as mx
import pytest
import test_kernels as TK

from flashnorm_mlx import kernels as K

MLX_CHECKED = "0.32.4"  # the MLX whose build_kernel and headers this reproduces
ARCH = "sm_90a"  # MLX's --gpu-architecture on compute capability 9.0 (H100, H200)
INSTALL = 'pip install -e ".[nvrtc]"'
VENDORED = Path(__file__).parent / "mlx_cuda_headers"
DEVICE = "mlx/backend/cuda/device/"
DEVICE_HEADERS = ("utils.cuh", "complex.cuh", "config.h")  # utils.cuh's closure

# build_kernel's fixed text (mlx/backend/cuda/custom_kernel.cpp).
DEFAULT_HEADER = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n'
    "#include <cooperative_groups.h>\n\n"
)
OPEN = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
CLOSE = "\n}\n\n} // namespace mlx::core::cu\n"
SHAPE_INFO = (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int"))
CUDA_TYPE = {  # dtype_to_cuda_type
    mx.float32: "float",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.int32: "int32_t",
}
TYPE_STRING = {  # get_type_string, for the kernel name's template hash
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.int32: "int32_t",
}


class Launch(NamedTuple):
    """One `mx.fast.cuda_kernel` call as MLX receives it."""

    name: str
    source: str
    input_names: tuple
    inputs: tuple  # (dtype, ndim) per input
    output_names: tuple
    output_dtypes: tuple
    template: tuple
    grid: tuple
    threadgroup: tuple

    @property
    def kernel_name(self) -> str:
        tail = ""
        for _, v in self.template:
            if isinstance(v, bool):
                tail += "_t" if v else "_f"
            elif isinstance(v, int):
                tail += f"_{v}"
            else:
                tail += "_" + TYPE_STRING[v]
        return "custom_kernel_" + self.name + tail

    @property
    def dtype(self):
        return dict(self.template)["T"]

    @property
    def flags(self) -> dict:
        return dict(re.findall(r"#define FN_([A-Z_]+) ([01])\n", self.source))


def mlx_cuda_source(launch: Launch) -> str:
    """The kernel source MLX 0.32.4's `build_kernel` makes (header "")."""
    out = [DEFAULT_HEADER, OPEN, "__global__ void ", launch.kernel_name, "(\n"]
    for n, (dtype, ndim) in zip(launch.input_names, launch.inputs, strict=True):
        out += ["    const ", CUDA_TYPE[dtype], "* ", n, ",\n"]
        if ndim > 0:  # shape_infos: the name found anywhere in the source
            for suffix, decl in SHAPE_INFO:
                if n + suffix in launch.source:
                    out += [f"    const __grid_constant__ {decl} ", n + suffix, ",\n"]
    last = len(launch.output_names) - 1
    for i, (n, d) in enumerate(zip(launch.output_names, launch.output_dtypes)):
        out += ["    ", CUDA_TYPE[d], "* ", n, ",\n" if i < last else ") {\n"]
    for name, v in launch.template:
        if isinstance(v, bool):
            out.append(f"  constexpr bool {name} = {str(v).lower()};\n")
        elif isinstance(v, int):
            out.append(f"  constexpr int {name} = {v};\n")
        else:
            out.append(f"  using {name} = {CUDA_TYPE[v]};\n")
    if launch.template:
        out.append("\n")
    return "".join(out + [launch.source, CLOSE])


# --- the launches: every form the wrappers make, through the real code --------


class Recorder:
    """A `record_all_forms` host: the project's own `_make_kernel` (kernel name,
    CUDA rendering) makes each kernel, with `mx.fast.cuda_kernel` replaced by
    `cuda_kernel` below, which notes each call as MLX would receive it."""

    def __init__(self):
        self.launches = {}  # full source -> Launch

    def record(self, name, body, inputs, outputs, **flags):
        make = K._common._make_kernel.__wrapped__  # uncached: bodies may be patched
        flags = tuple(sorted(flags.items()))
        return make(name, "cuda", body, tuple(inputs), tuple(outputs), flags)

    def cuda_kernel(
        self,
        name,
        input_names,
        output_names,
        source,
        header="",
        ensure_row_contiguous=True,
        shared_memory=0,
    ):
        assert header == "" and shared_memory == 0, "not in the reconstruction"

        def call(
            *,
            inputs,
            output_shapes,
            output_dtypes,
            grid,
            threadgroup,
            template=None,
            init_value=None,
            verbose=False,
            stream=None,
        ):
            launch = Launch(
                name,
                source,
                tuple(input_names),
                tuple((x.dtype, x.ndim) for x in inputs),
                tuple(output_names),
                tuple(output_dtypes),
                tuple(template or ()),
                tuple(grid),
                tuple(threadgroup),
            )
            self.launches.setdefault(mlx_cuda_source(launch), launch)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return call


# Real checkpoints' shapes, for their template ints: hidden size D, FFN width F,
# query and KV heads, head dim, epilogue mode, checkpoint dtype (one decode token).
MODEL_SHAPES = {
    "smollm2-135m": (576, 1536, 9, 3, 64, "llama", mx.bfloat16),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, "llama", mx.bfloat16),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, "qwen2", mx.bfloat16),
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, "openelm", mx.bfloat16),
    "openelm-270m-layer0": (1280, 768, 12, 3, 64, "openelm", mx.float16),
    # 3/4 partial rotary: 96 of 128 dims rotated (template RH 48 < HALF 64).
    "phi-4-mini": (3072, 8192, 24, 8, 128, "llama", mx.bfloat16, 96),
}


def _model_shape_calls(D, F, hq, hkv, h, mode, dtype, rotary=None):
    k = mx.random.split(mx.random.key(5), 4)
    ms = mx.random.uniform(0.1, 2.0, (1, 1, 1), key=k[0])
    qkv = mx.random.normal((1, 1, (hq + 2 * hkv) * h), key=k[1]).astype(dtype)
    kw = {}
    if mode == "openelm":  # QK-norm
        g = mx.ones((h,), dtype)
        kw = dict(q_gain=g, k_gain=g, eps_q=1e-6, eps_k=1e-6)
    elif mode == "qwen2":
        kw = dict(bias=mx.zeros((qkv.shape[-1],), dtype))
    R = rotary or h
    angles = K.RopeAngles(mx.ones((R // 2,), mx.float32), R)
    K.epilogue.qkv_epilogue_kernel(qkv, ms, 7, K.Epilogue(hq, hkv, angles, **kw))
    K.glu.deferred_glu_kernel(mx.zeros((1, 1, 2 * F), dtype), ms)
    x = mx.zeros((1, 1, D), dtype)
    K.block_residual.residual_kernel(x, x, ms, 1e-5)
    K.block_residual.residual_norm_kernel(x, x, ms, 1e-5, mx.ones((D,), dtype))
    kv = mx.zeros((1, hkv, 256, h), dtype)
    offset = mx.array([7], dtype=mx.int32)
    K.attention.decode_attention_kernel(mx.zeros((1, hq, 1, h), dtype), kv, kv, offset)


def record_launches(monkeypatch) -> dict:
    """full source -> Launch for every form: test_kernels' recording, then the
    forms it leaves out (every residual and residual_norm input combination)
    and the real model shapes."""
    rec = Recorder()
    monkeypatch.setattr(mx.fast, "cuda_kernel", rec.cuda_kernel)
    TK.record_all_forms(rec, monkeypatch)  # sets _common.make_kernel = rec.record
    for dtype in TK.DTYPES.values():
        h, y, ms_y, gain = TK.residual_case(dtype, (1, 2, 8))
        for yy, mm in ((None, None), (y, None), (y, ms_y)):
            for g in (None, gain):
                K.block_residual.residual_kernel(h, yy, mm, 1e-5, g)
                K.block_residual.residual_norm_kernel(h, yy, mm, 1e-5, g)
    for shape in MODEL_SHAPES.values():
        _model_shape_calls(*shape)
    return rec.launches


with pytest.MonkeyPatch.context() as _mp:
    LAUNCHES = record_launches(_mp)


def launch_id(launch: Launch) -> str:
    return launch.kernel_name[len("custom_kernel_flashnorm_") :]


# --- NVRTC and the headers ----------------------------------------------------------


def _package_dirs(name: str):
    spec = importlib.util.find_spec(name)
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _first(paths) -> Optional[Path]:
    return next((p for p in paths if p.exists()), None)


def mlx_root() -> Optional[Path]:
    return _first(_package_dirs("mlx"))


def mlx_cuda_library() -> Optional[Path]:
    """A libmlx.so with MLX's CUDA JIT sources in it: FLASHNORM_MLX_CUDA_LIB, else
    the installed MLX's where it is a CUDA build."""
    env = os.environ.get("FLASHNORM_MLX_CUDA_LIB")
    if env:
        return Path(env)
    root = mlx_root()
    lib = root / "lib" / "libmlx.so" if root else None
    if lib and lib.exists() and (root / "include" / "cccl").exists():
        return lib
    return None


# In libmlx.so each device header is a NUL-terminated char array, its "©" turned
# into two spaces (mlx/backend/cuda/bin2h.cmake).
_EMBEDDED_START = re.compile(rb"// Copyright  +20\d\d Apple Inc\.\n")
_EMBEDDED_MARK = {  # a line only that header has
    "utils.cuh": b"using Shape = cuda::std::array<int32_t, MAX_NDIM>;",
    "complex.cuh": b"using complex_t = cuda::std::complex<T>;",
    "config.h": b"#define MAX_NDIM ",
}


def embedded_headers(lib: Path) -> dict:
    data = lib.read_bytes()
    found = {}
    for m in _EMBEDDED_START.finditer(data):
        text = data[m.start() : data.index(b"\0", m.start())]
        for name, mark in _EMBEDDED_MARK.items():
            if mark in text:
                found.setdefault(name, text.decode())
    return found


class Nvrtc:
    """libnvrtc through ctypes, with MLX's in-memory headers and options."""

    def __init__(self, lib: Path, include_paths, headers: dict, origin: str):
        self.lib = ctypes.CDLL(str(lib))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"
        self.headers = headers  # include name -> text
        self.options = [  # MLX's, in its order
            "--device-as-default-execution-space",
            f"--gpu-architecture={ARCH}",
            *(f"--include-path={p}" for p in include_paths),
        ]
        self.origin = origin

    def _check(self, result, what):
        if result != 0:
            raise RuntimeError(
                f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}"
            )

    def compile(self, source: str, module: str, kernels):
        """(ok, log, kernel -> lowered name), as MLX's `compile` would see it; a
        lowered name only where the kernel's code is in the CUBIN."""
        lib, n = self.lib, len(self.headers)
        prog = ctypes.c_void_p()
        texts = (ctypes.c_char_p * n)(*[t.encode() for t in self.headers.values()])
        names = (ctypes.c_char_p * n)(*[k.encode() for k in self.headers])
        self._check(
            lib.nvrtcCreateProgram(
                ctypes.byref(prog),
                source.encode(),
                f"{module}.cu".encode(),
                n,
                texts,
                names,
            ),
            "nvrtcCreateProgram",
        )
        try:
            exprs = {k: f"mlx::core::cu::{k}".encode() for k in kernels}
            for expr in exprs.values():
                self._check(
                    lib.nvrtcAddNameExpression(prog, expr), "nvrtcAddNameExpression"
                )
            opts = (ctypes.c_char_p * len(self.options))(
                *[o.encode() for o in self.options]
            )
            result = lib.nvrtcCompileProgram(prog, len(self.options), opts)
            size = ctypes.c_size_t()
            self._check(
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "log size"
            )
            log = ctypes.create_string_buffer(size.value + 1)
            self._check(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            log = log.value.decode(errors="replace")
            if result != 0:
                return False, log, {}
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "CUBIN size")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            lowered = {}
            for k, expr in exprs.items():
                name = ctypes.c_char_p()
                self._check(
                    lib.nvrtcGetLoweredName(prog, expr, ctypes.byref(name)),
                    "nvrtcGetLoweredName",
                )
                # The CUBIN's symbol table names each kernel compiled into it.
                if name.value + b"\0" in cubin.raw:
                    lowered[k] = name.value.decode()
            return True, log, lowered
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def find_nvrtc():
    """(Nvrtc, None), or (None, why not) naming what is missing. Include paths in
    MLX's order: the MLX build's include/, its CCCL, the CUDA headers."""
    nvidia = _package_dirs("nvidia")
    lib = _first(d / "cu13" / "lib" / "libnvrtc.so.13" for d in nvidia)
    cuda_inc = _first(d / "cu13" / "include" / "cooperative_groups.h" for d in nvidia)
    cuda_inc = cuda_inc.parent if cuda_inc else None
    cuda_lib = mlx_cuda_library()  # .../mlx/lib/libmlx.so of an MLX CUDA build
    root = cuda_lib.parent.parent if cuda_lib else mlx_root()
    mlx_include = root / "include" if root and (root / "include").exists() else None
    bundled = [mlx_include / "cccl"] if mlx_include else []
    cccl = _first(bundled + [d / "cu13" / "include" / "cccl" for d in nvidia])
    missing = [
        what
        for what, found in (
            ("NVRTC 13 (nvidia-cuda-nvrtc)", lib),
            ("CUDA 13 headers (nvidia-cuda-runtime)", cuda_inc),
            ("CCCL (nvidia-cuda-cccl)", cccl),
        )
        if found is None
    ]
    if missing:
        return None, (
            f"no {', no '.join(missing)} installed: the CUDA renderings are not "
            f"compiled here; `{INSTALL}` (Linux x86_64) enables this check"
        )
    headers = embedded_headers(cuda_lib) if cuda_lib else {}
    origin = f"embedded in {cuda_lib}"
    if any(n not in headers for n in DEVICE_HEADERS):  # the drift test says why
        headers = {n: (VENDORED / DEVICE / n).read_text() for n in DEVICE_HEADERS}
        origin = f"copied from mlx-cuda-13 {MLX_CHECKED} ({VENDORED})"
    includes = [mlx_include] * bool(mlx_include) + [cccl, cuda_inc]
    headers = {DEVICE + n: headers[n] for n in DEVICE_HEADERS}
    return Nvrtc(lib, includes, headers, origin), None


NVRTC, NO_NVRTC = find_nvrtc()
needs_nvrtc = pytest.mark.skipif(NVRTC is None, reason=str(NO_NVRTC))


def compile_launch(launch: Launch, source: Optional[str] = None):
    """(ok, log, lowered name or None): the kernel alone in its program, as MLX."""
    source = mlx_cuda_source(launch) if source is None else source
    k = launch.kernel_name
    ok, log, lowered = NVRTC.compile(source, k, [k])
    return ok, log, lowered.get(k)


def program_unit(launch: Launch) -> str:
    """A kernel's MLX source inside a shared program: diagnostics read
    `<kernel>.cu(line)` as in its own, and its macros end with it."""
    defined = sorted(set(re.findall(r"^#define (\w+)", launch.source, re.M)))
    undefs = "".join(f"#undef {m}\n" for m in defined)
    return f'#line 1 "{launch.kernel_name}.cu"\n' + mlx_cuda_source(launch) + undefs


def compile_together(launches) -> dict:
    """kernel name -> (ok, log, lowered name or None), many kernels per NVRTC
    program. Where the program fails, the kernels its log names are compiled
    alone and the rest together again (in halves where it names none): each
    result is a passing shared program's or the kernel's own program's."""
    launches = list(launches)
    if len(launches) == 1:
        return {launches[0].kernel_name: compile_launch(launches[0])}
    names = [k.kernel_name for k in launches]
    source = "".join(map(program_unit, launches))
    ok, log, lowered = NVRTC.compile(source, "flashnorm_kernels", names)
    if ok:
        return {k: (True, log, lowered.get(k)) for k in names}
    named = [k for k in launches if f"\n{k.kernel_name}.cu(" in "\n" + log]
    if named:
        out = {k.kernel_name: compile_launch(k) for k in named}
        rest = [k for k in launches if k not in named]
        return out | (compile_together(rest) if rest else {})
    half = len(launches) // 2
    return compile_together(launches[:half]) | compile_together(launches[half:])


# Diagnostics in the kernel's own text read `<kernel>.cu(line): ...` (the program is
# named after the kernel; MLX names it `<kernel>_<hash of source>.cu`). Every one
# fails the check, an unused local of some form (#177) too.
ALLOWED_WARNINGS = ()


def own_warnings(launch: Launch, log: str):
    return [
        line
        for line in log.splitlines()
        if line.startswith(f"{launch.kernel_name}.cu(")
        and not any(w in line for w in ALLOWED_WARNINGS)
    ]


@pytest.fixture(scope="module")
def compiled():
    """kernel name -> (ok, log, lowered) for every launch, all in one program."""
    if NVRTC is None:
        pytest.skip(NO_NVRTC)
    return compile_together(LAUNCHES.values())


# --- the checks ------------------------------------------------------------------


def test_every_render_time_form_is_recorded():
    """Every `#if FN_<FLAG>` combination of every body in every dtype it occurs in
    (the float16 pre-scale exists in float16 only, by `prescaled`)."""
    seen = {
        (k.name.split("_")[1], k.dtype, tuple(sorted(k.flags.items())))
        for k in LAUNCHES.values()
    }
    want = set()
    for op, flags in TK.FORMS:
        for dtype in TK.DTYPES.values():
            if flags.get("prescale", K._common.prescaled(dtype)) == K._common.prescaled(
                dtype
            ):
                items = tuple(sorted((k.upper(), str(v)) for k, v in flags.items()))
                want.add((op.split("_")[0], dtype, items))
    assert want <= seen, sorted(map(str, want - seen))
    # qkv_epilogue also comes with per-batch offsets (template OFS=1).
    assert {dict(k.template).get("OFS") for k in LAUNCHES.values()} >= {0, 1}


@needs_nvrtc
@pytest.mark.parametrize("kernel", LAUNCHES.values(), ids=launch_id)
def test_cuda_rendering_compiles_with_nvrtc(compiled, kernel):
    ok, log, lowered = compiled[kernel.kernel_name]
    where = (
        f"NVRTC {NVRTC.version}, {ARCH}, MLX {mx.__version__}, headers {NVRTC.origin}"
    )
    assert ok, f"{kernel.kernel_name} does not compile ({where}):\n{log[-6000:]}"
    assert lowered and kernel.kernel_name in lowered, lowered
    assert not own_warnings(kernel, log), log[-6000:]
    assert kernel.threadgroup[0] <= 1024, kernel.threadgroup  # CUDA's block limit


def _one_launch(monkeypatch, run) -> dict:
    """The launches `run()` makes through the real wrappers (bodies as patched)."""
    rec = Recorder()
    monkeypatch.setattr(mx.fast, "cuda_kernel", rec.cuda_kernel)
    monkeypatch.setattr(K._common, "make_kernel", rec.record)
    run()
    return rec.launches


@needs_nvrtc
def test_a_broken_body_fails_to_compile(monkeypatch):
    """The check can fail: an undefined identifier in the residual body."""
    broken = K.block_residual.RESIDUAL_BODY.replace(
        "acc += v * v;", "acc += v * fn_undefined_name;"
    )
    assert broken != K.block_residual.RESIDUAL_BODY
    monkeypatch.setattr(K.block_residual, "RESIDUAL_BODY", broken)
    h, y, ms_y, _ = TK.residual_case(mx.bfloat16, (1, 2, 8))
    (launch,) = _one_launch(
        monkeypatch, lambda: K.block_residual.residual_kernel(h, y, ms_y, 1e-5)
    ).values()
    assert "fn_undefined_name" in launch.source
    ok, log, _ = compile_launch(launch)
    assert not ok, log
    assert 'identifier "fn_undefined_name" is undefined' in log, log[-3000:]


@needs_nvrtc
def test_a_break_in_one_form_fails_only_that_form(monkeypatch):
    """The render-time flags reach the compiler: a typo inside `#if FN_PRESCALE`
    breaks the float16 kernel only."""
    body = K.glu.DEFERRED_GLU_BODY
    broken = body.replace(
        "FN_RSQRT(msr) / FN_POW2_PRESCALE(msr)", "FN_RSQRT(msr) / msr_typo"
    )
    assert broken != body
    monkeypatch.setattr(K.glu, "DEFERRED_GLU_BODY", broken)

    def run():
        for dtype in TK.DTYPES.values():
            K.glu.deferred_glu_kernel(*TK.glu_case(dtype, (1, 2, 8)))

    # In one program, as `compiled` compiles them: the failure names its kernel.
    launches = _one_launch(monkeypatch, run).values()
    together = compile_together(launches)
    results = {k.dtype: together[k.kernel_name] for k in launches}
    assert set(results) == set(TK.DTYPES.values())
    assert not results[mx.float16][0], "the float16 (pre-scaled) form compiled"
    assert 'identifier "msr_typo" is undefined' in results[mx.float16][1]
    for dtype in (mx.float32, mx.bfloat16):
        assert results[dtype][0], results[dtype][1][-3000:]


@needs_nvrtc
def test_a_warning_in_a_shared_program_is_its_kernels_only(monkeypatch):
    """In one program, GELU forms first: an unused local under `FN_GELU` (#177)
    is each GELU kernel's own warning, and no SiLU kernel's after them (their
    macros end with them: the body tests `defined(FN_GELU)`)."""
    body = K.glu.DEFERRED_GLU_BODY
    mark = "  out[i] = static_cast<T>(a * u);\n"
    extra = "#if defined(FN_GELU) && FN_GELU\n  const float fn_unused = a;\n#endif\n"
    assert mark in body
    monkeypatch.setattr(K.glu, "DEFERRED_GLU_BODY", body.replace(mark, extra + mark))

    def run():
        for activation in ("gelu_tanh", "silu"):
            for dtype in (mx.float32, mx.float16):
                args = TK.glu_case(dtype, (1, 2, 8))
                K.glu.deferred_glu_kernel(*args, activation)

    launches = list(_one_launch(monkeypatch, run).values())
    results = compile_together(launches)
    gelu = [k.flags.get("GELU") == "1" for k in launches]
    assert gelu == [True, True, False, False], [k.kernel_name for k in launches]
    for k, is_gelu in zip(launches, gelu):
        ok, log, lowered = results[k.kernel_name]
        assert ok and lowered, log[-3000:]
        warned = own_warnings(k, log)
        assert bool(warned) == is_gelu, (k.kernel_name, warned, log[-3000:])
        assert all('"fn_unused"' in w for w in warned), warned


def test_the_wrapper_declares_what_the_body_uses():
    """The reconstruction itself: `<input>_shape` only where the source names it,
    template arguments as constants, the body verbatim between them."""
    launch = next(k for k in LAUNCHES.values() if k.name.startswith("flashnorm_qkv"))
    text = mlx_cuda_source(launch)
    assert "    const __grid_constant__ Shape qkv_shape,\n" in text
    assert "ms_shape" not in text and "_strides" not in text
    assert f"  using T = {CUDA_TYPE[launch.dtype]};\n" in text
    assert f"  constexpr int HALF = {dict(launch.template)['HALF']};\n" in text
    assert text.endswith(launch.source + CLOSE) and K.render.BODY_MARK in launch.source
    assert text.startswith(DEFAULT_HEADER + OPEN + "__global__ void custom_kernel_")


def test_mlx_headers_and_wrapper_text_match_an_mlx_cuda_build():
    """The copied device headers and build_kernel's fixed text, against a libmlx.so
    of an MLX CUDA build (installed, or FLASHNORM_MLX_CUDA_LIB=.../mlx/lib/libmlx.so
    of the mlx-cuda-13 wheel)."""
    lib = mlx_cuda_library()
    if lib is None:
        pytest.skip(
            "no MLX CUDA build here (mlx-cuda-13's libmlx.so embeds the device "
            "headers): set FLASHNORM_MLX_CUDA_LIB to its mlx/lib/libmlx.so to check "
            f"the copies in {VENDORED.name}/"
        )
    embedded = embedded_headers(lib)
    for n in DEVICE_HEADERS:
        assert (
            embedded.get(n) == (VENDORED / DEVICE / n).read_text()
        ), f"{n} differs from {lib}'s: copy it again (MLX {mx.__version__})"
    data = lib.read_bytes()
    for fixed in (DEFAULT_HEADER, OPEN, CLOSE, "--device-as-default-execution-space"):
        assert fixed.encode() + b"\0" in data, fixed
    for _, decl in SHAPE_INFO:
        assert f"    const __grid_constant__ {decl} ".encode() + b"\0" in data, decl


@pytest.mark.skipif(not mx.cuda.is_available(), reason="no CUDA backend in this MLX")
def test_reconstruction_is_the_source_mlx_builds(monkeypatch, capfd):
    """On a CUDA machine: MLX's own kernel source (verbose=True) for several
    kernels equals `mlx_cuda_source` of the same call."""
    rec, real = Recorder(), mx.fast.cuda_kernel

    def both(**kw):
        note, kernel = rec.cuda_kernel(**kw), real(**kw)

        def call(**launch):
            note(**launch)
            return kernel(**launch, verbose=True)

        return call

    monkeypatch.setattr(mx.fast, "cuda_kernel", both)
    monkeypatch.setattr(K._common, "make_kernel", rec.record)
    for dtype in TK.DTYPES.values():
        for mode, off in (
            ("llama", "off5"),
            ("openelm", "per_batch"),
            ("qwen2", "off0"),
        ):
            c = TK.make_case(dtype, 1, off, 2, mode)
            mx.eval(TK.run_epilogue(K.epilogue.qkv_epilogue_kernel, c))
        mx.eval(K.glu.deferred_glu_kernel(*TK.glu_case(dtype, (1, 2, 8))))
        h, y, ms_y, gain = TK.residual_case(dtype, (1, 2, 8))
        mx.eval(K.block_residual.residual_kernel(h, y, ms_y, 1e-5, gain))
        mx.eval(K.block_residual.residual_norm_kernel(h, None, None, 1e-5))
    out = capfd.readouterr().out
    assert len(rec.launches) >= 15, len(rec.launches)
    for text, launch in rec.launches.items():
        mark = f"Generated source code for `{launch.kernel_name}`:\n```\n"
        assert mark in out, launch.kernel_name
        assert out.split(mark, 1)[1].split("\n```\n", 1)[0] == text, launch.kernel_name
