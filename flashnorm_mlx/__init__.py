"""flashnorm-mlx: exact FlashNorm inference for Llama and OpenELM on MLX."""

__version__ = "0.1.0"

from .loading import LoadError, build_model, load, read_source  # noqa: E402

__all__ = ["load", "read_source", "build_model", "LoadError", "__version__"]
