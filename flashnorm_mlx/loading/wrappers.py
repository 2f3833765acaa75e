"""Multimodal wrappers read as the text model FlashNorm folds (docs/design.md
section 5a).

Several families ship inside a wrapper: {"model_type": "mistral3",
"text_config": {"model_type": "ministral3", ...}, "vision_config": ...}, the
text weights under `language_model.` or `model.language_model.`, beside a
vision tower (gone after `mlx_lm.convert`: mlx-lm's sanitize drops it). Where
`WRAPPERS` names the wrapper and FlashNorm covers its text family, the
`Source` is the text model: config = text_config (the wrapper's defaults and
its quantization block carried in), weights with the prefixes stripped and
the vision weights dropped. Stock stays mlx-lm's wrapper class, as
`mlx_lm.load` builds the folder (`rewrap`). Any other wrapper, or a text
family FlashNorm does not cover, is read as it is and runs as stock.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .. import models
from ..errors import LoadError, UnsupportedModel


@dataclass(frozen=True)
class Wrapper:
    """How one wrapper model_type holds its text model, as mlx-lm's wrapper
    class reads it (its `sanitize` and `ModelArgs`)."""

    texts: Tuple[str, ...]  # text_config model_types read out as the text model
    # (wrapper prefix, the text model's), the first that matches; others as is
    prefixes: Tuple[Tuple[str, str], ...]
    drop: Tuple[str, ...]  # a weight whose name holds one is not the text model's
    # What the wrapper class sets in text_config where absent.
    defaults: Tuple[Tuple[str, object], ...] = ()
    stock_prefix: str = "language_model."  # where the wrapper class holds it
    # The wrapper's family takes its text config flat, under this model_type,
    # and reads the weights as they are named (mlx-lm's Qwen3.5: the family
    # file mirrors the wrapper, its `canonical` reads the names): stock needs
    # no rewrapping.
    flat: Optional[str] = None
    # text_config keys the wrapper class sets from its own config, whatever
    # text_config says (key, the wrapper's default): Gemma 4's vocab_size.
    forced: Tuple[Tuple[str, object], ...] = ()
    # A flat config keeps text_config too, for the wrapper class stock builds
    # (mlx-lm's llama4 reads nothing else; its text model_type is another class).
    keep_text: bool = False


# wrapper model_type -> how FlashNorm reads its text model. A new line here
# (and its text family in models.ARCHITECTURES) is all another wrapper needs.
WRAPPERS: Dict[str, Wrapper] = {
    "mistral3": Wrapper(
        # Mistral 3's text model, or Mistral Small 3.1's, which it runs as Llama.
        texts=("ministral3", "mistral", "llama"),
        prefixes=(("model.language_model.", "model."), ("language_model.", "")),
        drop=("vision_tower", "multi_modal_projector"),
        defaults=(("tie_word_embeddings", False),),
    ),
    "qwen3_5": Wrapper(
        texts=("qwen3_5_text", "qwen3_5"),
        prefixes=(),  # read flat: the family's `canonical` names and drops
        drop=(),
        flat="qwen3_5",
    ),
    "qwen3_5_moe": Wrapper(
        texts=("qwen3_5_moe_text", "qwen3_5_moe"),
        prefixes=(),  # read flat: the family's `canonical` names and drops
        drop=(),
        flat="qwen3_5_moe",
    ),
    "llama4": Wrapper(
        texts=("llama4_text",),
        prefixes=(),  # read flat: the family's `canonical` drops the vision tower
        drop=(),
        flat="llama4",
        keep_text=True,
    ),
    "gemma4": Wrapper(
        texts=("gemma4_text",),
        prefixes=(("model.language_model.", "model."), ("language_model.", "")),
        drop=(
            "vision_tower",
            "multi_modal_projector",
            "audio_tower",
            "embed_audio",
            "embed_vision",
            "vision_embedder",
        ),
        defaults=(("num_attention_heads", 8), ("num_key_value_heads", 1)),
        forced=(("vocab_size", 262144),),
    ),
}

# Top-level keys of a wrapper's config that describe its text model's weights.
CARRIED = ("quantization", "quantization_config", "flashnorm")


def text_config(config: dict, where: str) -> Optional[dict]:
    """The text model's config of a wrapper FlashNorm reads (`WRAPPERS`, its
    text family covered), None for any other config. A listed wrapper with no
    text_config, or a text model_type nothing knows: one LoadError line."""
    wrapper = WRAPPERS.get(config.get("model_type"))
    if wrapper is None:
        return None
    mt = config["model_type"]
    text = config.get("text_config")
    if wrapper.flat and "text_config" not in config:  # flat already
        return None
    if not isinstance(text, dict):
        raise LoadError(f"{where}: a {mt} config needs a text_config object")
    text_type = text.get("model_type")
    if not isinstance(text_type, str):
        raise LoadError(f"{where}: text_config has no model_type string")
    family = {**text, "model_type": wrapper.flat} if wrapper.flat else text
    if wrapper.keep_text:
        family["text_config"] = text
    if text_type not in wrapper.texts or not models.is_covered(family):
        try:  # the wrapper runs as stock, if mlx-lm knows its text model
            models.check_runnable(text)
        except UnsupportedModel as e:
            raise LoadError(f"{where}: text_config: {e}") from None
        return None
    out = {**dict(wrapper.defaults), **family}
    out.update({k: config.get(k, default) for k, default in wrapper.forced})
    for key in CARRIED:
        if key in config:
            out[key] = _strip_keys(config[key], wrapper)
    return out


def _strip_keys(block, wrapper: Wrapper):
    # A quantization block's per-module entries are named as the weights are.
    if not isinstance(block, dict):
        return block
    return {text_name(k, wrapper): v for k, v in block.items()}


def is_flat(config: dict) -> bool:
    """A wrapper whose family reads its text config flat (`Wrapper.flat`)."""
    wrapper = WRAPPERS.get(config.get("model_type"))
    return wrapper is not None and wrapper.flat is not None


def as_written(config: dict) -> dict:
    """A flat config that keeps its text_config (`Wrapper.keep_text`) as a
    checkpoint's config.json holds it: the wrapper's form, the text model's
    keys in text_config alone (Hugging Face's Llama4Config refuses them at
    the top, and the tokenizer is read through it). Any other: as it is."""
    wrapper = WRAPPERS.get(config.get("model_type"))
    text = config.get("text_config")
    if wrapper is None or not wrapper.keep_text or not isinstance(text, dict):
        return config
    return {k: v for k, v in config.items() if k == "model_type" or k not in text}


def text_name(name: str, wrapper: Wrapper) -> str:
    for theirs, ours in wrapper.prefixes:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name


def text_weights(config: dict, weights: dict) -> dict:
    """The wrapper's (`config`) weights as the text model names them, the
    vision tower's dropped (never read: they stay on disk)."""
    wrapper = WRAPPERS[config["model_type"]]
    return {
        text_name(k, wrapper): v
        for k, v in weights.items()
        if not any(d in k for d in wrapper.drop)
    }


def rewrap(wrapper_config: dict, config: dict, weights: dict) -> Tuple[dict, dict]:
    """(config, weights) of mlx-lm's wrapper class around the text model
    `config` and `weights` (as a build made them): stock as `mlx_lm.load`
    builds the wrapper folder."""
    wrapper = WRAPPERS[wrapper_config["model_type"]]
    top = {k: v for k, v in wrapper_config.items() if k not in CARRIED}
    top["text_config"] = {k: v for k, v in config.items() if k not in CARRIED}
    top.update({k: config[k] for k in CARRIED if k in config})
    prefix = wrapper.stock_prefix
    return top, {prefix + k: v for k, v in weights.items()}
