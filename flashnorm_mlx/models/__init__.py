"""FlashNorm models, one file per architecture (file name = a config model_type).

Adding an architecture: a `models/<model_type>.py` with `ModelArgs`, `Model` and
`ARCH` (an `arch.Architecture`), one line in `ARCHITECTURES`, and tests against
mlx-lm's own class (README, "New architecture").
"""

import importlib
from types import ModuleType
from typing import Optional

from ..errors import UnsupportedModel
from .arch import Architecture

# config model_type -> module in flashnorm_mlx.models
ARCHITECTURES = {
    "gemma3_text": "gemma3",
    "gpt_oss": "gpt_oss",
    "llama": "llama",
    "mistral": "llama",  # mlx-lm runs Mistral as Llama, sliding window included
    "mixtral": "mixtral",
    "openelm": "openelm",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
}


def model_module(config: dict) -> ModuleType:
    mt = config.get("model_type")
    if mt not in ARCHITECTURES:
        raise UnsupportedModel(
            f"unsupported model_type {mt!r}: flashnorm-mlx runs "
            f"{', '.join(ARCHITECTURES)}"
        )
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[mt]}")


# Config keys that give a model's trained context length, in order of preference.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_context_length",
    "max_sequence_length",
    "n_positions",
    "seq_length",
)


def context_length(config: dict) -> Optional[int]:
    """The trained context length a config states, or None."""
    for key in _CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def architecture(config: dict) -> Architecture:
    return model_module(config).ARCH


def stack_experts(config: dict, weights: dict) -> dict:
    """A checkpoint's per-expert weights stacked into mlx-lm's 3-D experts
    (`arch.MoE.stack`), so fold, quantization and convert see one module per
    layer's experts, as mlx-lm's saved checkpoints hold them."""
    moe = architecture(config).moe
    return moe.stack(config, weights) if moe else weights


def model_classes(config: dict, cls: str):
    """(Model, ModelArgs): mlx-lm's own classes for "stock", ours ("flashnorm")
    otherwise."""
    module = model_module(config)
    if cls == "stock":
        from ..mlx_lm_compat import stock_classes

        return stock_classes(config)
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


def instantiate(config: dict, weights: dict, cls: str, norm_gains: bool = False):
    """The `cls` class ("stock" or "flashnorm") built on `weights` (its
    `sanitize` applied); quantized modules made where the weights have scales.
    norm_gains: ours on unfolded weights, the norm gains applied in the
    kernels. ValueError on weights that do not fit the config."""
    model_cls, args_cls = model_classes(config, cls)
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
