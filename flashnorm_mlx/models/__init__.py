"""FlashNorm models, one file per architecture (file name = a config model_type).

Adding an architecture: a `models/<model_type>.py` with `ModelArgs`, `Model` and
`ARCH` (an `arch.Architecture`), one line in `ARCHITECTURES`, and tests against
mlx-lm's own class (README, "New architecture").
"""

import importlib
from types import ModuleType

from ..arch import Architecture

# config model_type -> module in flashnorm_mlx.models
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",  # mlx-lm runs Mistral as Llama, sliding window included
    "openelm": "openelm",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


class UnsupportedModel(ValueError):
    """A config whose model_type no model file covers."""


def model_module(config: dict) -> ModuleType:
    mt = config.get("model_type")
    if mt not in ARCHITECTURES:
        raise UnsupportedModel(
            f"unsupported model_type {mt!r}: flashnorm-mlx runs "
            f"{', '.join(ARCHITECTURES)}"
        )
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[mt]}")


def architecture(config: dict) -> Architecture:
    return model_module(config).ARCH
