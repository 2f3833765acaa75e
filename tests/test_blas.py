"""blas.py: which library MLX's float32 matmul binds cblas_sgemm to, read from
the dynamic linker itself (LD_DEBUG=bindings) in a fresh process, with the
system's OpenBLAS and with FLASHNORM_BLAS=off (docs/design.md section 4g)."""

import ctypes
import ctypes.util
import os
import re
import subprocess
import sys

import pytest

from flashnorm_mlx import blas

# A float32 matmul through the package's import path, as the CLI and the API run.
PROGRAM = (
    "import flashnorm_mlx, mlx.core as mx; "
    "mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))"
)


needs_openblas = pytest.mark.skipif(
    sys.platform != "linux" or not ctypes.util.find_library("openblas"),
    reason="no OpenBLAS on this machine (Debian: apt-get install libopenblas0-pthread)",
)


def _mlx_binds_cblas_sgemm_to(tmp_path, switch) -> str:
    """The file libmlx.so's cblas_sgemm was bound to, per ld.so."""
    env = {k: v for k, v in os.environ.items() if k != "FLASHNORM_BLAS"}
    if switch is not None:
        env["FLASHNORM_BLAS"] = switch
    env.update(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, timeout=120)
    log = "".join(p.read_text() for p in tmp_path.glob("ld.*"))
    found = re.findall(
        r"binding file \S*libmlx\.so \[\d+\] to (\S+) .*`cblas_sgemm'", log
    )
    assert found, f"no binding of libmlx.so's cblas_sgemm in {len(log)} chars of log"
    return found[0]


@needs_openblas
def test_openblas_runs_mlx_float32_matmuls(tmp_path):
    target = _mlx_binds_cblas_sgemm_to(tmp_path, None)
    print("cblas_sgemm from", target)
    assert "openblas" in os.path.basename(target).lower(), target
    if os.environ.get("FLASHNORM_BLAS", "").lower() not in blas.OFF:
        assert blas.name() == "OpenBLAS", blas.global_cblas()  # this test process too


@pytest.mark.skipif(sys.platform != "linux", reason="MLX on macOS uses Accelerate")
def test_flashnorm_blas_off_keeps_the_wheels_own(tmp_path):
    target = _mlx_binds_cblas_sgemm_to(tmp_path, "off")
    print("cblas_sgemm from", target)
    assert "openblas" not in target.lower(), target


def test_mlx_imported_first_loads_nothing_and_says_why(monkeypatch):
    """mlx.core's symbols are bound already: no load, no error, a reason."""
    import mlx.core  # noqa: F401

    monkeypatch.setattr(blas, "loaded", None)
    monkeypatch.setattr(blas, "skipped", None)
    monkeypatch.delenv("FLASHNORM_BLAS", raising=False)
    assert blas.use_system_blas() is None
    assert sys.platform != "linux" or "imported before" in blas.skipped, blas.skipped
