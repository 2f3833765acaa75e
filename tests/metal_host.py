"""Metal kernels on a CPU: the exact source MLX generates, compiled as host C++.

MLX's `mx.fast.metal_kernel` writes each call's Metal source itself: a signature
(a buffer per input, its `_shape`, `_strides`, `_ndim` where the body names them,
a buffer per output, the thread attributes the body names), the body inside a
template, and the template's explicit instantiation. MLX without Metal cannot
compile or run that source, but it prints it: while a graph that makes the call
is exported, `verbose=True` (`metal_source`).

`MetalHost.make_kernel` stands in for the project's `_common.make_kernel` on a
Metal backend: the project's own `_make_kernel` renders each body and names each
kernel, with `mx.fast.metal_kernel` replaced by ours, which notes each call's
source (`recording`). `compile` builds every noted source, metal_shim/metal_shim.h
in front and a launcher behind each, into one shared library. A call then runs
its kernel as Metal's dispatchThreads does (metal_shim.h's `launch`) twice: the
threads of each group in ascending, then in descending order. Outputs that differ
between the two are a race. Every buffer lies between poisoned guards: a write
outside it fails, a read outside it brings NaN (the 0xff bytes) into the output.
Threadgroup variables (found in the library's symbols) are poisoned before each
group and may total 32 KiB; indices into fixed-size arrays are bounds-checked.
"""

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np

from flashnorm_mlx import kernels as K

SHIM = Path(__file__).resolve().parent / "metal_shim" / "metal_shim.h"
# Linux only: the launcher's fibers (ucontext) and symbol reading (nm) are its;
# on a Mac the kernel tests run the real Metal backend instead.
CXX = (
    shutil.which("g++") or shutil.which("clang++")
    if sys.platform.startswith("linux")
    else None
)
ASCENDING, DESCENDING = 0, 1
POISON = 0xFF  # NaN in every float type, -1 in every int type
# Apple GPUs' threadgroup memory (MTLDevice.maxThreadgroupMemoryLength).
THREADGROUP_BYTES = 32 * 1024
_REAL_METAL_KERNEL = mx.fast.metal_kernel

# MLX's get_type_string: the Metal type of each dtype in the signature.
METAL_TYPES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.int64: "int64_t",
    mx.int16: "int16_t",
    mx.uint16: "uint16_t",
    mx.int8: "int8_t",
    mx.uint8: "uint8_t",
    mx.bool_: "bool",
}
# The thread attributes MLX looks for in a body, with the types it declares them
# with: metal_shim.h's `Thread` has a field for each.
ATTRIBUTES = dict.fromkeys(
    "thread_position_in_grid thread_position_in_threadgroup "
    "threadgroup_position_in_grid threads_per_threadgroup threads_per_grid "
    "threadgroups_per_grid dispatch_threads_per_threadgroup grid_origin "
    "grid_size".split(),
    "uint3",
) | dict.fromkeys(
    "thread_index_in_threadgroup thread_index_in_simdgroup "
    "simdgroup_index_in_threadgroup simdgroups_per_threadgroup "
    "dispatch_simdgroups_per_threadgroup threads_per_simdgroup "
    "thread_execution_width thread_index_in_quadgroup "
    "quadgroup_index_in_threadgroup quadgroups_per_threadgroup "
    "dispatch_quadgroups_per_threadgroup".split(),
    "uint",
)


class MetalHostError(Exception):
    """A kernel that failed on the host: see the subclasses."""


class SourceFormatChanged(MetalHostError):
    """MLX's generated Metal source is no longer what `parse` reads."""


class MetalCompileError(MetalHostError):
    """A Metal source that does not compile against metal_shim.h."""


class MetalLaunchError(MetalHostError):
    """A launch that went wrong: a barrier, a race, a write out of bounds."""


# --- MLX's source ----------------------------------------------------------------


