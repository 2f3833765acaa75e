"""Numeric equivalence of FlashNorm against stock mlx-lm on the same weights."""

from typing import Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from . import quant
from .loading import Source, build_model, model_dtype
from .loading.adapters import adapted_quantization, apply_adapter, mlx_lm_adapted

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
    quantized_way: str = "stored",
    on_stage: Optional[Callable[[str], None]] = None,
    engine: Optional[str] = None,
    adapter: Optional[str] = None,
) -> dict:
    """Prefill `tokens`, then `horizon` cached greedy decode steps, on both models,
    both on `engine` (engine.py; None: its default).

    Stock picks the greedy tokens; FlashNorm is fed the same tokens (teacher
    forcing), so every logit row compares the same inputs. greedy_match counts
    the leading steps where FlashNorm's argmax equals stock's token. Where the
    two carry errors of their own (float16/bfloat16, or weights quantized by
    us), both are also scored against stock in float32 on the source's own
    weights (`reference_*` keys): is FlashNorm's error within stock's?
    on_stage(text) is told when each stage (build, prefill, decode) is done.
    adapter: an mlx-lm LoRA/DoRA folder; `source` is then the base model:
    FlashNorm runs it fused in (loading/adapters.py), stock is mlx-lm's own
    adapted model (`load_adapters`, as `mlx_lm.utils.load(adapter_path=)`).
    """
    stage = on_stage or (lambda text: None)
    kw = dict(
        dtype=dtype, quantize=quantize, quantized_way=quantized_way, engine=engine
    )
    base = source
    if adapter is not None:
        source = apply_adapter(base, adapter)
        kw["quantize"], _ = adapted_quantization(source, quantize, quantized_way)
    models = {
        "stock": build_model(base, "stock", **{**kw, "quantize": quantize})[0],
        "flashnorm": build_model(source, "flashnorm", **kw)[0],
    }
    if adapter is not None:
        models["stock"] = mlx_lm_adapted(models["stock"], adapter)
    noisy = model_dtype(models["stock"]) != "float32" or quant.requantizes(
        source.weights, source.config, quantize, quantized_way
    )
    if noisy:  # the source's own function, as exactly as MLX computes it
        ref_kw = dict(dtype=mx.float32, quantized_way="stored", engine="eager")
        models["reference"] = build_model(source, "stock", **ref_kw)[0]
    stage(
        "built stock and FlashNorm on the same weights"
        + (" and stock float32 as the reference" if noisy else "")
    )
    rows = _teacher_forced(models, tokens, horizon, stage)
    ls, lf = rows["stock"], rows["flashnorm"]
    r = _scores(ls, lf)
    r["greedy_match"] = _leading_matches(rows["stock"], rows["flashnorm"], horizon)
    if noisy:
        ref = rows["reference"]
        err_f = _scores(ref, lf)["max_rel_logit_diff"]
        err_s = _scores(ref, ls)["max_rel_logit_diff"]
        r.update(
            reference="stock mlx-lm in float32 on the source's weights",
            reference_flashnorm_rel_diff=err_f,
            reference_stock_rel_diff=err_s,
            flashnorm_within_stock_error=err_f <= err_s,
        )
    r["passed"], r["verdict"] = verdict(r)
    return {
        "model": source.name,
        **({"adapter": str(adapter)} if adapter is not None else {}),
        "model_type": source.config.get("model_type"),
        "dtype": model_dtype(models["stock"]),
        "quantized": any(
            "Quantized" in type(m).__name__ for _, m in models["stock"].named_modules()
        ),
        "prompt_tokens": len(tokens),
        **r,
        "greedy_horizon": horizon,
    }


# FlashNorm against stock on the same weights in float32: the tolerance every
# family's tests hold it to (README, "Supported architectures").
FLOAT32_TOL = 1e-4
# Both sides noisy (float16/bfloat16, or quantized by us): FlashNorm's error
# against stock in float32 may be up to this many times stock's own.
NOISY_FACTOR = 2.0


def verdict(r: dict) -> Tuple[bool, str]:
    """(passed, the line verify ends with): "PASS: ..." or "FAIL: ...", with
    the figure that decided it. Non-finite logits fail."""
    if not (r["stock_finite"] and r["flashnorm_finite"]):
        return False, "FAIL: non-finite logits (stock, flashnorm: " + (
            f"{r['stock_finite']}, {r['flashnorm_finite']})"
        )
    if "reference" in r:
        f, s = r["reference_flashnorm_rel_diff"], r["reference_stock_rel_diff"]
        ok = f <= max(NOISY_FACTOR * s, FLOAT32_TOL)
        figure = (
            f"FlashNorm's error against stock float32 is {f:.2e}, {f / max(s, 1e-30):.2f}x "
            f"stock's own {s:.2e} (pass: up to {NOISY_FACTOR:g}x)"
        )
    else:
        rel = r["max_rel_logit_diff"]
        ok = rel <= FLOAT32_TOL
        figure = (
            f"max |logit diff| / max |logit| {rel:.2e} on the same weights "
            f"(pass: up to {FLOAT32_TOL:g})"
        )
    return ok, f"{'PASS' if ok else 'FAIL'}: {figure}"


def _teacher_forced(models: dict, tokens: List[int], horizon: int, stage) -> dict:
    """{name: float32 logits (prompt + horizon rows, vocab)}: stock's greedy
    tokens fed to every model, each with its own KV cache."""
    caches = {k: make_prompt_cache(m) for k, m in models.items()}
    rows = {k: [] for k in models}
    every = max(1, horizon // 4)  # about four decode lines, whatever the horizon
    x = mx.array(tokens)[None]
    for step in range(horizon + 1):
        out = {
            k: m(x, cache=caches[k])[0].astype(mx.float32) for k, m in models.items()
        }
        mx.eval(out)
        for k, v in out.items():
            rows[k].append(v)
        x = mx.array([[mx.argmax(out["stock"][-1]).item()]])
        if step == 0:
            stage(f"prefilled {len(tokens)} prompt tokens")
        elif step % every == 0 or step == horizon:
            stage(f"decode step {step}/{horizon}")
    return {k: mx.concatenate(v) for k, v in rows.items()}


def _leading_matches(ls: mx.array, lf: mx.array, horizon: int) -> int:
    """Leading decode steps where both argmaxes agree (the prompt's last row
    predicts step 1)."""
    a = mx.argmax(ls[-horizon - 1 : -1], axis=-1)
    b = mx.argmax(lf[-horizon - 1 : -1], axis=-1)
    same = (a == b).tolist()
    return next((i for i, m in enumerate(same) if not m), len(same))


def _scores(ls: mx.array, lf: mx.array) -> dict:
    """Logit differences and KL(ls || lf) of two (rows, vocab) float32 arrays."""
    diff = mx.abs(ls - lf)
    ps = nn.log_softmax(ls)
    # Clamp float round-off: KL is non-negative.
    kl = mx.maximum(mx.sum(mx.exp(ps) * (ps - nn.log_softmax(lf)), axis=-1), 0.0)
    scale = mx.abs(ls).max().item()
    return {
        "max_abs_logit_diff": diff.max().item(),
        "max_rel_logit_diff": diff.max().item() / max(scale, 1e-30),
        "logit_scale": scale,
        "kl": mx.mean(kl).item(),
        "kl_max": mx.max(kl).item(),
        "stock_finite": bool(mx.isfinite(ls).all()),
        "flashnorm_finite": bool(mx.isfinite(lf).all()),
    }
