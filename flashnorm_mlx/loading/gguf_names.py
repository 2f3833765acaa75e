"""llama.cpp's GGUF tensor names, read from the families' contract.

Llama's names are here; a family's `ARCH.gguf` (models/arch.py) gives llama.cpp's
architecture name, the layer names it adds or renames, its biases, and
`ARCH.moe.gguf` its experts' names, so loading/gguf.py special-cases no family.
"""

from typing import Dict, List, Optional, Tuple

from .. import models
from ..errors import UnsupportedModel
from ..models.arch import Architecture
from . import gguf_moe

# GGUF tensor name -> Hugging Face module (the suffix .weight/.scales/... is kept).
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp's Llama layer names; a family's `ARCH.gguf.names` adds or renames.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SUFFIXES = ("weight", "scales", "biases", "bias")


def families() -> Dict[str, Tuple[str, Architecture]]:
    """llama.cpp's general.architecture -> (model_type, ARCH) of every family
    whose ARCH declares `gguf` (mistral shares llama's ARCH: llama, listed first)."""
    out = {}
    for model_type in models.ARCHITECTURES:
        family = models.architecture({"model_type": model_type})
        if family.gguf is not None:
            for arch in (family.gguf.arch, *family.gguf.also):
                out.setdefault(arch, (model_type, family))
    return out


def why_not(arch) -> str:
    """The reason a family we run from Hugging Face folders gives for not
    reading its GGUF files (`Architecture.cannot`, or no `gguf` declared)."""
    if arch not in models.ARCHITECTURES:
        return ""
    family = models.architecture({"model_type": arch})
    try:
        family.require("gguf", arch)
    except UnsupportedModel as e:
        return f" ({e})"
    return f" ({arch} has no gguf: its ARCH declares none)"


def layer_names(family: Architecture) -> Dict[str, str]:
    """llama.cpp's layer tensor names -> our modules, for the family's files."""
    moe = family.moe.gguf_names() if family.moe else {}
    return {**_LAYER_NAMES, **dict(family.gguf.names), **moe}


def hf_name(gguf_name: str, names: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Hugging Face name of a GGUF tensor (`blk.3.attn_q.scales` ->
    `model.layers.3.self_attn.q_proj.scales`), or None if `names` (a family's
    `layer_names`; default Llama's) has no such layer tensor."""
    names = _LAYER_NAMES if names is None else names
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if (
        len(parts) == 3
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in names
    ):
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    return None


def expected(config: dict, family: Architecture) -> List[str]:
    """Every tensor the family's file must hold (its layers': `ARCH.gguf`'s)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        names.append("lm_head.weight")
    layer = list({**_LAYER_NAMES, **dict(family.gguf.names)}.values())
    layer = gguf_moe.layer_modules(config, layer, family)
    for i in range(config["num_hidden_layers"]):
        names += [f"model.layers.{i}.{m}.weight" for m in layer]
        names += [f"model.layers.{i}.{m}.bias" for m in family.gguf.biases]
    return names
