"""The values every entry point checks the same way, defined once and MLX-free
(cli/flags.py reads them before MLX is imported): the JSON number checks, the
sampling seed and temperature ranges the CLI and the server share, and the
quantization bits, group sizes and q_mode."""

import math


def is_int(v) -> bool:
    """An integer, and not a bool (JSON's true is no 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float, not a bool."""
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


# As mlx-lm's generate and server take them: the seed goes to mx.random.seed /
# mx.random.key, a uint64; temperature has a floor of 0 and no ceiling.
SEED_LIMIT = 2**64
SEED_NEED = "an integer from 0 to 2**64-1"
TEMP_NEED = "a number >= 0 (0: greedy)"


def seed_ok(v) -> bool:
    return is_int(v) and 0 <= v < SEED_LIMIT


def temp_ok(v) -> bool:
    return is_number(v) and v >= 0


# What mx.quantize takes: weights 2-8 bits (-q, a checkpoint's config), a KV
# cache 1-8 (mlx-lm's --kv-bits); groups of 32, 64 or 128 for both.
WEIGHT_BITS = (2, 3, 4, 5, 6, 8)
KV_BITS = (1, 2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)

# The quantization mode, our q_mode ("affine", or a format such as "mxfp4"):
# mlx's word for it is "mode", the key of a quantization block and a qspec
# entry, the attribute of a quantized module, mx.quantize's keyword.
MLX_Q_MODE = "mode"
AFFINE = "affine"  # mlx's default: a scale and a bias per group


def q_mode_of(spec: dict) -> str:
    """A quantization setting's q_mode (a qspec entry, a config's block);
    affine where it names none, as mlx-lm reads it."""
    return spec.get(MLX_Q_MODE, AFFINE)


def module_q_mode(module) -> str:
    """A quantized module's q_mode (mlx's attribute; affine where it has none)."""
    return getattr(module, MLX_Q_MODE, AFFINE)


# serve's --log-level, mlx_lm.server's choices (serve/log.py).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Byte sizes as mlx-lm writes them (--prompt-cache-bytes): a number, then
# nothing, M/MB (10**6) or G/GB (10**9).
SIZE_UNITS = {"": 1, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


def byte_size(text: str) -> int:
    """'4GB' -> 4000000000, as mlx_lm.utils._parse_size reads it; ValueError
    (argparse's one line) for anything else or below 1."""
    number = text.strip().upper().rstrip("BGM") or "x"
    unit = text.strip().upper()[len(number) :]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 4GB or 500M)") from None
    if unit not in SIZE_UNITS or not math.isfinite(value):
        raise ValueError(f"not a size: {text!r} (e.g. 4GB or 500M)")
    n = int(value * SIZE_UNITS[unit])
    if n < 1:
        raise ValueError(f"must be at least 1 byte, not {text!r}")
    return n
