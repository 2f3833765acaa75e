"""llama.cpp's `mistral3` GGUF files (Ministral 3 text, and Mistral 3's text
model), read as mlx-lm's `ministral3` (docs/design.md, "GGUF").

llama.cpp's converter (conversion/mistral3.py, `Ministral3Model`) is its
`LlamaModel`: Llama's names, Q/K rows permuted for interleaved RoPE (undone
as for Llama files, rows only), and in the metadata the YaRN scaling (factor,
original context, beta_fast/slow) with `mscale_all_dim` as
`rope.scaling.yarn_log_multiplier` and `llama_4_scaling_beta` as
`attention.temperature_scale`. Not written, so taken as llama.cpp takes them
(llama-context.cpp): YaRN's `mscale` is 1, and there is no sliding window
(the converter writes no `layer_types`). A file without YaRN or a
temperature scale is a plain Mistral (Mistral Small 3.1's text), run as Llama.
"""

from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from ..errors import LoadError
from ..models.arch import Architecture
from . import gguf_names
from .gguf import gguf_config, hf_weights, meta_f32, meta_value

_KEEP = (  # mlx-lm's ministral3 ModelArgs fields, beside rope_parameters
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)


def read(
    meta: dict, raw: Dict[str, mx.array], path: Path, arch: str, family: Architecture
) -> Tuple[dict, Dict[str, mx.array], Callable[[str], Optional[str]]]:
    """(config, weights under Hugging Face's names, GGUF name -> our name)."""
    a = arch
    if int(meta_value(meta, f"{a}.attention.sliding_window", 0) or 0):
        raise LoadError(f"{path}: a {a} file with a sliding window is not read")
    for key in ("yarn_attn_factor", "attn_factor", "yarn_ext_factor"):
        v = meta_value(meta, f"{a}.rope.scaling.{key}")
        if v is not None and float(v) != 1.0:
            raise LoadError(
                f"{path}: rope.scaling.{key} {v} is not in mlx-lm's ministral3"
            )
    base = gguf_config(meta, raw, path, a, "ministral3", family)
    beta = meta_value(meta, f"{a}.attention.temperature_scale")
    yarn = (base.get("rope_scaling") or {}).get("type") == "yarn"
    config = {k: base[k] for k in _KEEP if k in base}
    if not yarn and beta is None:  # Mistral Small 3.1's text model: Llama's
        config.update(model_type="mistral", rope_theta=base["rope_theta"])
    elif not yarn:
        raise LoadError(f"{path}: a {a} temperature scale without YaRN is not read")
    else:
        config["model_type"] = "ministral3"
        config["rope_parameters"] = {
            "rope_type": "yarn",
            "type": "yarn",
            "rope_theta": base["rope_theta"],
            "factor": base["rope_scaling"]["factor"],
            "original_max_position_embeddings": int(
                meta_value(meta, f"{a}.rope.scaling.original_context_length")
            ),
            "beta_fast": meta_f32(
                meta_value(meta, f"{a}.rope.scaling.yarn_beta_fast", 32.0)
            ),
            "beta_slow": meta_f32(
                meta_value(meta, f"{a}.rope.scaling.yarn_beta_slow", 1.0)
            ),
            "mscale": 1.0,  # not in the file; llama.cpp assumes 1
            "mscale_all_dim": meta_f32(
                meta_value(meta, f"{a}.rope.scaling.yarn_log_multiplier", 0.0)
            ),
            "llama_4_scaling_beta": meta_f32(beta or 0.0),
        }
    config["architectures"] = [family.gguf.hf]
    config["num_hidden_layers"] = base["num_hidden_layers"]
    weights = hf_weights(raw, base, path, family)
    names = gguf_names.layer_names(family)
    return config, weights, lambda n: gguf_names.hf_name(n, names)