def _stdout_of(fn) -> str:
    """What `fn` prints on file descriptor 1, C++'s std::cout included."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode(errors="replace")


def metal_source(kernel, name: str, inputs, **call) -> str:
    """The Metal source MLX generates for this call of `kernel` (a real
    `metal_kernel` object): what a Mac would compile."""

    def graph(*xs):
        return kernel(inputs=list(xs), verbose=True, **call)

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "call.mlxfn")
        printed = _stdout_of(lambda: mx.export_function(path, graph, *inputs))
    head = f"Generated source code for `{name}`:\n```\n"
    start = printed.find(head)
    end = printed.find("\n```\n", start + len(head))
    if start < 0 or end < 0:
        _changed(name, "export_function with verbose=True printed no block", printed)
    return printed[start + len(head) : end]


def _changed(name: str, what: str, text: str):
    # Where the text reads as a kernel, its signature is what changed most likely.
    shown = text[: text.find(") {\n") + 3] if ") {\n" in text else text[:600]
    raise SourceFormatChanged(
        f"MLX {mx.__version__} changed the Metal source `metal_kernel` generates "
        f"(kernel {name}): {what}. tests/metal_host.py's `parse` reads MLX "
        "0.32's format and must follow the new one. The source begins:\n" + shown
    )


class Param(NamedTuple):
    """One parameter of the kernel's signature, as MLX writes it."""

    type: str  # e.g. "const device float16_t*", "uint3"
    name: str
    buffer: Optional[int]  # [[buffer(i)]]; None for a thread attribute


class Source(NamedTuple):
    """A parsed Metal source: what its launcher calls, with which arguments."""

    kernel: str  # the metal_kernel's name
    text: str
    function: str  # custom_kernel_<name>_<template hash>
    instance: str  # the function with its template arguments, as instantiated
    params: Tuple[Param, ...]

    @property
    def key(self) -> str:
        return hashlib.sha1(self.text.encode()).hexdigest()[:16]


_HEAD = re.compile(
    r"(?:template <(?P<template>[^>\n]*)>\n)?"
    r"\[\[kernel\]\] void (?P<function>custom_kernel_\w+)\(\n(?P<params>.*?)\) \{\n",
    re.S,
)
_PARAM = re.compile(
    r"  (?P<type>\S[^\[\n]*?) (?P<name>\w+) "
    r"\[\[(?P<attr>\w+)(?:\((?P<index>\d+)\))?\]\](?:,\n|\Z)"
)
_INSTANCE = re.compile(
    r'\ntemplate \[\[host_name\("(?P<host>\w+)"\)\]\] \[\[kernel\]\] '
    r"decltype\((?P<instance>\w+<[^>\n]*>)\) (?P=instance);\s*\Z"
)


def parse(
    text: str, kernel: str, body: str, input_names, inputs, output_names, output_dtypes
) -> Source:
    """The signature, body and instantiation of MLX's source for one call,
    checked against what the call passed; SourceFormatChanged names what differs.

    The format (MLX 0.32, mlx/fast.cpp `write_signature`): `template <...>` if
    the call has template arguments; `[[kernel]] void custom_kernel_<name>...(`;
    one parameter a line, `  <type> <name> [[buffer(i)]]` or `[[<attribute>]]`;
    `) {`, the body as given, `}`; for a template, the line
    `template [[host_name("f")]] [[kernel]] decltype(f<args>) f<args>;`.
    """
    head = _HEAD.match(text)
    if not head:
        _changed(kernel, "no `[[kernel]] void custom_kernel_...(` signature", text)
    lines = head["params"]
    params, at = [], 0
    while at < len(lines):
        m = _PARAM.match(lines, at)
        if not m:
            _changed(
                kernel, f"a parameter line reads {lines[at:].splitlines()[0]!r}", text
            )
        index = m["index"]
        if (index is None) != (m["attr"] != "buffer"):
            _changed(kernel, f"parameter {m['name']} has [[{m['attr']}]]", text)
        params.append(
            Param(m["type"], m["name"], None if index is None else int(index))
        )
        at = m.end()
    rest = text[head.end() :]
    if not rest.startswith(body) or not rest[len(body) :].startswith("\n}\n"):
        _changed(kernel, "the body is not the source given, followed by `}`", text)
    after = rest[len(body) + len("\n}\n") :]
    instance = head["function"]
    if head["template"] is not None:
        m = _INSTANCE.search("\n" + after)
        if not m or m["host"] != head["function"]:
            what = f"no explicit instantiation of the template in {after[:300]!r}"
            _changed(kernel, what, text)
        instance = m["instance"]
    elif after.strip():
        _changed(kernel, f"text after the kernel: {after.strip()[:80]!r}", text)
    _check_params(
        kernel, params, input_names, inputs, output_names, output_dtypes, text
    )
    return Source(kernel, text, head["function"], instance, tuple(params))


