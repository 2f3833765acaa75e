"""llama.cpp's `gemma3` GGUF as a Hugging Face `gemma3_text` checkpoint.

What the file holds and what llama.cpp's code adds (docs/design.md section 2h):
- every `*norm.weight` is stored as 1 + w (its converter's `Gemma3Model` adds
  `norm_shift`, in every version read): we store w = that - 1 back;
- `ffn_norm` is Gemma's pre-FFN norm, `post_attention_norm` and `post_ffw_norm`
  the sandwich norms (names: `ARCH.gguf` in models/gemma3.py);
- its loader, not the file, sets the rest (llama-model.cpp, LLM_ARCH_GEMMA3):
  with a sliding window in the file every n-th layer is global, n from
  `attention.sliding_window_pattern` or 6 (`load_swa_pattern(ml, 6)`), local
  layers use RoPE base `rope.freq_base_swa` or 10000 unscaled, and the
  attention scale is 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the 27B
  (62 layers). mlx-lm's `gemma3_text` takes the same as config values.
"""

from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from ..errors import LoadError
from ..models.arch import Architecture
from . import gguf_names
from .gguf import gguf_config, hf_weights

MODEL_TYPE = "gemma3_text"
SWA_PATTERN = 6  # llama.cpp's set_swa_pattern(6)
LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa
LAYERS_27B = 62  # the one size whose attention scale is 1/sqrt(hidden/heads)


def read(
    meta: dict, raw: Dict[str, mx.array], path: Path, arch: str, family: Architecture
) -> Tuple[dict, Dict[str, mx.array], Callable[[str], Optional[str]]]:
    """(config, weights under Hugging Face's names, GGUF name -> our name):
    Llama's reading (gguf.py), then Gemma 3's config and norms."""
    llama_style = gguf_config(meta, raw, path, arch, MODEL_TYPE, family)
    config = gemma3_config(meta, llama_style, path)
    weights = gemma3_weights(hf_weights(raw, config, path, family))
    names = gguf_names.layer_names(family)
    return config, weights, lambda n: gguf_names.hf_name(n, names)


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    return v.item() if isinstance(v, mx.array) and v.ndim == 0 else v


def gemma3_config(meta: dict, config: dict, path: Path) -> dict:
    """gguf.py's Llama-style config of a gemma3 file -> mlx-lm's gemma3_text one."""
    softcap = _scalar(meta, "gemma3.final_logit_softcapping", 0.0)
    if softcap:
        raise LoadError(
            f"{path}: final logit softcapping ({softcap}) is not in mlx-lm's "
            "gemma3_text; not supported"
        )
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    window = int(_scalar(meta, "gemma3.attention.sliding_window", 0) or 0)
    out = {
        k: v
        for k, v in config.items()
        if k not in ("attention_bias", "mlp_bias", "tie_word_embeddings")
    }
    out["model_type"] = MODEL_TYPE
    out["architectures"] = ["Gemma3ForCausalLM"]
    out["tie_word_embeddings"] = config["tie_word_embeddings"]
    scalar = hidden // heads if layers == LAYERS_27B else head_dim
    out["query_pre_attn_scalar"] = scalar
    out["rope_local_base_freq"] = LOCAL_ROPE_BASE
    # No window in the file: every layer global (a pattern of 1).
    out["sliding_window_pattern"] = _pattern(meta, layers, path) if window > 0 else 1
    if window > 0:
        out["sliding_window"] = window
        local = _scalar(meta, "gemma3.rope.freq_base_swa", LOCAL_ROPE_BASE)
        out["rope_local_base_freq"] = float(local)
    return out


def _pattern(meta: dict, layers: int, path: Path) -> int:
    """llama.cpp's `load_swa_pattern(ml, 6)`: the key as a number n (every
    n-th layer global), or as one flag per layer (true: sliding), which must
    be such a pattern here (mlx-lm's gemma3_text takes a number); 6 where
    absent."""
    v = meta.get("gemma3.attention.sliding_window_pattern")
    if v is None:
        return SWA_PATTERN
    flags = v.tolist() if isinstance(v, mx.array) else v
    if not isinstance(flags, list):
        return int(flags)
    n = next((i + 1 for i, f in enumerate(flags) if not f), layers + 1)
    if [bool(f) for f in flags] != [i % n < n - 1 for i in range(layers)]:
        raise LoadError(
            f"{path}: gemma3.attention.sliding_window_pattern {flags} is not "
            "every n-th layer global; mlx-lm's gemma3_text cannot run it"
        )
    return n


def gemma3_weights(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Every norm's stored 1 + w back to w (float32)."""
    out = {}
    for name, value in weights.items():
        if name.endswith("norm.weight"):
            value = value.astype(mx.float32) - 1.0
        out[name] = value
    return out
