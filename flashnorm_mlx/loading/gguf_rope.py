"""Llama 3 RoPE scaling in a GGUF: llama.cpp stores its per-frequency divisors as
the `rope_freqs` tensor; `llama3_scaling` recovers mlx-lm's rope_scaling dict."""

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import LoadError


def llama3_rope_factors(
    head_dim: int, base: float, factor: float, low: float, high: float, old_ctx: int
) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs for Llama 3 RoPE."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid)
    )


def llama3_scaling(rope_freqs: mx.array, config: dict, path: Path) -> dict:
    """Recover the Llama 3 rope_scaling dict from the stored factors, or refuse."""
    stored = np.array(rope_freqs.astype(mx.float32))
    factor = float(stored.max())
    for old_ctx in (8192, 4096, 2048, 16384, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            ref = llama3_rope_factors(
                config["head_dim"], config["rope_theta"], factor, low, high, old_ctx
            )
            if ref.shape == stored.shape and np.allclose(ref, stored, rtol=1e-5):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": old_ctx,
                }
    raise LoadError(
        f"{path}: rope_freqs do not match Llama 3 RoPE scaling; not supported"
    )
