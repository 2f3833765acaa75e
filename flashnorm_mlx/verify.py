"""Numeric equivalence of FlashNorm against stock mlx-lm on the same weights."""

from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from . import fold
from .loading import Source, build_model, model_dtype

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time,"


def prompt_tokens(
    source: Source, prompt: Optional[str], n_random: int = 16
) -> List[int]:
    """The prompt's ids with the source's tokenizer; fixed random ids without one."""
    if source.tokenizer is not None:
        return list(source.tokenizer.encode(prompt or DEFAULT_PROMPT))
    vocab = source.config.get("vocab_size", 32000)
    return np.random.default_rng(0).integers(0, vocab, n_random).tolist()


def compare(
    source: Source,
    tokens: List[int],
    horizon: int = 32,
    dtype=None,
    quantize=None,
    dequantize: bool = False,
    on_stage: Optional[Callable[[str], None]] = None,
) -> dict:
    """Prefill `tokens`, then `horizon` cached greedy decode steps, on both models.

    Stock picks the greedy tokens; FlashNorm is fed the same tokens (teacher
    forcing), so every logit row compares the same inputs. greedy_match counts
    the leading steps where FlashNorm's argmax equals stock's token.
    on_stage(text) is told when each stage (build, prefill, decode) is done.
    """
    stage = on_stage or (lambda text: None)
    kw = dict(dtype=dtype, quantize=quantize, dequantize=dequantize)
    stock, _ = build_model(source, "stock", **kw)
    flash, _ = build_model(source, "flashnorm", **kw)
    stage("built stock and FlashNorm on the same weights")
    caches = {"stock": make_prompt_cache(stock), "flash": make_prompt_cache(flash)}
    every = max(1, horizon // 4)  # about four decode lines, whatever the horizon

    x = mx.array(tokens)[None]
    rows_s, rows_f, matches = [], [], []
    for step in range(horizon + 1):
        ls = stock(x, cache=caches["stock"])[0].astype(mx.float32)
        lf = flash(x, cache=caches["flash"])[0].astype(mx.float32)
        mx.eval(ls, lf)
        rows_s.append(ls)
        rows_f.append(lf)
        nxt_s, nxt_f = mx.argmax(ls[-1]).item(), mx.argmax(lf[-1]).item()
        if step < horizon:
            matches.append(nxt_s == nxt_f)
        x = mx.array([[nxt_s]])
        if step == 0:
            stage(f"prefilled {len(tokens)} prompt tokens")
        elif step % every == 0 or step == horizon:
            stage(f"decode step {step}/{horizon}")
    ls, lf = mx.concatenate(rows_s), mx.concatenate(rows_f)
    diff = mx.abs(ls - lf)
    finite_s, finite_f = bool(mx.isfinite(ls).all()), bool(mx.isfinite(lf).all())
    ps = nn.log_softmax(ls)
    # Clamp float round-off: KL is non-negative.
    kl = mx.maximum(mx.sum(mx.exp(ps) * (ps - nn.log_softmax(lf)), axis=-1), 0.0)
    greedy = next((i for i, m in enumerate(matches) if not m), len(matches))
    scale = mx.abs(ls).max().item()
    return {
        "model": source.name,
        "model_type": source.config.get("model_type"),
        "dtype": model_dtype(stock),
        "quantized": "quantization" in _cfg(source, kw),
        "prompt_tokens": len(tokens),
        "max_abs_logit_diff": diff.max().item(),
        "max_rel_logit_diff": diff.max().item() / max(scale, 1e-30),
        "logit_scale": scale,
        "kl": mx.mean(kl).item(),
        "kl_max": mx.max(kl).item(),
        "greedy_match": greedy,
        "greedy_horizon": horizon,
        "stock_finite": finite_s,
        "flashnorm_finite": finite_f,
    }


def _cfg(source: Source, kw: dict) -> dict:
    quantized = kw.get("quantize") or (
        any(k.endswith(".scales") for k in source.weights) and not kw.get("dequantize")
    )
    return {"quantization": True} if quantized else {}


def comparison(source: Source, quantize=None, dequantize: bool = False) -> dict:
    """Which weights stock and FlashNorm are compared on, and what that measures.

    {"comparison": "float" | "requantized" | "quantized", "comparison_note": one
    sentence}; only "float" isolates FlashNorm: quantizing folded weights puts
    columns with different gains into one group, so the other two include
    quantization differences.
    """
    q = source.config.get("quantization") if fold.is_quantized(source.weights) else None
    src = f"{q['bits']}-bit group {q['group_size']}" if q else None
    if quantize:
        how = f"{quantize[0]}-bit group {quantize[1]}"
        return {
            "comparison": "quantized",
            "comparison_note": f"both models quantized ({how}, -q) from the same "
            "float weights after folding: differences include quantization, not "
            "only FlashNorm",
        }
    if src is None:
        return {
            "comparison": "float",
            "comparison_note": "both models on the same float weights (the source "
            "is not quantized): differences are FlashNorm's alone",
        }
    if dequantize:
        return {
            "comparison": "float",
            "comparison_note": f"the {src} source dequantized, both models on the "
            "same float weights: differences are FlashNorm's alone (--requantize "
            "compares requantized models, quantization differences included)",
        }
    return {
        "comparison": "requantized",
        "comparison_note": f"both models requantized to the source's {src} from the "
        "same float weights (FlashNorm's after folding): differences include "
        "quantization, not only FlashNorm (--dequantize isolates FlashNorm)",
    }
