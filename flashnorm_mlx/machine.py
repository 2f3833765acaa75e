"""The machine and the versions a measurement ran on, for bench's report."""

import os
import platform
import subprocess
import sys
from typing import Optional

import mlx.core as mx

from . import blas


def _sh(*cmd) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
        return out.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> Optional[str]:
    if sys.platform == "darwin":
        return _sh("sysctl", "-n", "machdep.cpu.brand_string")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def device_info() -> dict:
    """The machine: Apple chip, GPU name or CPU model, and the MLX backend in use."""
    if mx.metal.is_available():
        backend = "metal"
    elif mx.cuda.is_available():
        backend = "cuda"
    else:
        backend = "cpu"
    info = {
        "backend": backend,
        "mlx_device": str(mx.default_device()),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "blas": blas.name(),  # what the CPU's float32 matmuls run on (blas.py)
    }
    try:
        raw = mx.device_info()
        info["mlx_device_info"] = {
            k: v for k, v in raw.items() if isinstance(v, (str, int, float, bool))
        }
    except Exception:  # older MLX or a backend without it
        raw = {}
    gpu = raw.get("device_name") if backend != "cpu" else None
    if backend == "metal":
        info["name"] = f"{info['cpu'] or gpu or 'Apple silicon'} (Metal GPU)"
    elif backend == "cuda":
        info["name"] = f"{gpu or 'NVIDIA GPU'} (CUDA)"
    else:
        info["name"] = (
            f"{info['cpu'] or raw.get('device_name') or 'CPU'} "
            f"(CPU, {os.cpu_count()} cores)"
        )
    return info


def versions() -> dict:
    import mlx_lm

    from .version import __version__

    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "flashnorm_mlx": __version__,
        "python": platform.python_version(),
    }
