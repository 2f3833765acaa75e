"""Decode and prompt tokens/sec of stock mlx-lm, FlashNorm and the norm-removed bound.

Measured as docs/design.md section 4c says: every variant is built from one `Source`
(same weights, dtype, quantization), runs the same random prompt (fixed seed)
through mlx-lm's own `generate_step` for exactly G tokens (it never stops at
end-of-sequence), gets one warm-up, then N trial rounds interleaved across the
variants in a rotating order. `run_bench` returns every trial and a summary.

Timing follows mlx-lm's `stream_generate`: prompt time runs until the first
token is known (prefill + one sample); decode time runs from the first token to
the G-th, which is G - 1 decode steps (mlx-lm divides G by that same interval,
so its decode numbers read G / (G - 1) higher).
"""

import hashlib
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import decode, dispatch, kernels, models, quant
from .errors import BenchError
from .loading import MODES, Source, build_model, model_dtype, weight_bytes
from .loading.nonorm import rms_norm_paths
from .machine import device_info, versions
from .models import model_classes
from .parallel import distributed
from .verify import comparison

DECODE_BYTES_NOTE = (
    "bytes of parameters one decode step reads: every linear (packed weights, "
    "scales, biases) and norm gain; the input embedding table only when it is "
    "also the output head (tied), since a step gathers just one row of it; "
    "KV-cache reads are not counted"
)

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
    arch = models.architecture(config)
    embed, head = arch.embed, arch.head
    params = tree_flatten(model.parameters())
    has_head = any(k.startswith(f"{head}.") for k, _ in params)
    table = sum(v.nbytes for k, v in params if k.startswith(f"{embed}."))
    return weight_bytes(model) - (table if has_head else 0)


# --- one timed generation ----------------------------------------------------


def time_generation(
    model: nn.Module,
    prompt: mx.array,
    gen_tokens: int,
    sampler=None,
    prefill_step_size: int = 2048,
) -> dict:
    """Exactly `gen_tokens` tokens through mlx-lm's generate_step, timed."""
    from mlx_lm.generate import generate_step, generation_stream, wired_limit

    mx.synchronize()
    mx.reset_peak_memory()
    resident = mx.get_active_memory()  # every built variant's weights, and more
    tokens: List[int] = []
    logprobs = None
    with wired_limit(model, [generation_stream]):
        tic = time.perf_counter()
        t_first = t_last = tic
        for token, logprobs in generate_step(
            prompt,
            model,
            max_tokens=gen_tokens,
            sampler=sampler,
            prefill_step_size=prefill_step_size,
        ):
            t_last = time.perf_counter()
            if not tokens:
                t_first = t_last
            tokens.append(int(token))
        # generate_step queues one step beyond the last token: let it finish untimed
        # (on its own stream: under a launch its all-sums must not meet the next
        # forward's in another order on each rank).
        mx.synchronize(generation_stream)
        mx.synchronize()
    prompt_s, decode_s = t_first - tic, t_last - t_first
    return {
        "prompt_s": prompt_s,
        "decode_s": decode_s,
        "prompt_tps": prompt.size / prompt_s,
        "decode_tps": (len(tokens) - 1) / decode_s if decode_s > 0 else float("nan"),
        "generated_tokens": len(tokens),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        # What the trial itself added: activations, KV cache, logits.
        "trial_memory_gb": (mx.get_peak_memory() - resident) / 1e9,
        "last_logprobs_finite": bool(mx.isfinite(logprobs).all().item()),
        "tokens": tokens,
    }


HOST_NOTE = (
    "host_build_ms: host time to build one decode step's graph (Python, or a "
    "compiled step's replay) until the call returns; eval_ms: MLX encoding and "
    "running it (mx.eval); medians over a synchronous pass after the timed "
    "rounds; compile_ms: what the first steps of the warm-up spent beyond that "
    "pass's median (the eager first step and the trace of a compiled variant)"
)


