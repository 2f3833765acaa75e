"""flashnorm-mlx: exact FlashNorm inference on MLX for Llama, Mistral, Ministral 3
(Mistral 3's text model), Qwen2/Qwen3, Qwen3.5 (dense and MoE), Qwen3-Next, Phi-3,
SmolLM3, Llama 4 (Scout, Maverick, the dense text model), OpenELM, Gemma 3,
Gemma 4, Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5 and 4.6, DeepSeek V3 (Kimi K2),
LFM2, LFM2-MoE, Nemotron-H (Nemotron 3) and Granite 4 language models (the same
function as stock mlx-lm, fewer ops); every other mlx-lm family runs as stock."""

# First, before anything imports mlx.core: the system's OpenBLAS where there is
# one (blas.py; FLASHNORM_BLAS=off keeps MLX's bundled reference BLAS).
from .blas import use_system_blas

use_system_blas()

from .errors import LoadError  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = [
    "load",
    "generate",
    "stream_generate",
    "read_source",
    "build_model",
    "LoadError",
    "__version__",
]

# The loaders import MLX and mlx-lm (seconds): on first use, so that the CLI can
# refuse a bad flag, or take a Ctrl-C, before that. `load` takes mlx_lm.load's
# keywords; `generate` and `stream_generate` are mlx-lm's own (api.py).
_LOADERS = ("read_source", "build_model")
_API = ("load", "generate", "stream_generate")


def __getattr__(name):
    if name in _LOADERS:
        from . import loading

        return getattr(loading, name)
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
