"""FlashNorm models, one file per architecture (file name = a config model_type).

Adding an architecture: a `models/<model_type>.py` with `ModelArgs`, `Model` and
`ARCH` (an `arch.Architecture`), one line in `ARCHITECTURES`, and tests against
mlx-lm's own class (README, "New architecture"). A model_type FlashNorm does
not cover but mlx-lm loads runs as stock, mlx-lm's own class (`run_mode`).
"""

import importlib
from types import ModuleType
from typing import Optional, Union

from ..errors import UnsupportedModel
from ..modes import FLASHNORM, STOCK, Mode, mode_named
from .arch import Architecture
from .joined import join_like

# config model_type -> module in flashnorm_mlx.models
ARCHITECTURES = {
    "deepseek_v3": "deepseek_v3",
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4_text",
    "glm4_moe": "glm4_moe",
    "gpt_oss": "gpt_oss",
    "granitemoehybrid": "granitemoehybrid",
    "kimi_k2": "deepseek_v3",  # mlx-lm remaps Kimi K2 to DeepSeek V3
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "llama": "llama",
    "llama4": "llama4",  # the wrapper, read flat (loading/wrappers.py)
    "llama4_text": "llama4_text",
    "ministral3": "ministral3",
    "mistral": "llama",  # mlx-lm runs Mistral as Llama, sliding window included
    "mixtral": "mixtral",
    "nemotron_h": "nemotron_h",
    "openelm": "openelm",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",  # the same file: experts where the config has them
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "smollm3": "smollm3",
}


def _family_file(model_type: str) -> ModuleType:
    """models/<file>.py of a model_type in ARCHITECTURES."""
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[model_type]}")


def is_covered(config: dict) -> bool:
    """Whether FlashNorm folds this config: a model file for its model_type
    that folds every part of it (`uncovered_why`). Any other config mlx-lm
    loads runs as stock, its own class (`run_mode`)."""
    return config.get("model_type") in ARCHITECTURES and not uncovered_why(config)


def uncovered_why(config: dict) -> Optional[str]:
    """What of a config its family's file does not fold yet (the file's
    `uncovered(config)`, where it has one), None otherwise."""
    mt = config.get("model_type")
    if mt not in ARCHITECTURES:
        return None
    check = getattr(_family_file(mt), "uncovered", None)
    return check(config) if check else None


def covered_words() -> str:
    return ", ".join(ARCHITECTURES)


def check_runnable(config: dict) -> None:
    """UnsupportedModel (one line) where neither FlashNorm covers the config's
    model_type nor mlx-lm has a class for it."""
    if not is_covered(config):
        stock_model_classes(config)


def config_classes(config: dict) -> list:
    """The ModelArgs classes that read `config`, in the order their fields'
    types count: mlx-lm's (UnsupportedModel, one line, where it has none), then
    ours where FlashNorm covers the family."""
    covered = is_covered(config)
    ours = [_family_file(config["model_type"]).ModelArgs] if covered else []
    return [stock_model_classes(config)[1]] + ours


def stock_model_classes(config: dict):
    """(Model, ModelArgs) of mlx-lm for the config; UnsupportedModel (one line)
    where mlx-lm has none."""
    import contextlib
    import io

    from ..mlx_lm_compat import MlxLmChanged, stock_classes, version

    said = io.StringIO()  # mlx-lm's olmo prints what it lacks, then exits
    try:
        with contextlib.redirect_stdout(said):
            return stock_classes(config)
    except MlxLmChanged:
        raise
    except (Exception, SystemExit) as e:
        text = str(e).strip() if isinstance(e, Exception) else said.getvalue()
        why = text.strip().splitlines()[0] if text.strip() else "it would not import"
        raise UnsupportedModel(
            f"unsupported model_type {config.get('model_type')!r}: mlx-lm "
            f"{version()} cannot load it ({why}) and FlashNorm covers "
            f"{covered_words()}"
        ) from None


