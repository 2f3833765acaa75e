"""Decode and prompt tokens/sec of mlx-lm, stock, FlashNorm and the norm-removed bound.

Measured as docs/design.md section 4 says: every variant (loading/rows.py:
a mode on an engine) is built from one `Source` (same weights, dtype,
quantization), runs the same random prompt (fixed seed) through mlx-lm's own
`generate_step` for exactly G tokens (it never stops at end-of-sequence), gets
one warm-up, then N trial rounds interleaved across the variants in a rotating
order. `run_bench` returns every trial and a summary.

The four modes run on the bench's one engine, so their ratios differ
in the norms alone; `mlx-lm` (stock, eager) is what users run today. Three
ratios answer three questions (section 4c): flashnorm vs mlx-lm, what switching
buys; flashnorm vs stock, what FlashNorm buys; nonorm vs stock, the bound.
"""

import hashlib
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import dispatch
from .. import engine as engines
from .. import estimate, models, quant
from ..errors import BenchError
from ..loading import Source, build_model, gguf_kquant, model_dtype, weight_bytes
from ..loading.nonorm import rms_norm_paths
from ..loading.rows import BY_NAME, NAMES, absent, comparison
from ..models import covered_words, is_covered, model_classes
from ..parallel import distributed
from ..timing import (
    HOST_STEPS,
    first_steps,
    passes_left,
    step_times,
    time_generation,
)
from .speed_report import report

# progress(description, steps done, steps in all)
Progress = Callable[[str, int, int], None]


# --- what was run, on what ---------------------------------------------------


def weights_checksum(weights: Dict[str, mx.array]) -> str:
    """blake2b over names, dtypes, shapes and raw bytes of every tensor, sorted."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(weights):
        v = weights[key]
        h.update(f"{key}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(memoryview(np.asarray(v.reshape(-1).view(mx.uint8))))
    return h.hexdigest()


def decode_bytes(model: nn.Module, config: dict) -> int:
    """Parameter bytes one decode step reads (see DECODE_BYTES_NOTE)."""
    params = tree_flatten(model.parameters())
    if not models.is_covered(config):  # mlx-lm's class: its embedding modules
        tables = [
            name
            for name, m in model.named_modules()
            if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
        ]
        table = sum(v.nbytes for k, v in params if k.startswith(tuple(tables)))
        has_head = any(k.startswith("lm_head.") for k, _ in params)
        return weight_bytes(model) - (table if has_head else 0)
    arch = models.architecture(config)
    embed, head = arch.embed, arch.head
    has_head = any(k.startswith(f"{head}.") for k, _ in params)
    table = sum(v.nbytes for k, v in params if k.startswith(f"{embed}."))
    return weight_bytes(model) - (table if has_head else 0)


# --- one timed generation ----------------------------------------------------


def step_dispatches(model: nn.Module) -> dict:
    """What one decode step launches: on this build, and as a GPU would run it."""
    here = dispatch.count_dispatches(model)
    with dispatch.gpu_like():
        gpu = dispatch.count_dispatches(model)
    return {
        "dispatches_per_token": here["dispatches"],
        "views_per_token": here["views"],
        "dispatches_per_token_gpu_model": gpu["dispatches"],
        "primitives_per_token": here["by_primitive"],
    }


def check_logits(model: nn.Module, tokens: List[int]) -> dict:
    """One uncached forward pass over `tokens`: are all logits finite, how large."""
    logits = model(mx.array(tokens)[None]).astype(mx.float32)
    finite = mx.isfinite(logits).all()
    peak = mx.max(mx.where(mx.isfinite(logits), mx.abs(logits), 0.0))
    mx.eval(finite, peak)
    return {"logits_finite": bool(finite.item()), "max_abs_logit": peak.item()}


# --- the benchmark -----------------------------------------------------------


def validate(
    variants: Sequence[str],
    prompt_tokens: int,
    gen_tokens: int,
    trials: int,
    engine: Optional[str] = None,
):
    for i, v in enumerate(variants):
        if v not in NAMES:
            raise BenchError(
                f"--variants: unknown variant {v!r}; choose from {', '.join(NAMES)}"
            )
        if v in variants[:i]:
            raise BenchError(f"--variants: {v} is named twice")
    if not variants:
        raise BenchError("--variants needs one or more variants")
    if trials < 1:
        raise BenchError(f"-n/--num-trials must be at least 1 (got {trials})")
    if prompt_tokens < 1:
        raise BenchError(f"-p/--prompt-tokens must be at least 1 (got {prompt_tokens})")
    if gen_tokens < 2:
        raise BenchError(
            f"-g/--generation-tokens must be at least 2 (got {gen_tokens}): "
            "decode speed needs two tokens"
        )
    if engine is not None and engine not in engines.ENGINES:
        raise BenchError(
            f"--engine: unknown engine {engine!r}; choose from "
            f"{', '.join(engines.ENGINES)}"
        )


def prompt_ids(config: dict, n: int, seed: int) -> List[int]:
    vocab = config.get("vocab_size") or 32000
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


class _Steps:
    """Counts the benchmark's stages for `progress(description, done, total)`."""

    def __init__(self, progress: Optional[Progress], total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, desc: str) -> None:
        distributed.kick()  # progress: the other ranks are alive
        if self.progress:
            self.progress(desc, self.done, self.total)
        self.done += 1

    def finish(self) -> None:
        if self.progress:
            self.progress("done", self.total, self.total)


