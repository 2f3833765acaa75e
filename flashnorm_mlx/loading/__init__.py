"""The load pipeline: MODEL -> read -> plan -> fold (or not) -> quantize ->
instantiate -> shard, for every mode (docs/design.md section 5a).

- `source`: MODEL (a folder, a hub id, a .gguf file, or the embedded default)
  -> `Source`; `gguf`: a GGUF as a Hugging Face checkpoint; `checks`: every
  file's structure checked before MLX reads it;
- `recipe`: the one per-module transform (dequantize, fold, cast, quantize)
  behind loading and `convert`, and whole checkpoints a layer at a time;
- `build`: `build_model`, one mode on a Source;
- `variants`: the modes (how a model handles its norms, one record each) and
  the rows a run compares, mode x engine, one table;
- `nonorm` and `stock_fused`: the comparison modes bench builds.

The pipeline's steps are the transforms of `fold` and `quant`; the models
are `models`'; sharding is `parallel.sharding`'s.
"""

from ..errors import LoadError
from .build import DTYPES, bits_per_weight, build_model, model_dtype, weight_bytes
from .source import Source, read_source
from .variants import MODES, RUN_MODES, VARIANTS, Mode, Variant

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
