"""The load pipeline: MODEL -> read (`source`) -> plan -> fold or not, quantize
(`recipe`) -> instantiate -> shard (`build`), one pipeline for every mode, so
every mode runs on the same weights (docs/design.md section 5a).
"""

from ..errors import LoadError
from .build import DTYPES, bits_per_weight, build_model, model_dtype, weight_bytes
from .rows import MODES, RUN_MODES, VARIANTS, Mode, Variant
from .source import Source, read_source

__all__ = [
    "DTYPES",
    "LoadError",
    "MODES",
    "Mode",
    "RUN_MODES",
    "Source",
    "VARIANTS",
    "Variant",
    "bits_per_weight",
    "build_model",
    "model_dtype",
    "read_source",
    "weight_bytes",
]