def _build_variants(source: Source, variants, engine: str, built: dict, step):
    """{variant: model}, {variant: what was built (class, bytes, launches, ...)}."""
    for v in variants:  # import the model modules now, so build_s times only the build
        try:
            model_classes(source.config, BY_NAME[v].mode.ours)
        except ImportError as e:
            raise BenchError(f"no {v} model for {source.config['model_type']}: {e}")
    models, info = {}, {}
    for v in variants:
        step(f"building {v}")
        row = BY_NAME[v]
        t0 = time.perf_counter()
        model, config = build_model(
            source, row.mode, engine=row.engine or engine, **built
        )
        build_s = time.perf_counter() - t0
        cls = type(model)
        q = config.get("quantization")
        models[v] = model
        info[v] = {
            "mode": row.mode.name,
            "engine": engines.engine_of(model),
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "compiled": engines.is_compiled(model),
            "build_s": build_s,
            # Re-hashed after each build: every variant saw these exact weights.
            "source_checksum": weights_checksum(source.weights),
            "rms_norm_modules": len(rms_norm_paths(model)),
            "dtype": model_dtype(model),
            "quantization": quant.q_settings(q) if q else None,
            "weight_bytes": weight_bytes(model),
            "decode_bytes_per_token": decode_bytes(model, config),
            **step_dispatches(model),
        }
    return models, info


def _warm_ups(models, info, prompt, gen_tokens, trials, timing, step, on_slow):
    """Each variant's first steps (its compile, on a traced engine), then one
    warm-up generation and its logits check; returns each variant's first step
    times. After the first, on_slow hears the estimate of every pass left."""
    variants, first = list(models), {}
    for v in variants:
        step(f"warm-up {v}")
        t0 = time.perf_counter()
        first[v] = first_steps(models[v], prompt)  # an eager step, then a trace
        t1 = time.perf_counter()
        warm = time_generation(models[v], prompt, gen_tokens, **timing)
        t2 = time.perf_counter()
        info[v].update(check_logits(models[v], prompt.tolist() + warm["tokens"]))
        if v == variants[0]:  # every pass left, priced from this warm-up's
            done = time.perf_counter() - t0
            left = passes_left(len(variants), trials, gen_tokens, warm, t2 - t1, done)
            line = estimate.projection(f"the warm-up of {v}", done, left / done)
            estimate.tell(on_slow, line)
    return first


def _timed_rounds(models, variants, prompt, gen_tokens, trials, timing, step):
    """Every variant once per round, in an order that rotates each round."""
    records = []
    for r in range(trials):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for pos, v in enumerate(order):
            step(f"round {r + 1}/{trials}: {v}")
            t = time_generation(models[v], prompt, gen_tokens, **timing)
            t.pop("tokens")
            records.append({"round": r, "position": pos, "variant": v, **t})
    return records


