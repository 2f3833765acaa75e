"""The rows a run compares (bench, chat's /compare), one table: a mode (how the
model handles its norms, flashnorm_mlx/modes.py) on an engine (engine.py).
`mlx-lm`, stock on the eager engine, is the reference row: mlx-lm as its users
run it (docs/design.md section 4c).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .. import fold, models, quant
from ..modes import (  # noqa: F401 (the modes, re-exported with their rows)
    FLASHNORM,
    MODES,
    NONORM,
    RUN_MODES,
    STOCK,
    STOCK_FUSED,
    Mode,
)
from . import gguf_kquant
from .source import Source


@dataclass(frozen=True)
class Variant:
    name: str  # its row in bench and /compare
    mode: Mode
    engine: Optional[str] = None  # None: the run's engine (bench's --engine)


REFERENCE = Variant("mlx-lm", STOCK, "eager")
VARIANTS: Tuple[Variant, ...] = (REFERENCE,) + tuple(
    Variant(m.name, m) for m in MODES.values()
)
BY_NAME = {v.name: v for v in VARIANTS}
NAMES = tuple(BY_NAME)  # bench and /compare rows, the reference first


def absent(config: dict) -> Dict[str, str]:
    """{row: why it cannot run} for the model `config` describes: the modes that
    need FlashNorm's cover (all but stock) where FlashNorm does not cover its
    model_type; where it does, the modes its family `cannot` (models/arch.py)."""
    if models.is_covered(config):
        mt = config.get("model_type")
        cannot = dict(models.architecture(config).cannot)
        return {
            v.name: f"{v.name} is absent: {mt} has no {v.mode.name}: {cannot[v.mode.name]}"
            for v in VARIANTS
            if v.mode.name in cannot
        }
    rows = [v.name for v in VARIANTS if v.mode.needs_cover]
    why = (
        f"{', '.join(rows[:-1])} and {rows[-1]} are absent: they are FlashNorm's "
        f"ways with the norms, and FlashNorm does not cover model_type "
        f"{config.get('model_type')!r} yet (it covers {models.covered_words()}); "
        "mlx-lm and stock run it as mlx-lm's own class"
    )
    return {v: why for v in rows}


def comparison(source: Source, quantize=None, quantized_way: str = "stored") -> dict:
    out = _comparison(source, quantize, quantized_way)
    floats = gguf_kquant.floats_of(source.config)
    if floats and not quantize and quantized_way != "requantize":
        # A GGUF's Q6_K & co. (16-weight scales) are float, not "not quantized".
        types = "/".join(sorted(set(floats.values())))
        out["comparison_note"] += (
            f" ({len(floats)} {types} tensors read as float: MLX's format "
            "cannot hold them; --requantize rounds them to the nearest MLX setting)"
        )
    return out


def _comparison(source: Source, quantize=None, quantized_way: str = "stored") -> dict:
    """Which weights stock and FlashNorm are compared on, and what that measures.

    {"comparison": "float" | "stored" | "requantized" | "quantized",
    "comparison_note": one sentence}. "float" and "stored" isolate FlashNorm:
    both models run the very same weights. The other two quantize folded and
    unfolded weights apart (a fold puts columns with different gains into one
    group), so their differences include quantization.
    """
    src = quant.describe(source.config) if quant.is_quantized(source.weights) else None
    if not models.is_covered(source.config):
        return {
            "comparison": "stock alone",
            "comparison_note": "no FlashNorm model to compare: FlashNorm does not "
            f"cover model_type {source.config.get('model_type')!r} yet, so it runs "
            "as stock (mlx-lm's own class)",
        }
    if quantize:
        how = f"{quantize[0]}-bit group {quantize[1]}"
        return {
            "comparison": "quantized",
            "comparison_note": f"both models quantized ({how}, -q) from the same "
            "float weights after folding: differences include quantization, not "
            "only FlashNorm",
        }
    if src is None and gguf_kquant.floats_of(source.config):
        return {
            "comparison": "float",
            "comparison_note": "both models on the same float weights, the "
            "source's K-quants dequantized: differences are FlashNorm's alone",
        }
    if src is None:
        return {
            "comparison": "float",
            "comparison_note": "both models on the same float weights (the source "
            "is not quantized): differences are FlashNorm's alone",
        }
    if quantized_way == "dequantize":
        return {
            "comparison": "float",
            "comparison_note": f"the {src} source dequantized, both models on the "
            "same float weights: differences are FlashNorm's alone",
        }
    if quantized_way == "requantize" and not fold.is_folded(source.config):
        return {
            "comparison": "requantized",
            "comparison_note": f"both models requantized to the source's {src} "
            "from the same float weights (FlashNorm's after folding): differences "
            "include quantization, not only FlashNorm (the default, --as-stored, "
            "compares on the same quantized weights)",
        }
    gains = (
        "its norm gains folded by convert"
        if fold.is_folded(source.config)
        else "FlashNorm applies the norm gains in its kernels"
    )
    return {
        "comparison": "stored",
        "comparison_note": f"same quantized weights: both models run the {src} "
        f"checkpoint as stored ({gains}): differences are FlashNorm's alone",
    }
