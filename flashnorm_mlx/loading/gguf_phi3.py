"""llama.cpp's `phi3` GGUF files (Phi-3, Phi-3.5, Phi-4-mini), read as mlx-lm's
`phi3` (docs/design.md, "GGUF").

llama.cpp's converter (conversion/phi.py, `Phi3MiniModel`) keeps Phi-3's fused
tensors as they are: `attn_qkv` is `qkv_proj` and `ffn_up` is `gate_up_proj`
(gate rows, then up), RoPE is NeoX-style (no rows permuted), over
`rope.dimension_count` dims of each head (Phi-3's `partial_rotary_factor`).
Longrope/su scaling is the `rope_factors_long`/`rope_factors_short` tensors
(float32, as mlx-lm reads the config's lists) with the original context in
`rope.scaling.original_context_length`, and its attention factor in
`rope.scaling.attn_factor`, which mlx-lm computes from the two contexts: a
file whose factor is not that one is refused. mlx-lm's Phi-3 rotates by the
long factors at every length; llama.cpp takes the short ones where its
context is no longer than the original (llama-model.cpp, get_rope_factors):
stock mlx-lm on the Hugging Face folder is the reference. The sliding window
the converter writes is read by neither (llama.cpp turns it off for phi3).
"""

import math
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import LoadError
from ..models.arch import Architecture
from . import gguf_names
from .gguf import check_type, gguf_config, meta_value

NAMES = {  # llama.cpp's phi3 layer tensors -> Hugging Face's Phi-3 modules
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_KEEP = (  # mlx-lm's phi3 ModelArgs fields that gguf_config fills
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "vocab_size",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)
_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def read(
    meta: dict, raw: Dict[str, mx.array], path: Path, arch: str, family: Architecture
) -> Tuple[dict, Dict[str, mx.array], Callable[[str], Optional[str]]]:
    """(config, weights under Hugging Face's names, GGUF name -> our name)."""
    a = arch
    if any(n.startswith("blk.0.attn_q.") for n in raw):
        raise LoadError(f"{path}: a {a} file with q, k and v apart is not read")
    # gguf_config reads full-width RoPE alone: the rotated dims are read here.
    rope_key = f"{a}.rope.dimension_count"
    base = gguf_config(
        {k: v for k, v in meta.items() if k != rope_key}, raw, path, a, "phi3", family
    )
    config = {k: base[k] for k in _KEEP if k in base}
    head = base["hidden_size"] // base["num_attention_heads"]
    dims = int(meta_value(meta, rope_key, head))
    factor = dims / head
    if int(head * factor) != dims:  # mlx-lm's Phi-3: int(head * factor) dims
        raise LoadError(f"{path}: {dims} rotated dims of {head} are not mlx-lm's")
    config.update(model_type="phi3", architectures=[family.gguf.hf])
    if dims != head:
        config["partial_rotary_factor"] = factor
    original = meta_value(meta, f"{a}.rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    if any(n in raw for n in _FACTORS):
        config["rope_scaling"] = _longrope(meta, raw, config, dims, path, a)
    weights = {}
    for name, value in raw.items():
        if name in _FACTORS:  # in config["rope_scaling"]
            continue
        hf = gguf_names.hf_name(name, NAMES)
        if hf is None:
            raise LoadError(f"{path}: unexpected tensor {name!r} for a {a} GGUF")
        check_type(name, value, raw, path)
        weights[hf] = value
    missing = [k for k in _expected(config) if k not in weights]
    if missing:
        raise LoadError(
            f"{path}: {len(missing)} tensors missing or of a type MLX cannot read "
            f"(first: {missing[0]})"
        )
    return config, weights, lambda n: gguf_names.hf_name(n, NAMES)


def _longrope(meta, raw, config: dict, dims: int, path: Path, a: str) -> dict:
    """mlx-lm's rope_scaling for the file's long and short factors, where its
    SuScaledRoPE computes the file's attention factor from the two contexts."""
    if not all(n in raw for n in _FACTORS):
        raise LoadError(f"{path}: a {a} file with one of the two rope factor lists")
    long, short = (np.array(raw[n], np.float32).tolist() for n in _FACTORS)
    if not len(long) == len(short) == dims // 2:
        raise LoadError(f"{path}: {len(long)} rope factors for {dims} rotated dims")
    if "original_max_position_embeddings" not in config:
        raise LoadError(
            f"{path}: longrope without rope.scaling.original_context_length"
        )
    scale = (
        config["max_position_embeddings"] / config["original_max_position_embeddings"]
    )
    ours = 1.0
    if scale > 1.0:  # mlx-lm's SuScaledRoPE (and the converter's) factor
        ours = math.sqrt(
            1 + math.log(scale) / math.log(config["original_max_position_embeddings"])
        )
    given = meta_value(meta, f"{a}.rope.scaling.attn_factor", ours)
    if np.float32(given) != np.float32(ours):
        raise LoadError(
            f"{path}: rope.scaling.attn_factor {given:g} is not longrope's {ours:g} "
            "for its contexts (mlx-lm's Phi-3 computes it from them)"
        )
    return {"type": "longrope", "short_factor": short, "long_factor": long}


def _expected(config: dict) -> list:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        names.append("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        names += [f"model.layers.{i}.{m}.weight" for m in NAMES.values()]
    return names
