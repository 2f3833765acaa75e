"""flashnorm-mlx: exact FlashNorm inference for Llama and OpenELM on MLX."""

__version__ = "0.1.0"

from .errors import LoadError  # noqa: E402

__all__ = ["load", "read_source", "build_model", "LoadError", "__version__"]

# The loaders import MLX and mlx-lm (seconds): on first use, so that the CLI can
# refuse a bad flag, or take a Ctrl-C, before that.
_LOADERS = ("load", "read_source", "build_model")


def __getattr__(name):
    if name in _LOADERS:
        from . import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
