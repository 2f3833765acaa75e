"""Perplexity of stock mlx-lm and FlashNorm on the same text and the same weights:
windows of seq_len tokens spread over the text, each predicting its tokens
2..seq_len as mlx-lm's perplexity does; both models built from one Source.
"""

import math
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from .. import estimate, models, quant
from ..loading import (
    RUN_MODES,
    LoadError,
    Mode,
    Source,
    bits_per_weight,
    build_model,
    gguf_kquant,
    model_dtype,
    recipe,
)
from ..modes import FLASHNORM
from ..progress import counter, progress_bar
from ..quant import gptq
from ..texts import calibration_text, default_text  # noqa: F401 (public here too)

WARMUP_TOKENS = 16  # one window's first tokens, through each model before timing
MIN_TIMED_TOKENS = 256  # fewer scored per side: no tokens/sec (overhead, not speed)


def load_text(path: Optional[str]) -> str:
    """The text of a UTF-8 file, or the default text for None."""
    if path is None:
        return default_text()
    p = Path(path).expanduser()
    if not p.is_file():
        raise LoadError(f"no such data file: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise LoadError(f"{path}: not a readable UTF-8 text file ({e})") from None
    if not text.strip():
        raise LoadError(f"{path}: the data file is empty")
    return text


def windows(tokens: Sequence[int], seq_len: int, num_seqs: Optional[int]) -> mx.array:
    """(K, seq_len) non-overlapping windows spread evenly over the tokens."""
    if seq_len < 2:
        raise LoadError("--seq-len must be at least 2")
    available = len(tokens) // seq_len
    if available == 0:
        raise LoadError(
            f"the text has {len(tokens)} tokens, fewer than one window of {seq_len}"
        )
    k = available if not num_seqs else min(num_seqs, available)
    starts = np.linspace(0, available - 1, k).round().astype(int) * seq_len
    arr = np.asarray(tokens, dtype=np.int32)
    return mx.array(np.stack([arr[s : s + seq_len] for s in starts]))


def token_nll(model, batch: mx.array) -> mx.array:
    """(B, L-1) next-token negative log-likelihoods, computed in float32."""
    logits = model(batch[:, :-1]).astype(mx.float32)
    targets = batch[:, 1:]
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return mx.logsumexp(logits, axis=-1) - picked


def _model_nll(model, data: mx.array, batch_size: int, advance=None) -> np.ndarray:
    out = []
    for s in range(0, data.shape[0], batch_size):
        nll = token_nll(model, data[s : s + batch_size])
        mx.eval(nll)
        out.append(np.array(nll, dtype=np.float64).ravel())
        if advance is not None:
            advance(min(batch_size, data.shape[0] - s))
    return np.concatenate(out)


def perplexity(
    source: Source,
    text: Optional[str] = None,
    tokens: Optional[List[int]] = None,
    seq_len: int = 256,
    num_seqs: Optional[int] = 16,
    modes: Iterable[Union[str, Mode]] = RUN_MODES,
    batch_size: int = 4,
    dtype: Optional[mx.Dtype] = None,
    quantize: Optional[Tuple[int, int]] = None,
    quantized_way: str = "stored",
    progress: bool = False,
    q_method: str = gptq.DEFAULT_METHOD,
    calibration: gptq.Calibration = gptq.Calibration(),
    on_stage: Optional[Callable[[str], None]] = None,
    on_step: Optional[Callable[[str], None]] = None,
    on_slow: estimate.Say = None,
) -> dict:
    """Perplexity per mode on `tokens` (or `text`, default: `default_text()`).

    Returns {"stock": ppl, "flashnorm": ppl, "diff_rel": (flashnorm - stock) /
    stock, ...} (the keys of the modes asked for; diff_rel and the largest
    per-token NLL difference when both ran). quantize=(bits, group_size)
    quantizes the float weights with these settings, also for a quantized
    source (which is dequantized first); without it a quantized source is
    taken as `quantized_way` says (quant/plan.py): as stored by default, both models on
    the very same quantized weights. Quantized by us (-q, "requantize"), stock
    is mlx-lm's round-to-nearest and FlashNorm uses `q_method` (GPTQ on the
    folded weights, calibrated on `calibration_text`, see gptq.py; "rtn"; or
    "auto", the default: `gptq.resolve`); each side reports its method and bits per weight, and the result
    a 95% confidence interval of the relative difference (over windows).
    on_stage(text) is told when a model is built and scored (and GPTQ's
    stages); on_step(text) where the work is, before each step (a batch);
    on_slow(line) once, after the first batch (or GPTQ's first piece), where
    what is left would take more than `estimate.threshold()`.
    """
    stage = on_stage or (lambda text: None)
    step = on_step or (lambda text: None)
    modes = [models.run_mode(source.config, m) for m in modes]  # Modes, or names
    data = _data(source, modes, text, tokens, seq_len, num_seqs)
    kw = dict(dtype=dtype, quantize=quantize, quantized_way=quantized_way)
    requantized = quant.requantizes(
        source.weights, source.config, quantize, quantized_way
    )
    q_method = gptq.resolve(q_method)
    if requantized and q_method == "gptq" and any(m.ours for m in modes):
        # Settings GPTQ cannot write fail now, not after stock is scored.
        quant.plan_weights(source.weights, source.config, **kw, q_method="gptq")
    result: Dict[str, object] = {
        "model": source.name,
        "seq_len": seq_len,
        "num_seqs": int(data.shape[0]),
        "tokens_scored": int(data.shape[0] * (seq_len - 1)),
    }
    nll: Dict[str, np.ndarray] = {}
    batches = -(-int(data.shape[0]) // batch_size) * len(modes)
    piece = f"a batch of {min(batch_size, data.shape[0])} windows of {seq_len} tokens"

    def first_batch(seconds: float) -> None:  # every batch left, every mode's
        line = estimate.projection(piece, seconds, batches - 1)
        estimate.tell(on_slow, line)

    gptq_run = (
        (calibration, stage, on_slow) if q_method == "gptq" and requantized else None
    )
    with progress_bar(progress, "[bold]{task.description}[/] windows") as bar:
        for mode in modes:
            model = _build(source, mode, kw, requantized, gptq_run, bar, step, result)
            stage(f"built {mode} ({result[f'{mode}_method']})")
            first = first_batch if mode == modes[0] else None
            nll[mode.name] = _score(
                model, mode.name, data, batch_size, bar, step, result, first
            )
            stage(f"{mode}: {data.shape[0]}/{data.shape[0]} windows scored")
            del model
    if len(nll) == 2:
        result.update(_difference(result, nll, int(data.shape[0])))
    return result


def _difference(result: dict, nll: Dict[str, np.ndarray], windows: int) -> dict:
    """FlashNorm's against stock's: the relative difference of their
    perplexities, the largest per-token NLL difference, and its 95% interval."""
    diff = nll["flashnorm"] - nll["stock"]
    return {
        "diff_rel": (result["flashnorm"] - result["stock"]) / result["stock"],
        "max_token_nll_diff": float(np.abs(diff).max()),
        "diff_rel_ci95": _ratio_ci(diff.reshape(windows, -1)),
    }


def _data(source, modes, text, tokens, seq_len, num_seqs) -> mx.array:
    """The windows to score, once the modes are known good."""
    for m in modes:
        if m.name not in RUN_MODES:
            raise LoadError(f"unknown mode {m!r}; choose from {', '.join(RUN_MODES)}")
    if tokens is None:
        if source.tokenizer is None:
            raise LoadError(f"{source.name} has no tokenizer; pass --tokenizer")
        text = text if text is not None else default_text()
        tokens = list(source.tokenizer.encode(text))
    return windows(tokens, seq_len, num_seqs)


def _build(source, mode, kw, requantized, gptq_run, bar, step, result):
    """`mode`'s model; its method, dtype, quantization and bits into result.
    gptq_run: (calibration, stage, on_slow) where FlashNorm is GPTQ's."""
    step(f"building {mode}")
    flash = mode.ours  # our class: GPTQ folds, stock's is RTN
    if flash and gptq_run:
        calibration, stage, on_slow = gptq_run
        model, config = _gptq_flashnorm(
            source, kw, calibration, bar, stage, step, on_slow
        )
    else:
        model, config = build_model(source, mode, **kw)
    method = (
        ("gptq" if flash and gptq_run else "rtn")
        if requantized
        else "stored" if config.get("quantization") else "float"
    )
    result.update(
        dtype=model_dtype(model), quantization=_quantization(config, requantized)
    )
    result[f"{mode}_method"] = method
    result[f"{mode}_bits_per_weight"] = bits_per_weight(model)
    return model


def _score(model, mode, data, batch_size, bar, step, result, first=None):
    """Per-token NLL of `model` on the windows (np.ndarray); perplexity and
    speed into result; first(seconds): told the first batch's time."""
    n = int(data.shape[0])
    task = bar.add_task(mode, total=n)
    line = f"scoring {mode}: {{done}}/{{total}} windows scored"
    advance = counter(bar, task, n, step, line)
    step(f"warming up {mode}")
    # Both sides timed warm: the first forward pays MLX's one-time costs.
    mx.eval(token_nll(model, data[:1, : min(data.shape[1], WARMUP_TOKENS)]))
    advance(0)
    start = time.perf_counter()

    def advanced(k: int) -> None:
        nonlocal first
        advance(k)
        if first is not None:
            first, told = None, first
            told(time.perf_counter() - start)

    nll = _model_nll(model, data, batch_size, advanced)
    seconds = time.perf_counter() - start
    mean = float(nll.mean())
    result[mode] = math.exp(mean)
    result[f"{mode}_nll"] = mean
    # A few tokens time the call overhead, not the model: no figure then.
    timed = data.size >= MIN_TIMED_TOKENS
    result[f"{mode}_tokens_per_sec"] = data.size / seconds if timed else None
    return nll


def _ratio_ci(diff: np.ndarray) -> Optional[List[float]]:
    """95% interval of ppl_flashnorm / ppl_stock - 1 from per-token NLL differences
    (windows, tokens): windows are the independent units (tokens within one are
    not), so the standard error is over window means."""
    if diff.shape[0] < 2:
        return None
    means = diff.mean(axis=1)
    se = means.std(ddof=1) / math.sqrt(len(means))
    mid = diff.mean()
    return [math.exp(mid - 1.96 * se) - 1, math.exp(mid + 1.96 * se) - 1]


def _gptq_flashnorm(source: Source, kw, calibration, bar, stage, step, on_slow):
    """FlashNorm quantized by GPTQ on its folded weights: the checkpoint `convert`
    would write (loading/recipe.py, the one way GPTQ runs), from the same float weights
    and with the same settings stock's RTN gets, in the compute dtype."""
    dtype = kw["dtype"] or quant.compute_dtype(source.weights, source.config)
    weights, config = recipe.fold_checkpoint(
        source,
        dict(source.weights),
        kw["quantize"],
        dtype,
        kw["quantized_way"],
        q_method="gptq",
        calibration=calibration,
        bar=bar,
        on_stage=stage,
        on_step=step,
        on_slow=on_slow,
    )
    converted = Source(source.name, config, weights, source.tokenizer)
    return build_model(converted, FLASHNORM, dtype=dtype)


def _quantization(config: dict, requantized: bool = False) -> Optional[str]:
    words = quant.describe(config) if config.get("quantization") else None
    floats = gguf_kquant.floats_of(config)
    if floats and not requantized:  # a GGUF's Q6_K & co., read as float (not -q)
        kinds = "/".join(sorted(set(floats.values())))  # never "not quantized"
        return f"{words}, " * bool(words) + f"{kinds} in float"
    return words