def stock_note(config: dict, engine: Optional[str] = None) -> str:
    """The one line a run of a family FlashNorm does not cover says; `engine`:
    the one asked for (or the default), said where it is not the one it runs on
    (eager: the compiled step is traced for the classes it knows)."""
    eager = (
        ", on the eager engine (the compiled one runs the covered families)"
        if engine == "compiled"
        else ""
    )
    what = uncovered_why(config) or f"model_type {config.get('model_type')!r}"
    return (
        f"FlashNorm does not cover {what} yet: "
        f"it runs as stock (mlx-lm's own class){eager}"
    )


def not_covered(
    config: dict,
    what: Optional[str] = None,
    fix: str = "--mode stock runs it as mlx-lm's own class",
) -> UnsupportedModel:
    """The error for FlashNorm asked (`what`: how) of a family it does not
    cover; `fix`: what the user can run instead."""
    part = uncovered_why(config)
    said = part if part else f"model_type {config.get('model_type')!r}"
    return UnsupportedModel(
        (f"{what}: " if what else "") + f"FlashNorm does not cover {said} yet "
        f"(it covers {covered_words()}); {fix}"
    )


def run_mode(
    config: dict, asked: Union[None, str, Mode] = None, or_stock: bool = False
) -> Mode:
    """The Mode a run of the model `config` describes takes, settled once where
    the model is read: `asked` (--mode's name, a library caller's, or a Mode),
    else (None) flashnorm where FlashNorm covers the model_type and stock where
    it does not, the one stock fallback. A mode that needs FlashNorm's cover
    asked of a family it does not cover is `not_covered`, or stock with
    `or_stock` (a draft model, built like its target where it can be)."""
    if asked is None:
        return FLASHNORM if is_covered(config) else STOCK
    mode = mode_named(asked)
    if mode.needs_cover and not is_covered(config):
        if or_stock:
            return STOCK
        raise not_covered(config, f"--mode {mode}")
    return mode


def model_module(config: dict) -> ModuleType:
    """Our module for a covered model_type; `not_covered` (or, for a type mlx-lm
    has no class for either, `check_runnable`'s error) otherwise."""
    mt = config.get("model_type")
    if mt not in ARCHITECTURES or uncovered_why(config):
        check_runnable(config)
        raise not_covered(config)
    return _family_file(mt)


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
    """The family's contract (`ARCH`) by model_type alone: it describes the
    family whatever parts of it a config has (GGUF reading asks it of a bare
    {"model_type": ...}); building ours on a config is `model_module`'s."""
    mt = config.get("model_type")
    if mt in ARCHITECTURES:
        return _family_file(mt).ARCH
    return model_module(config).ARCH


def canonical_weights(config: dict, weights: dict) -> dict:
    """A checkpoint's weights as mlx-lm's saved checkpoints hold them, so fold,
    quantization and convert read one form: the family module's `canonical`
    where it has one (names and values mlx-lm's `sanitize` changes, e.g.
    Qwen3.5's), then per-expert weights stacked into mlx-lm's 3-D experts
    (`arch.MoE.stack`). Lazy: nothing is computed. A family FlashNorm does not
    cover is left to its own class's `sanitize`."""
    if not is_covered(config):
        return weights
    module = _family_file(config["model_type"])
    if hasattr(module, "canonical"):
        weights = module.canonical(config, weights)
    moe = module.ARCH.moe
    return moe.stack(config, weights) if moe else weights


def model_classes(config: dict, ours: bool):
    """(Model, ModelArgs): ours (`ours`), else mlx-lm's own classes."""
    if not ours:  # any family mlx-lm loads, covered or not
        return stock_model_classes(config)
    module = model_module(config)
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


def instantiate(config: dict, weights: dict, ours: bool, norm_gains: bool = False):
    """Our class (`ours`) or mlx-lm's built on `weights` (its
    `sanitize` applied); quantized modules made where the weights have scales.
    norm_gains: ours on unfolded weights, the norm gains applied in the
    kernels. ValueError on weights that do not fit the config."""
    model_cls, args_cls = model_classes(config, ours)
    args = args_cls.from_dict(config)
    model = model_cls(args, norm_gains=True) if norm_gains else model_cls(args)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    join_like(model, weights)  # stacks whose members run as stored
    quantize_like(model, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(
            f"weights do not match the {config['model_type']} config: {e}"
        ) from None
    return model
