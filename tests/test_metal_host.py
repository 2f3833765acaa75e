"""Every kernel's Metal rendering, compiled and run on the CPU against its twin.

No machine of this project has Metal. tests/metal_host.py takes the exact source
MLX's `metal_kernel` generates for each call (signature, buffer attributes,
template instantiation), compiles it with g++ against tests/metal_shim/metal_shim.h,
which stands in for Metal, and runs it as Metal's dispatchThreads would: the
threads of each group in ascending, then descending order (outputs that differ
are a race), every buffer between poisoned guards (a write outside fails),
threadgroup memory poisoned before each group, indices into fixed-size arrays
bounds-checked. Every kernel form runs through the real `<op>_kernel` wrappers
over test_kernels.py's grids, against its plain-MLX twin `<op>_ops`; all sources
are recorded first and compiled in one build (`metal_host` fixture).

Kernels broken on purpose (a Metal compile error, a barrier not every thread
reaches, a race only the descending order exposes, a write out of bounds, a
threadgroup array too short) must fail. Where clang++ is installed, every source
also compiles with Metal's address spaces as distinct types. What only a Mac can
check: docs/kernels.md.
"""

import shutil
from itertools import chain

import metal_host as MH
import mlx.core as mx
import numpy as np
import pytest
import test_kernels as TK

from flashnorm_mlx import kernels as K

TOL, DTYPES = TK.TOL, TK.DTYPES
ELEMENTWISE_SHAPES = TK.SHAPES + [(3, 1, 1000)]  # as test_kernels' host tests
CLANG = shutil.which("clang++")
NO_CXX = (
    "no C++ compiler (g++ or clang++) on Linux: the Metal renderings are not run "
    "on the host here"
)


def on_metal(monkeypatch, host):
    """The kernels' wrappers make their kernels with `host`, as on a Metal backend."""
    monkeypatch.setattr(K._common, "make_kernel", host.make_kernel)
    monkeypatch.setattr(K._common, "gpu_backend", lambda: "metal")
    monkeypatch.delenv("FLASHNORM_KERNELS", raising=False)


def rel_err_np(out, ref) -> float:
    return float(np.abs(TK.np64(out) - ref).max() / np.abs(ref).max())


# --- what runs: each yields (what was compared with what, error, tolerance) -------


def _residual_form(args) -> str:
    y = "no y" if args[1] is None else "y * s(ms_y)" if args[2] is not None else "y"
    return y + (", gain" if len(args) > 4 else "")


def elementwise_errors(dtype, shape):
    """Every deferred_glu, residual and residual_norm call test_kernels'
    `elementwise_checks` makes, and the final norm with a gain after no y or a
    plain y (the forms it leaves out): each output against its twin's."""
    _, _, _, gain = TK.residual_case(dtype, shape)
    final_norms = [
        (
            "residual_norm",
            (*TK.residual_args(dtype, shape, m), 1e-5, gain),
            [3 * TOL[dtype]],
        )
        for m in ("stats", "add")
    ]
    for op, args, tols in chain(TK.elementwise_checks(dtype, shape), final_norms):
        kernel, twin = TK.impls(op)
        outs, refs = kernel(*args), twin(*args)
        if isinstance(outs, mx.array):
            outs, refs = [outs], [refs]
        form = "" if op == "deferred_glu" else f" ({_residual_form(args)})"
        for i, (out, ref, tol) in enumerate(zip(outs, refs, tols, strict=True)):
            assert (out.shape, out.dtype) == (ref.shape, ref.dtype), (op, i, out.shape)
            what = f"{op}_kernel{form} output {i} vs its twin {op}_ops"
            yield what, TK.rel_err(out, ref), tol


def epilogue_errors(dtype, L, off, ratio, mode):
    c = TK.make_case(dtype, L, off, ratio, mode)
    outs = TK.run_epilogue(K.epilogue.qkv_epilogue_kernel, c)
    twins = TK.run_epilogue(K.epilogue.qkv_epilogue_ops, c)
    tol = TOL[dtype]
    for name, out, twin, ref in zip("qkv", outs, twins, TK.reference(c)):
        assert out.shape == twin.shape and out.dtype == dtype, (name, out.shape)
        what = f"qkv_epilogue_kernel {name}"
        yield f"{what} vs its twin qkv_epilogue_ops", TK.rel_err(out, twin), 2 * tol
        yield f"{what} vs the unfused model math", TK.rel_err(out, ref), tol


def attention_errors(dtype, case):
    args = TK.attention_case(dtype, case)
    out = K.attention.decode_attention_kernel(*args)
    twin = K.attention.decode_attention_ops(*args)
    assert out.shape == twin.shape and out.dtype == dtype, out.shape
    what, tol = "decode_attention_kernel", 2 * TOL[dtype]
    yield f"{what} vs its twin decode_attention_ops", TK.rel_err(out, twin), tol
    ref = TK.attention_reference(*args)
    yield f"{what} vs numpy float64", rel_err_np(out, ref), tol