def run_bench(
    source: Source,
    variants: Optional[Sequence[str]] = None,
    prompt_tokens: int = 256,
    gen_tokens: int = 128,
    trials: int = 5,
    *,
    dtype: Optional[mx.Dtype] = None,
    quantize: Optional[Tuple[int, int]] = None,
    quantized_way: str = "stored",
    seed: int = 0,
    prefill_step_size: int = 2048,
    sampler=None,
    progress: Optional[Progress] = None,
    group: Optional[mx.distributed.Group] = None,
    engine: Optional[str] = None,
    on_slow: estimate.Say = None,
) -> dict:
    """Build every variant from `source` (None: every one it can run, see
    `rows.absent`), warm each up, time `trials` rounds.

    Returns {"settings", "device", "versions", "source", "variants" (per-variant
    summary), "ratios", "headroom", "trials" (every timed run)}.
    sampler: mlx-lm sampler (default greedy); generation never stops early.
    group: every variant tensor-parallel over it (each rank runs this, in step).
    engine: what runs every variant's decode steps but mlx-lm's (always eager);
    None: `engine.default()`, compiled where a GPU runs the model.
    on_slow(line): told once, after the first warm-up, where the generations
    left would take more than `estimate.threshold()`.
    """
    missing = absent(source.config)  # rows the family cannot run, or lacks
    variants = _rows_to_run(source.config, variants, missing)
    validate(variants, prompt_tokens, gen_tokens, trials, engine)
    engine = engines.resolve(engine)
    step = _Steps(progress, len(variants) * (3 + trials))
    t0 = time.perf_counter()
    checksum = weights_checksum(source.weights)
    checksum_s = time.perf_counter() - t0
    prompt = mx.array(prompt_ids(source.config, prompt_tokens, seed))
    built = dict(
        dtype=dtype, quantize=quantize, quantized_way=quantized_way, group=group
    )
    models, info = _build_variants(source, variants, engine, built, step)
    distributed.barrier("building")  # a launch's ranks start timing together
    timing = dict(sampler=sampler, prefill_step_size=prefill_step_size)
    with distributed.watch("benchmarking"):  # each step kicks it
        first = _warm_ups(
            models, info, prompt, gen_tokens, trials, timing, step, on_slow
        )
        records = _timed_rounds(
            models, variants, prompt, gen_tokens, trials, timing, step
        )
        for v in variants:  # after the rounds, so it cannot disturb them
            step(f"host time {v}")
            info[v].update(step_times(models[v], prompt, min(gen_tokens, HOST_STEPS)))
            settled = info[v]["host_build_ms"] + info[v]["eval_ms"]
            info[v]["compile_ms"] = sum(max(0.0, t * 1e3 - settled) for t in first[v])
    step.finish()
    settings = {
        "variants": variants,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "trials": trials,
        "seed": seed,
        "prefill_step_size": prefill_step_size,
        "world_size": group.size() if group else 1,
        "parallel": distributed.describe(group) if group else None,
        "dtype": str(dtype).replace("mlx.core.", "") if dtype else None,
        "quantize": list(quantize) if quantize else None,
        "quantized": quantized_way,
        "engine": engine,
    }
    src = _source_record(source, checksum, checksum_s, quantize, quantized_way)
    covered = is_covered(source.config)
    result = report(settings, src, info, records, covered=covered)
    why = sorted(set(missing.values()))  # one reason for all of them
    result.update(absent=missing, notes=why + result["notes"])
    return result


def _rows_to_run(config: dict, variants, missing: dict) -> List[str]:
    """The rows asked (None: every one the model can run); a BenchError names
    a row the family cannot run, or FlashNorm's of a family it does not cover."""
    asked = [v for v in variants or () if v in missing]
    if asked and is_covered(config):  # a mode the family cannot
        raise BenchError(f"--variants {asked[0]}: {missing[asked[0]]}")
    if asked:
        raise BenchError(
            f"--variants {asked[0]}: FlashNorm does not cover model_type "
            f"{config.get('model_type')!r} yet (it covers "
            f"{covered_words()}); bench runs mlx-lm and stock on it"
        )
    return list(variants or [v for v in NAMES if v not in missing])


def _source_record(source, checksum, checksum_s, quantize, quantized_way) -> dict:
    """What the report says of the weights every row ran on."""
    return {
        "name": source.name,
        "model_type": source.config.get("model_type"),
        "checksum": checksum,
        "checksum_algorithm": "blake2b-128 over sorted (name, dtype, shape, bytes)",
        "checksum_s": checksum_s,
        "quantized": quant.is_quantized(source.weights),
        # A GGUF's tensors of a type MLX cannot hold, read as float: module -> type
        "float_kquants": gguf_kquant.floats_of(source.config),
        **comparison(source, quantize, quantized_way),
    }