def _check_params(
    kernel, params, input_names, inputs, output_names, output_dtypes, text
):
    """Every buffer is one the call passes, with the type MLX's own dispatch
    binds to it (custom_kernel.cpp: the input, its shape int32, strides int64,
    ndim int), in MLX's order; every attribute one the shim has."""
    want = {}
    for n, x in zip(input_names, inputs):
        space = "constant" if x.size < 8 else "device"  # small inputs: constant
        ref = "&" if x.ndim == 0 else "*"
        want[n] = f"const {space} {METAL_TYPES[x.dtype]}{ref}"
        if x.ndim > 0:
            want[n + "_shape"] = "const constant int*"
            want[n + "_strides"] = "const constant int64_t*"
            want[n + "_ndim"] = "const constant int&"
    for n, d in zip(output_names, output_dtypes):
        want[n] = f"device {METAL_TYPES[d]}*"
    buffers = [p for p in params if p.buffer is not None]
    if [p.buffer for p in buffers] != list(range(len(buffers))):
        _changed(kernel, f"buffer indices {[p.buffer for p in buffers]}", text)
    for p in buffers:
        if want.get(p.name) != p.type:
            _changed(
                kernel,
                f"buffer {p.name} is `{p.type}`, "
                f"not `{want.get(p.name, 'a buffer the call passes')}`",
                text,
            )
    for p in params:
        if p.buffer is None and ATTRIBUTES.get(p.name) != p.type:
            _changed(
                kernel,
                f"attribute `{p.type} {p.name}`: metal_shim.h's "
                "Thread has no such field",
                text,
            )


# --- the host ----------------------------------------------------------------------


class Region(ctypes.Structure):  # metalhost::Region
    _fields_ = [("at", ctypes.c_void_p), ("bytes", ctypes.c_size_t)]


class Call(NamedTuple):
    """One call of a metal_kernel, as far as its source and launch depend on it."""

    name: str
    source: str
    inputs: tuple  # (dtype, shape) per input
    template: tuple
    grid: tuple
    threadgroup: tuple
    outputs: tuple  # (dtype, shape) per output
    init_value: Optional[float]