# No kernel of ours uses simd ops yet: this one checks the shim's against numpy.
SIMD_PROBE = """\
  const uint i = thread_position_in_grid.x;
  const float v = x[i];
  out[4 * i + 0] = simd_sum(v);
  out[4 * i + 1] = simd_max(v);
  out[4 * i + 2] = simd_shuffle_down(v, 1);
  out[4 * i + 3] = simd_broadcast(v, 0);
"""
SIMD_GRID, SIMD_GROUP = 70, 64  # the second group: one partial simdgroup of 6


def simd_errors(host):
    kernel = host.metal_kernel(
        name="metal_host_simd_probe",
        input_names=["x"],
        output_names=["out"],
        source=SIMD_PROBE,
    )
    x = mx.random.normal((SIMD_GRID,), key=mx.random.key(9))
    (out,) = kernel(
        inputs=[x],
        grid=(SIMD_GRID, 1, 1),
        threadgroup=(SIMD_GROUP, 1, 1),
        output_shapes=[(SIMD_GRID * 4,)],
        output_dtypes=[mx.float32],
    )
    v, got = np.array(x, np.float64), out.reshape(-1, 4)
    want = np.empty((SIMD_GRID, 4))
    for lo in (0, 32, 64):  # the simdgroups: 32 lanes, 32, then 6
        hi = min(lo + 32, SIMD_GRID)
        want[lo:hi, 0], want[lo:hi, 1] = v[lo:hi].sum(), v[lo:hi].max()
        want[lo:hi, 2] = np.append(v[lo + 1 : hi], v[hi - 1])  # the last keeps its own
        want[lo:hi, 3] = v[lo]
    ops = ("simd_sum", "simd_max", "simd_shuffle_down", "simd_broadcast")
    for j, op in enumerate(ops):
        # The last thread's shuffle_down reads an inactive lane: undefined on Metal.
        rows = SIMD_GRID - 1 if op == "simd_shuffle_down" else SIMD_GRID
        yield f"{op} vs numpy", rel_err_np(got[:rows, j], want[:rows, j]), 1e-5


def every_launch(host):
    """Each call the tests below make, once: what the recording pass records."""
    for dtype in DTYPES.values():
        for shape in ELEMENTWISE_SHAPES:
            list(elementwise_errors(dtype, shape))
        for case in TK.ATTENTION_CASES:
            list(attention_errors(dtype, case))
    for p in TK.GRID:
        list(epilogue_errors(*p.values))
    list(simd_errors(host))


def assert_within(errors, label):
    errors = list(errors)
    assert errors, label
    bad = [f"  {w}: max rel err {e:.3e} >= {t:.1e}" for w, e, t in errors if not e < t]
    assert not bad, f"Metal rendering on the host, {label}:\n" + "\n".join(bad)


# --- the harness: one build for every form ---------------------------------------


@pytest.fixture(scope="module")
def metal_host(tmp_path_factory):
    """Every call recorded (MLX's source for each, its format checked, with or
    without a compiler), then all compiled at once."""
    host = MH.MetalHost(tmp_path_factory.mktemp("metal_host"), MH.CXX)
    changed = None
    with pytest.MonkeyPatch.context() as mp:
        on_metal(mp, host)
        try:
            with host.recording():
                every_launch(host)
        except MH.SourceFormatChanged as e:
            changed = str(e)
    if changed:
        pytest.fail(changed, pytrace=False)  # never a skip
    if MH.CXX is None:
        pytest.skip(NO_CXX)
    host.compile()
    return host


@pytest.fixture
def metal_backend(metal_host, monkeypatch):
    on_metal(monkeypatch, metal_host)
    return metal_host


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", ELEMENTWISE_SHAPES, ids=str)
def test_metal_elementwise_kernels_match_twins(metal_backend, dtype, shape):
    assert_within(elementwise_errors(dtype, shape), f"{dtype} {shape}")


@pytest.mark.parametrize("dtype,L,off,ratio,mode", TK.GRID)
def test_metal_qkv_epilogue_matches_twin(metal_backend, dtype, L, off, ratio, mode):
    errors = epilogue_errors(dtype, L, off, ratio, mode)
    assert_within(errors, f"{mode} {dtype} L={L} {off} gqa{ratio}")


