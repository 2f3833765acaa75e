"""The system's OpenBLAS under MLX's Linux CPU wheel (docs/design.md section 4g).

mlx[cpu]'s libmlx.so takes cblas_sgemm, unversioned, from a bundled reference
BLAS. A library loaded RTLD_GLOBAL before mlx.core is first imported comes first
in the dynamic linker's lookup, so Debian's OpenBLAS (libopenblas0-pthread) then
runs every float32 matmul, ~20x faster on a 2-core CPU. FLASHNORM_BLAS=off
keeps the wheel's own. Nothing on macOS (Accelerate) or without OpenBLAS.
Imports nothing heavy: flashnorm_mlx/__init__.py runs it first thing."""

import ctypes
import os
import sys
from typing import Optional

# Sonames of OpenBLAS's 32-bit-integer builds, cblas_* unprefixed: Debian and
# Ubuntu (any threading build, by alternatives), Fedora's pthread and OpenMP.
SONAMES = ("libopenblas.so.0", "libopenblasp.so.0", "libopenblaso.so.0")
OFF = ("off", "0", "no", "false", "reference")

loaded: Optional[str] = None  # the library this module loaded, if any
skipped: Optional[str] = None  # why it loaded none, where it tried and could not


def use_system_blas() -> Optional[str]:
    """Load OpenBLAS into the global scope unless MLX is already imported or
    FLASHNORM_BLAS=off; the soname loaded, or None. Never raises."""
    global loaded, skipped
    if loaded or sys.platform != "linux":
        return loaded
    if os.environ.get("FLASHNORM_BLAS", "").strip().lower() in OFF:
        skipped = "FLASHNORM_BLAS=off"
        return None
    if "mlx.core" in sys.modules:  # its BLAS symbols are bound already
        skipped = "mlx was imported before flashnorm_mlx"
        return None
    for soname in SONAMES:
        try:
            lib = ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if hasattr(lib, "cblas_sgemm"):
            loaded = soname
            return loaded
    skipped = "no OpenBLAS installed (Debian: apt-get install libopenblas0-pthread)"
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def global_cblas() -> Optional[str]:
    """The file that defines cblas_sgemm in the process's global scope (what
    mlx.core binds to when imported after it), or None."""
    try:
        fn = ctypes.CDLL(None).cblas_sgemm
        info = _DlInfo()
        if ctypes.CDLL(None).dladdr(
            ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)
        ):
            return info.dli_fname.decode(errors="replace")
    except (AttributeError, OSError):
        pass
    return None


def name() -> str:
    """One word for bench's header: the BLAS MLX's CPU matmuls run on."""
    if sys.platform == "darwin":
        return "Accelerate"
    path = global_cblas()  # ours, or the user's LD_PRELOAD
    if path is None:
        return "reference"  # the wheel's bundled one, in mlx's local scope
    base = os.path.basename(path).lower()
    return "OpenBLAS" if "openblas" in base else os.path.basename(path)
