"""FlashNorm models, one file per architecture (file name = a config model_type).

Adding an architecture: a `models/<model_type>.py` with `ModelArgs`, `Model` and
`ARCH` (an `arch.Architecture`), one line in `ARCHITECTURES`, and tests against
mlx-lm's own class (README, "New architecture").
"""

import importlib
from types import ModuleType

from ..errors import UnsupportedModel
from .arch import Architecture

# config model_type -> module in flashnorm_mlx.models
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",  # mlx-lm runs Mistral as Llama, sliding window included
    "openelm": "openelm",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


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


def model_classes(config: dict, mode: str):
    """(Model, ModelArgs): mlx-lm's own classes for "stock", ours otherwise."""
    module = model_module(config)
    if mode == "stock":
        from mlx_lm.utils import _get_classes

        return _get_classes(config)
    return module.Model, module.ModelArgs


def quantize_like(model, weights: dict) -> None:
    """Make quantized modules of `model` wherever `weights` (as its `sanitize`
    leaves them) hold scales, with the settings those tensors were packed with."""
    if not any(k.endswith(".scales") for k in weights):
        return
    import mlx.nn as nn
    from mlx_lm.utils import infer_quant_config

    nn.quantize(
        model,
        class_predicate=lambda p, m: (
            infer_quant_config(p, m, weights)
            if hasattr(m, "to_quantized") and f"{p}.scales" in weights
            else False
        ),
    )


def instantiate(
    config: dict,
    weights: dict,
    mode: str,
    norm_gains: bool = False,
    compiled: bool = False,
):
    """The `mode` class built on `weights` (its `sanitize` applied); quantized
    modules made where the weights have scales. norm_gains: ours on
    unfolded weights, the norm gains applied in the kernels. compiled: decode
    steps run compiled (decode.py). ValueError on weights that do not fit the
    config."""
    from ..decode import compiled_class

    model_cls, args_cls = model_classes(config, mode)
    if compiled:
        model_cls = compiled_class(model_cls)
    args = args_cls.from_dict(config)
    model = model_cls(args, norm_gains=True) if norm_gains else model_cls(args)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantize_like(model, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(
            f"weights do not match the {config['model_type']} config: {e}"
        ) from None
    return model