@pytest.mark.parametrize("case", TK.ATTENTION_CASES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_metal_decode_attention_matches_twin(metal_backend, dtype, case):
    assert_within(attention_errors(dtype, case), f"{dtype} {case}")


def test_metal_simd_ops_match_numpy(metal_backend):
    assert_within(simd_errors(metal_backend), "the shim's simd ops")


def _form_name(op, flags):  # as _common._make_kernel names a kernel
    tail = "".join(f"_{k}{int(v)}" for k, v in sorted(flags.items()))
    return f"flashnorm_{op}{tail}"


def test_metal_every_form_compiled_in_one_build(metal_host):
    """Every render-time form test_kernels knows (FORMS) has sources here,
    200 or more in all, from one compiler run, run in both thread orders."""
    names = {s.kernel for s in metal_host.sources.values()} - {"metal_host_simd_probe"}
    want = {_form_name(op, flags) for op, flags in TK.FORMS}
    assert names == want, (sorted(want - names), sorted(names - want))
    assert len(metal_host.sources) >= 200, len(metal_host.sources)
    assert metal_host.builds == 1 and metal_host.orders == (MH.ASCENDING, MH.DESCENDING)


# --- kernels broken on purpose -----------------------------------------------------


def mutated(text, old, new):
    assert old in text, f"the mutation no longer applies: {old!r} not found"
    return text.replace(old, new)


def broken_run(host, monkeypatch, launch):
    """`launch` on `host` as the module's harness runs it: recorded, compiled, run."""
    on_metal(monkeypatch, host)
    with host.recording():
        launch()
    host.compile()
    return launch()


needs_cxx = pytest.mark.skipif(MH.CXX is None, reason=NO_CXX)


@needs_cxx
def test_metal_compile_error_is_caught(tmp_path, monkeypatch):
    """A slip only the Metal prelude has (CUDA's rsqrtf): no CUDA check sees it."""
    prelude = K.render.PRELUDES["metal"]
    monkeypatch.setitem(
        K.render.PRELUDES,
        "metal",
        mutated(prelude, "metal::precise::rsqrt(x)", "rsqrtf(x)"),
    )
    args = TK.glu_case(mx.float32, (2, 7, 40))
    host = MH.MetalHost(tmp_path, MH.CXX)
    with pytest.raises(MH.MetalCompileError, match="rsqrtf") as e:
        broken_run(host, monkeypatch, lambda: K.glu.deferred_glu_kernel(*args))
    assert "custom_kernel_flashnorm_deferred_glu_prescale0" in str(e.value), e.value


@needs_cxx
def test_metal_barrier_not_every_thread_reaches_is_caught(tmp_path, monkeypatch):
    """Threads without an element of the row return before the tree sum's
    barriers (D = 20 < 32 threads): on a GPU, a hang or garbage."""
    body = mutated(
        K.block_residual.RESIDUAL_BODY,
        "  FN_SHARED float red[RP];\n",
        "  if (lane >= D) {\n    return;\n  }\n  FN_SHARED float red[RP];\n",
    )
    monkeypatch.setattr(K.block_residual, "RESIDUAL_BODY", body)
    h, y, ms_y, _ = TK.residual_case(mx.float32, (1, 3, 20))
    host = MH.MetalHost(tmp_path, MH.CXX)
    with pytest.raises(MH.MetalLaunchError, match="a barrier not every thread reaches"):
        broken_run(
            host,
            monkeypatch,
            lambda: K.block_residual.residual_kernel(h, y, ms_y, 1e-5),
        )


@needs_cxx
def test_metal_race_only_the_descending_order_exposes_is_caught(tmp_path, monkeypatch):
    """Without the tree sum's last barrier every thread reads red[0] before lane 0
    has finished it: ascending, lane 0 runs first and the result is right (the
    twin agrees); descending exposes it."""
    tree = K.render.TREE_SUM
    racy = mutated(
        K.block_residual.RESIDUAL_BODY, tree, tree[: tree.rindex("  FN_SYNC();")]
    )
    monkeypatch.setattr(K.block_residual, "RESIDUAL_BODY", racy)
    h, y, ms_y, _ = TK.residual_case(mx.float32, (2, 7, 40))

    def launch():
        return K.block_residual.residual_norm_kernel(h, y, ms_y, 1e-5)

    ascending = MH.MetalHost(tmp_path / "ascending", MH.CXX, orders=(MH.ASCENDING,))
    err = TK.rel_err(
        broken_run(ascending, monkeypatch, launch),
        K.block_residual.residual_norm_ops(h, y, ms_y, 1e-5),
    )
    assert err < 3 * TOL[mx.float32], f"ascending alone vs the twin: {err:.3e}"
    both = MH.MetalHost(tmp_path / "both", MH.CXX)
    with pytest.raises(MH.MetalLaunchError, match="differs between thread orders"):
        broken_run(both, monkeypatch, launch)


@needs_cxx
def test_metal_write_out_of_bounds_is_caught(tmp_path, monkeypatch):
    body = mutated(K.glu.DEFERRED_GLU_BODY, "  out[i] = ", "  out[i + 1] = ")
    monkeypatch.setattr(K.glu, "DEFERRED_GLU_BODY", body)
    args = TK.glu_case(mx.float16, (1, 5, 576))
    host = MH.MetalHost(tmp_path, MH.CXX)
    with pytest.raises(MH.MetalLaunchError, match="outside buffer `out`"):
        broken_run(host, monkeypatch, lambda: K.glu.deferred_glu_kernel(*args))


@needs_cxx
def test_metal_threadgroup_array_too_short_is_caught(tmp_path, monkeypatch):
    body = mutated(
        K.attention.DECODE_ATTENTION_BODY, "float p[RP];", "float p[RP - 1];"
    )
    monkeypatch.setattr(K.attention, "DECODE_ATTENTION_BODY", body)
    args = TK.attention_case(mx.bfloat16, "gqa4-d24-mid")
    host = MH.MetalHost(tmp_path, MH.CXX)
    with pytest.raises(MH.MetalLaunchError, match="index 255 out of bounds"):
        broken_run(
            host, monkeypatch, lambda: K.attention.decode_attention_kernel(*args)
        )


# --- MLX's source format ------------------------------------------------------------

FORMAT_CHANGES = {
    "signature": ("[[kernel]] void custom_kernel_", "kernel void custom_kernel_"),
    "buffer attribute": ("[[buffer(0)]]", "[[buffer(0), raster_order_group(0)]]"),
    "buffer type": ("const device float* gate_up", "device const float* gate_up"),
    "shape buffer": (
        "const constant int* gate_up_shape",
        "constant int* gate_up_shape",
    ),
    "attribute": (
        "uint3 thread_position_in_grid [[",
        "uint thread_position_in_grid [[",
    ),
    "instantiation": ("template [[host_name(", "template [[name("),
}


@pytest.mark.parametrize("change", FORMAT_CHANGES)
def test_metal_source_format_change_fails_with_one_message(
    tmp_path, monkeypatch, change
):
    """Needs no compiler: a changed format fails the recording (the `metal_host`
    fixture turns it into one failure, never a skip), naming what changed."""
    old, new = FORMAT_CHANGES[change]
    real = MH.metal_source
    monkeypatch.setattr(
        MH, "metal_source", lambda *a, **k: mutated(real(*a, **k), old, new)
    )
    host = MH.MetalHost(tmp_path, None)
    on_metal(monkeypatch, host)
    args = TK.glu_case(mx.float32, (2, 7, 40))
    with pytest.raises(MH.SourceFormatChanged) as e, host.recording():
        K.glu.deferred_glu_kernel(*args)
    message = str(e.value)
    assert message.startswith(f"MLX {mx.__version__} changed the Metal source"), message
    assert "flashnorm_deferred_glu_prescale0" in message, message


def test_metal_source_missing_from_mlx_output_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(MH, "_stdout_of", lambda fn: fn() or "")
    host = MH.MetalHost(tmp_path, None)
    on_metal(monkeypatch, host)
    args = TK.glu_case(mx.float32, (2, 7, 40))
    with (
        pytest.raises(MH.SourceFormatChanged, match="printed no block"),
        host.recording(),
    ):
        K.glu.deferred_glu_kernel(*args)


# --- clang: address spaces ----------------------------------------------------------


@pytest.mark.skipif(
    CLANG is None,
    reason="clang++ not installed: Metal's address spaces (device, constant, "
    "threadgroup) are not checked as distinct types; g++ ignores them",
)
def test_metal_address_spaces_hold_with_clang(metal_host, tmp_path, monkeypatch):
    """Every float32 and float16 source compiles (clang, -fsyntax-only) with
    device, constant and threadgroup as distinct address spaces; a thread pointer
    to threadgroup memory, which g++ runs without complaint, does not."""
    checked = metal_host.check_address_spaces(CLANG)
    assert checked >= 100, checked
    body = mutated(
        K.block_residual.RESIDUAL_BODY,
        "  red[lane] = acc;\n",
        "  float* mine = red;\n  mine[lane] = acc;\n",
    )
    monkeypatch.setattr(K.block_residual, "RESIDUAL_BODY", body)
    h, y, ms_y, _ = TK.residual_case(mx.float32, (2, 7, 40))
    host = MH.MetalHost(tmp_path, MH.CXX)
    out = broken_run(
        host,
        monkeypatch,
        lambda: K.block_residual.residual_norm_kernel(h, y, ms_y, 1e-5),
    )
    twin = K.block_residual.residual_norm_ops(h, y, ms_y, 1e-5)
    assert TK.rel_err(out, twin) < 3 * TOL[mx.float32]  # the host alone misses it
    with pytest.raises(MH.MetalCompileError, match=r"address_space\(3\)"):
        host.check_address_spaces(CLANG)
