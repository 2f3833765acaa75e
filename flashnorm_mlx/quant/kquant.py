"""GGUF K-quant tensors read as float (loading/gguf_kquant.py), as the weight
plan sees them: which they are, and the MLX setting --requantize gives them.

A GGUF's config carries `CONFIG_KEY`: module -> GGML type of each tensor whose
type MLX's format cannot hold (scales per 16 weights; docs/design.md 2i).
"""

from typing import Dict, Optional

import mlx.core as mx

from .. import models
from .specs import affine_spec

CONFIG_KEY = "gguf_float_tensors"
# Set where K-quants were decoded in float32: the file's own dtype (float16),
# the checkpoint's dtype for the compute default and for `convert`.
FILE_DTYPE_KEY = "gguf_file_dtype"
# GGML type -> the nearest MLX affine bits at group 32 (--requantize).
NEAREST_BITS = {"Q6_K": 6, "Q3_K": 3, "Q2_K": 2}


def file_dtype(config: Optional[dict]) -> Optional[mx.Dtype]:
    name = (config or {}).get(FILE_DTYPE_KEY)
    return getattr(mx, name) if name else None


def floats_of(config: dict) -> Optional[dict]:
    return config.get(CONFIG_KEY) or None


def requantize_spec(config: dict) -> Dict[str, dict]:
    """--requantize: each float-read K-quant module at its nearest MLX bits."""
    return {
        m: affine_spec(NEAREST_BITS[t], 32)
        for m, t in (config.get(CONFIG_KEY) or {}).items()
    }


def same_in_stacks(qspec: dict, config: dict) -> dict:
    """`qspec` with one setting per q|k|v and gate|up (FlashNorm stacks them):
    the most bits any member has (a Q6_K v lifts its Q4_K q and k to 6-bit)."""
    arch, out = models.architecture(config), dict(qspec)
    for i in range(int(config.get(arch.layers_key, 0))):
        prefix = arch.layer.format(i=i)
        for pair in arch.pairs:
            parts = [f"{prefix}.{p}" for p in pair.parts if f"{prefix}.{p}" in qspec]
            if parts:
                top = max((qspec[p] for p in parts), key=lambda q: q["bits"])
                out.update({p: top for p in parts})
    return out