def step_times(model: nn.Module, prompt: mx.array, steps: int) -> dict:
    """Host build and eval of `steps` greedy decode steps after `prompt`, each
    evaluated before the next is built (section 4c: build and eval apart)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)
    token = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(token)
    build, run = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(token, cache=cache)
        t1 = time.perf_counter()
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
        build.append(t1 - t0)
        run.append(time.perf_counter() - t1)
    return {
        "host_build_ms": 1e3 * statistics.median(build),
        "eval_ms": 1e3 * statistics.median(run),
    }


def warm_up(model: nn.Module, prompt: mx.array, gen_tokens: int, timing) -> dict:
    """The untimed first generation, its first decode steps' host time apart:
    where a compiled variant runs eagerly once and then traces."""
    steps = []
    cls = type(model)
    own, real = "__call__" in cls.__dict__, cls.__call__

    def timed(self, inputs, *args, **kwargs):
        t0 = time.perf_counter()
        out = real(self, inputs, *args, **kwargs)
        if inputs.shape[-1] == 1:  # a decode step, not a prefill chunk
            steps.append(time.perf_counter() - t0)
        return out

    cls.__call__ = timed
    try:
        warm = time_generation(model, prompt, gen_tokens, **timing)
    finally:
        if own:
            cls.__call__ = real
        else:
            del cls.__call__
    warm["first_steps_s"] = steps[:3]
    return warm


DISPATCH_NOTE = (
    "dispatches_per_token: kernel-launching primitives in the graph of one "
    "decode step on this build (views such as reshape/transpose counted apart); "
    "dispatches_per_token_gpu_model: the same step with every mx.fast op and "
    "FlashNorm kernel as one launch, as Metal and CUDA run them"
)


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


# --- statistics --------------------------------------------------------------


def spread(values: Sequence[float]) -> dict:
    """Median, min, max and quartiles (inclusive method) of trial values."""
    vals = sorted(values)
    q = (
        statistics.quantiles(vals, n=4, method="inclusive")
        if len(vals) > 1
        else vals * 3
    )
    return {
        "median": statistics.median(vals),
        "min": vals[0],
        "max": vals[-1],
        "q1": q[0],
        "q3": q[2],
    }


def _ratios(trials: List[dict], variant: str, base: str, key: str) -> dict:
    by_round: Dict[int, Dict[str, float]] = {}
    for t in trials:
        by_round.setdefault(t["round"], {})[t["variant"]] = t[key]
    per_round = [
        r[variant] / r[base] for r in by_round.values() if variant in r and base in r
    ]
    med_v = statistics.median(r[variant] for r in by_round.values() if variant in r)
    med_b = statistics.median(r[base] for r in by_round.values() if base in r)
    return {
        "median_of_ratios": statistics.median(per_round),
        "ratio_of_medians": med_v / med_b,
        "rounds_faster": sum(x > 1.0 for x in per_round),
        "rounds": len(per_round),
    }


def _headroom(summary: dict) -> dict:
    """Share of the stock -> nonorm decode speed-up that FlashNorm captures."""
    need = ("stock", "flashnorm", "nonorm")
    if not all(v in summary for v in need):
        return {"share": None, "note": "needs all of stock, flashnorm and nonorm"}
    st, fn, nn_ = (summary[v]["decode_tps"]["median"] for v in need)
    gap = nn_ - st
    # The run-to-run spread: a gap inside it is no headroom, and a share of it
    # would be a percentage of noise.
    noise = max(
        summary[v]["decode_tps"]["q3"] - summary[v]["decode_tps"]["q1"]
        for v in ("stock", "nonorm")
    )
    measurable = gap > noise
    out = {
        "stock_tps": st,
        "flashnorm_tps": fn,
        "nonorm_tps": nn_,
        "headroom_tps": gap,
        "noise_tps": noise,
        "share": (fn - st) / gap if gap > 0 and measurable else None,
    }
    pst, pfn, pnn = (summary[v]["prompt_tps"]["median"] for v in need)
    out["prompt_share"] = (pfn - pst) / (pnn - pst) if pnn > pst else None
    if gap <= 0:
        out["note"] = "nonorm is not faster than stock here: no headroom to share"
    elif not measurable:
        out["note"] = (
            f"nonorm is within noise of stock here ({st:.1f} -> {nn_:.1f} tok/s, "
            f"interquartile spread {noise:.1f}): no measurable headroom to share"
        )
    return out


# --- the benchmark -----------------------------------------------------------


def validate(variants: Sequence[str], prompt_tokens: int, gen_tokens: int, trials: int):
    for i, v in enumerate(variants):
        if v not in MODES:
            raise BenchError(
                f"--variants: unknown variant {v!r}; choose from {', '.join(MODES)}"
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


def _build_variants(source: Source, variants, built: dict, step):
    """{variant: model}, {variant: what was built (class, bytes, launches, ...)}."""
    for v in variants:  # import the model modules now, so build_s times only the build
        try:
            model_classes(source.config, "flashnorm" if v == "flashnorm" else "stock")
        except ImportError as e:
            raise BenchError(f"no {v} model for {source.config['model_type']}: {e}")
    models, info = {}, {}
    for v in variants:
        step(f"building {v}")
        t0 = time.perf_counter()
        model, config = build_model(source, v, **built)
        build_s = time.perf_counter() - t0
        cls = type(model)
        q = config.get("quantization")
        models[v] = model
        info[v] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "compiled": decode.is_compiled(model),
            "build_s": build_s,
            # Re-hashed after each build: every variant saw these exact weights.
            "source_checksum": weights_checksum(source.weights),
            "rms_norm_modules": len(rms_norm_paths(model)),
            "dtype": model_dtype(model),
            "quantization": (
                {k: q.get(k, "affine") for k in ("bits", "group_size", "mode")}
                if q
                else None
            ),
            "weight_bytes": weight_bytes(model),
            "decode_bytes_per_token": decode_bytes(model, config),
            **step_dispatches(model),
        }
    return models, info


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


def _summarize(info: dict, records: List[dict], variant: str) -> dict:
    rows = [t for t in records if t["variant"] == variant]
    decode = spread([t["decode_tps"] for t in rows])
    trial = spread([t["trial_memory_gb"] for t in rows])
    return {
        **info,
        "prompt_tps": spread([t["prompt_tps"] for t in rows]),
        "decode_tps": decode,
        "peak_memory_gb": spread([t["peak_memory_gb"] for t in rows]),
        "trial_memory_gb": trial,
        # What running this variant alone takes: its parameters plus the most
        # its trials added (the process's peak also holds the other variants).
        "variant_peak_gb": info["weight_bytes"] / 1e9 + trial["max"],
        "effective_gbps": decode["median"] * info["decode_bytes_per_token"] / 1e9,
        "all_trials_finite": all(t["last_logprobs_finite"] for t in rows),
    }


def _notes(device: dict, summary: dict) -> List[str]:
    """Lines under the table for what would otherwise mislead."""
    notes = []
    dtypes = {s["dtype"] for s in summary.values()}
    if device["backend"] == "cpu" and dtypes & {"float16", "bfloat16"}:
        notes.append(
            "MLX's CPU backend has no fast float16/bfloat16 matmul (6-16x slower "
            "than float32 on SmolLM2 here): pass --dtype float32 for CPU numbers"
        )
    if not dispatch.has_gpu_kernels():
        notes.append(
            "launches/token: on this build mx.fast ops decompose into several plain "
            "ops and FlashNorm kernels run as their plain twins, so the raw counts "
            "are not the GPU's; in parentheses the same step with each mx.fast op "
            "and FlashNorm kernel as one launch, as on Metal and CUDA"
        )
    compiled = [v for v, s in summary.items() if s["compiled"]]
    notes.append(
        "compiled decode step (one mx.compile'd function per shape; * in the "
        "table): "
        + (", ".join(compiled) if compiled else "none")
        + "; every other variant builds each step's graph op by op"
    )
    notes += kernels.failures()  # a kernel that fell back to its twin here
    if any(
        not s["logits_finite"] or not s["all_trials_finite"] for s in summary.values()
    ):
        notes.append(
            "a variant produced NaN/inf logits: its timings are not meaningful"
        )
    return notes


def run_bench(
    source: Source,
    variants: Sequence[str] = MODES,
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
    compile: Optional[bool] = None,
) -> dict:
    """Build every variant from `source`, warm each up, time `trials` rounds.

    Returns {"settings", "device", "versions", "source", "variants" (per-variant
    summary), "ratios" (to stock), "headroom", "trials" (every timed run)}.
    sampler: mlx-lm sampler (default greedy); generation never stops early.
    group: every variant tensor-parallel over it (each rank runs this, in step).
    compile: FlashNorm's decode steps compiled (None: with a GPU backend,
    `decode.default_on`; stock_compiled's always are).
    """
    variants = list(variants)
    validate(variants, prompt_tokens, gen_tokens, trials)
    step = _Steps(progress, len(variants) * (3 + trials))
    t0 = time.perf_counter()
    checksum = weights_checksum(source.weights)
    checksum_s = time.perf_counter() - t0
    prompt = mx.array(prompt_ids(source.config, prompt_tokens, seed))
    built = dict(
        dtype=dtype,
        quantize=quantize,
        quantized_way=quantized_way,
        group=group,
        compile=compile,
    )
    models, info = _build_variants(source, variants, built, step)
    distributed.barrier("building")  # a launch's ranks start timing together
    timing = dict(sampler=sampler, prefill_step_size=prefill_step_size)
    with distributed.watch("benchmarking"):  # each step kicks it
        first_steps = {}
        for v in variants:
            step(f"warm-up {v}")
            warm = warm_up(models[v], prompt, gen_tokens, timing)
            first_steps[v] = warm["first_steps_s"]
            info[v].update(check_logits(models[v], prompt.tolist() + warm["tokens"]))
        records = _timed_rounds(
            models, variants, prompt, gen_tokens, trials, timing, step
        )
        for v in variants:  # after the rounds, so it cannot disturb them
            step(f"host time {v}")
            info[v].update(step_times(models[v], prompt, min(gen_tokens, 32)))
            extra = [t * 1e3 - info[v]["host_build_ms"] for t in first_steps[v]]
            info[v]["compile_ms"] = sum(max(0.0, x) for x in extra)
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
        "compile": decode.default_on() if compile is None else compile,
    }
    src = {
        "name": source.name,
        "model_type": source.config.get("model_type"),
        "checksum": checksum,
        "checksum_algorithm": "blake2b-128 over sorted (name, dtype, shape, bytes)",
        "checksum_s": checksum_s,
        "quantized": quant.is_quantized(source.weights),
        **comparison(source, quantize, quantized_way),
    }
    return _report(settings, src, info, records)


def _report(settings: dict, src: dict, info: dict, records: List[dict]) -> dict:
    """run_bench's result from what was built (info) and timed (records)."""
    variants = settings["variants"]
    summary = {v: _summarize(info[v], records, v) for v in variants}
    ratios = {}
    if "stock" in variants:
        for v in variants:
            if v != "stock":
                ratios[v] = {
                    "decode": _ratios(records, v, "stock", "decode_tps"),
                    "prompt": _ratios(records, v, "stock", "prompt_tps"),
                }
    device = device_info()
    notes = {
        "decode_tps": "(G - 1) / time from the first generated token to the G-th",
        "decode_bytes": DECODE_BYTES_NOTE,
        "dispatches": DISPATCH_NOTE,
        "host": HOST_NOTE,
    }
    return {
        "notes": _notes(device, summary),
        "settings": {**settings, **notes},
        "device": device,
        "versions": versions(),
        "source": {k: v for k, v in src.items() if not k.startswith("comparison")},
        "comparison": src["comparison"],
        "comparison_note": src["comparison_note"],
        "variants": summary,
        "ratios": ratios,
        "headroom": _headroom(summary),
        "kernel_failures": kernels.failures(),
        "trials": records,
    }