def compiler_family(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return "clang" if "clang" in out else "gcc"


class MetalHost:
    """`metal_kernel` on the CPU: MLX's Metal source for each call, compiled here
    with metal_shim.h and run in both thread orders (`orders`)."""

    def __init__(
        self, workdir: Path, cxx: Optional[str], orders=(ASCENDING, DESCENDING)
    ):
        # cxx None: record only (MLX's source format is checked without a compiler).
        self.workdir, self.cxx, self.orders = Path(workdir), cxx, tuple(orders)
        self.family = compiler_family(cxx) if cxx else None
        self.sources = {}  # key -> Source
        self.calls = {}  # Call -> source key
        # source key -> (launch function, Regions, their count, threadgroup bytes)
        self.launchers = {}
        self.libraries = []  # keep every loaded library alive
        self.builds = 0  # compiler runs
        self.launches = 0  # kernel runs, each in every order
        self.recording_pass = False

    @contextlib.contextmanager
    def recording(self):
        """Within: calls note their source and return zeros; nothing runs."""
        self.recording_pass = True
        try:
            yield self
        finally:
            self.recording_pass = False

    def make_kernel(self, name, body, inputs, outputs, **flags):
        """`_common.make_kernel` on Metal: the project's `_make_kernel` (its
        rendering, its kernel name), uncached, with our `metal_kernel`."""
        make = K._common._make_kernel.__wrapped__
        saved, mx.fast.metal_kernel = mx.fast.metal_kernel, self.metal_kernel
        try:
            flags = tuple(sorted(flags.items()))
            return make(name, "metal", body, tuple(inputs), tuple(outputs), flags)
        finally:
            mx.fast.metal_kernel = saved

    def metal_kernel(
        self,
        name,
        input_names,
        output_names,
        source,
        header="",
        ensure_row_contiguous=True,
        atomic_outputs=False,
        **options,
    ):
        """`mx.fast.metal_kernel`'s signature; calls record or run (see class)."""
        assert header == "" and ensure_row_contiguous and not atomic_outputs, name
        real = _REAL_METAL_KERNEL(
            name=name,
            input_names=list(input_names),
            output_names=list(output_names),
            source=source,
            **options,
        )

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
            template = tuple(template or ())
            c = Call(
                name,
                source,
                tuple((x.dtype, x.shape) for x in inputs),
                template,
                tuple(grid),
                tuple(threadgroup),
                tuple(zip(output_dtypes, map(tuple, output_shapes))),
                init_value,
            )
            if c not in self.calls:
                if not self.recording_pass:
                    raise MetalHostError(
                        f"{name}: a call the recording pass did not make "
                        f"(inputs {[(str(d), s) for d, s in c.inputs]}, template "
                        f"{template}): record every launch before `compile`"
                    )
                kw = dict(
                    output_shapes=output_shapes,
                    output_dtypes=output_dtypes,
                    grid=grid,
                    threadgroup=threadgroup,
                    template=list(template),
                    init_value=init_value,
                )
                text = metal_source(real, name, inputs, **kw)
                src = parse(
                    text, name, source, input_names, inputs, output_names, output_dtypes
                )
                self.sources.setdefault(src.key, src)
                self.calls[c] = src.key
            if self.recording_pass:
                return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
            src = self.sources[self.calls[c]]
            return self.run(src, c, inputs, input_names, output_names)

        return call

    # --- compiling ---------------------------------------------------------------

    def translation_unit(self, sources, spaces: bool = False) -> str:
        """The shim, then each source with its launcher. `spaces`: device,
        constant and threadgroup as clang address spaces, where the types allow."""
        parts = [f'#include "{SHIM}"\n']
        for src in sources:
            text = src.text
            if self.family == "clang" or spaces:  # no attributes on an instantiation
                text = re.sub(
                    r"^template \[\[host_name\(\"\w+\"\)\]\] \[\[kernel\]\] ",
                    "template ",
                    text,
                    flags=re.M,
                )
            if spaces:  # bfloat's conversions are member calls: none on such types
                parts.append(_SPACES_OFF if "bfloat16_t" in text else _SPACES_ON)
            defined = sorted(set(re.findall(r"^\s*#\s*define\s+(\w+)", text, re.M)))
            parts += [f'#line 1 "{src.function}.metal"\n', text, "\n"]
            parts += [f"#undef {n}\n" for n in defined]
            parts += [f'#line 1 "{src.function}.launcher"\n', _launcher(src)]
        return "".join(parts)

    def compile(self):
        """Every source recorded and not yet built, in one shared library."""
        todo = [s for k, s in self.sources.items() if k not in self.launchers]
        if not todo:
            return
        text = self.translation_unit(todo)
        # A path of its own: dlopen hands back a library loaded from the same one.
        self.workdir.mkdir(parents=True, exist_ok=True)
        stem = self.workdir / f"metal_{hashlib.sha1(text.encode()).hexdigest()[:12]}"
        cpp, obj, lib = (stem.with_suffix(x) for x in (".cpp", ".o", ".so"))
        cpp.write_text(text)
        # -O0: ~385 kernels build in half the time; ISO C++ floats (no contraction,
        # SSE rounding) give the same bits at any level (checked: -O1 alike).
        flags = ["-std=c++20", "-O0", "-fPIC", "-Wno-attributes"]
        if self.family == "gcc":  # each library keeps its own threadgroup statics
            flags += ["-fsanitize=bounds", "-fno-gnu-unique"]
        else:
            flags += ["-fsanitize=array-bounds", "-Wno-unknown-attributes"]
        self.builds += 1
        r = subprocess.run(
            [self.cxx, *flags, "-c", str(cpp), "-o", str(obj)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise MetalCompileError(_compile_errors(r.stderr, self.cxx, len(todo)))
        # Linked without the sanitizer's runtime: metal_shim.h handles its reports.
        r = subprocess.run(
            [self.cxx, "-shared", str(obj), "-o", str(lib)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        so = ctypes.CDLL(str(lib))
        self.libraries.append(so)
        statics = _static_locals(lib)
        for src in todo:
            fn = getattr(so, f"metal_{src.key}")
            fn.restype = ctypes.c_int
            fn.argtypes = _LAUNCH_ARGS
            mark = f"{len(src.function)}{src.function}"  # its mangled name
            mine = [(s, n) for s, n in statics.items() if mark in s]
            regions = (Region * max(1, len(mine)))(
                *[
                    Region(ctypes.addressof(ctypes.c_char.in_dll(so, s)), n)
                    for s, n in mine
                ]
            )
            self.launchers[src.key] = (fn, regions, len(mine), sum(n for _, n in mine))

    def check_address_spaces(self, clang: str, sources=None):
        """clang, -fsyntax-only: every source (but bfloat16's) with Metal's
        address spaces as distinct types, so mixing them fails as on Metal."""
        sources = list(self.sources.values()) if sources is None else sources
        self.workdir.mkdir(parents=True, exist_ok=True)
        cpp = self.workdir / "address_spaces.cpp"
        cpp.write_text(self.translation_unit(sources, spaces=True))
        flags = [
            "-std=c++20",
            "-fsyntax-only",
            "-Wno-unknown-attributes",
            "-Wno-ignored-attributes",
        ]
        r = subprocess.run([clang, *flags, str(cpp)], capture_output=True, text=True)
        if r.returncode != 0:
            raise MetalCompileError(_compile_errors(r.stderr, clang, len(sources)))
        return sum("bfloat16_t" not in s.text for s in sources)

    # --- running -------------------------------------------------------------------

    def run(self, src: Source, call: Call, inputs, input_names, output_names):
        """The kernel's outputs, after a launch in every order of `orders`; raises
        MetalLaunchError where a launch fails or two orders' outputs differ."""
        if src.key not in self.launchers:
            raise MetalHostError(f"{src.function}: recorded but not compiled")
        tg_bytes = self.launchers[src.key][3]
        if tg_bytes > THREADGROUP_BYTES:
            raise MetalLaunchError(
                f"{src.function}: {tg_bytes} bytes of threadgroup memory, more than "
                f"Apple GPUs' {THREADGROUP_BYTES}"
            )
        data = {}  # buffer name -> bytes, as MLX's dispatch binds them
        for n, x in zip(input_names, inputs):
            data[n] = _host_bytes(x)
            data[n + "_shape"] = np.array(x.shape, np.int32).view(np.uint8)
            strides = np.cumprod((1,) + x.shape[:0:-1])[::-1] if x.ndim else []
            data[n + "_strides"] = np.array(strides, np.int64).view(np.uint8)
            data[n + "_ndim"] = np.array([x.ndim], np.int32).view(np.uint8)
        for n, (dtype, shape) in zip(output_names, call.outputs):
            if call.init_value is None:  # unwritten elements stay NaN / -1
                size = int(np.prod(shape)) * dtype.size
                data[n] = np.full(size, POISON, np.uint8)
            else:
                data[n] = _host_bytes(mx.full(shape, call.init_value, dtype))
        runs = [self._launch(src, call, data, output_names, o) for o in self.orders]
        self.launches += 1
        for n, (dtype, _) in zip(output_names, call.outputs):
            a, b = runs[0][n], runs[-1][n]
            if a.tobytes() != b.tobytes():
                diff = np.unique(np.flatnonzero(a != b) // dtype.size)
                raise MetalLaunchError(
                    f"{src.function}: output `{n}` differs between thread orders "
                    f"(ascending vs descending) in {len(diff)} of "
                    f"{a.size // dtype.size} elements, the first at {diff[0]}: a "
                    "race, e.g. a missing threadgroup_barrier"
                )
        return [
            _from_host(runs[0][n], dtype, shape)
            for n, (dtype, shape) in zip(output_names, call.outputs)
        ]

    def _launch(self, src, call, data, output_names, order):
        """One launch in `order` on fresh guarded buffers: name -> output bytes."""
        fn, regions, n_regions, _ = self.launchers[src.key]
        guarded = [
            _Guarded(p.name, data[p.name]) for p in src.params if p.buffer is not None
        ]
        why = ctypes.create_string_buffer(1024)
        failed = fn(
            (ctypes.c_void_p * len(guarded))(*[g.pointer for g in guarded]),
            (ctypes.c_uint * 3)(*call.grid),
            (ctypes.c_uint * 3)(*call.threadgroup),
            order,
            regions,
            n_regions,
            why,
            len(why),
        )
        where = f"{src.function} ({('ascending', 'descending')[order]} thread order)"
        if failed:
            raise MetalLaunchError(f"{where}: {why.value.decode()}")
        for g in guarded:
            g.check(where)
        return {g.name: g.inner() for g in guarded if g.name in output_names}


class _Guarded:
    """A buffer between guards of poison bytes, as many as the buffer holds (64 at
    least), so an index off by up to one whole buffer lands in poison."""

    def __init__(self, name, inner: np.ndarray):
        self.name, self.n = name, inner.size
        self.guard = max(64, -(-self.n // 64) * 64)
        self.flat = np.full(self.n + 2 * self.guard, POISON, np.uint8)
        self.flat[self.guard : self.guard + self.n] = inner
        self.pointer = self.flat.ctypes.data + self.guard

    def inner(self):
        return self.flat[self.guard : self.guard + self.n].copy()

    def check(self, where):
        before = np.flatnonzero(self.flat[: self.guard] != POISON)
        after = np.flatnonzero(self.flat[self.guard + self.n :] != POISON)
        if len(before) or len(after):
            nearest = (
                f"{after[0]} bytes past its end"
                if len(after)
                else f"{self.guard - before[-1]} bytes before its start"
            )
            raise MetalLaunchError(
                f"{where}: wrote {len(before) + len(after)} bytes outside buffer "
                f"`{self.name}` ({self.n} bytes), the nearest {nearest}"
            )


def _host_bytes(x: mx.array) -> np.ndarray:
    x = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
    return np.ascontiguousarray(np.array(x)).reshape(-1).view(np.uint8)


def _from_host(b: np.ndarray, dtype, shape) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(b.view(np.uint16).reshape(shape)).view(mx.bfloat16)
    return mx.array(b.view(np.dtype(str(dtype).split(".")[-1])).reshape(shape))


_LAUNCH_ARGS = [
    ctypes.POINTER(ctypes.c_void_p),  # buffers, by [[buffer(i)]]
    ctypes.POINTER(ctypes.c_uint),  # grid, in threads
    ctypes.POINTER(ctypes.c_uint),  # threadgroup
    ctypes.c_int,  # descending
    ctypes.POINTER(Region),  # threadgroup variables, to poison
    ctypes.c_int,
    ctypes.c_char_p,  # why it failed
    ctypes.c_int,
]


def _launcher(src: Source) -> str:
    """extern "C" metal_<key>: the instantiated kernel, called for each thread with
    its buffers and the attributes its signature asks for."""
    args = []
    for p in src.params:
        if p.buffer is None:
            args.append(f"t.{p.name}")
        elif p.type.endswith("&"):  # a scalar by reference: MLX binds its bytes
            args.append(f"*({p.type[:-1]}*)b[{p.buffer}]")
        else:
            args.append(f"({p.type})b[{p.buffer}]")
    call = f"{src.instance}(\n        " + ",\n        ".join(args) + ")"
    return f"""\
extern "C" int metal_{src.key}(void* const* buffers, const uint* grid,
    const uint* group, int descending, const metalhost::Region* regions,
    int n_regions, char* why, int why_len) {{
  return metalhost::launch(grid, group, descending, regions, n_regions,
      [](void* const* b, const metalhost::Thread& t) {{
        {call};
      }}, buffers, why, why_len);
}}
"""


_SPACES = (
    "#undef device\n#undef constant\n#undef threadgroup\n"
    "#define device{}\n#define constant{}\n#define threadgroup static{}\n"
)
_SPACES_ON = _SPACES.format(
    *(f" __attribute__((address_space({i})))" for i in (1, 2, 3))
)
_SPACES_OFF = _SPACES.format("", "", "")


def _compile_errors(stderr: str, cxx: str, n: int) -> str:
    errors = [line for line in stderr.splitlines() if "error" in line]
    return (
        f"{cxx}: the Metal source of {n} kernel(s) does not compile with "
        f"metal_shim.h ({len(errors)} error lines); the first:\n"
        + "\n".join(errors[:12])
    )


def _static_locals(lib: Path) -> dict:
    """Mangled name -> bytes of each function-local static in `lib`: a kernel's
    threadgroup variables (metal_shim.h makes them static; Metal has no other)."""
    nm = shutil.which("nm")
    assert nm, "no nm (binutils): a C++ compiler's linker comes with it"
    out = subprocess.run(
        [nm, "-D", "-S", "--defined-only", str(lib)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[3].startswith("_ZZ"):
            found[fields[3]] = int(fields[1], 16)
    return found
