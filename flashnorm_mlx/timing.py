"""Timing one generation, as every command that measures speed does it.

Timing follows mlx-lm's `stream_generate`: prompt time runs until the first
token is known (prefill + one sample); decode time runs from the first token to
the G-th, which is G - 1 decode steps (mlx-lm divides G by that same interval,
so its decode numbers read G / (G - 1) higher). Host time per step (build and
eval apart) and the statistics of interleaved rounds live here too: bench and
chat's /compare share them.
"""

import statistics
import time
from typing import Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn


def time_generation(
    model: nn.Module,
    prompt: mx.array,
    gen_tokens: int,
    sampler=None,
    prefill_step_size: int = 2048,
    prompt_cache=None,
) -> dict:
    """Exactly `gen_tokens` tokens through mlx-lm's generate_step, timed
    (`prompt_cache`: continue a cache that already holds the tokens before
    `prompt`)."""
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
            prompt_cache=prompt_cache,
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
    "pass's medians of build plus eval (a compiled engine's eager first step "
    "and its trace)"
)


def _steps(model: nn.Module, prompt: mx.array, steps: int):
    """(build, eval) seconds of `steps` greedy decode steps after `prompt`, each
    evaluated before the next is built."""
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
    return build, run


def step_times(model: nn.Module, prompt: mx.array, steps: int) -> dict:
    """Medians of host build and eval over `steps` decode steps (section 4c:
    build and eval apart)."""
    build, run = _steps(model, prompt, steps)
    return {
        "host_build_ms": 1e3 * statistics.median(build),
        "eval_ms": 1e3 * statistics.median(run),
    }


HOST_STEPS = 32  # decode steps of bench's host-time pass (after the rounds)


def passes_left(n, trials, gen_tokens, warm, gen_s, done_s) -> float:
    """Seconds of bench's passes left after the first of `n` variants warmed
    up (done_s: its first steps, a generation of gen_s, the logits check):
    the other warm-ups, the timed rounds, and each variant's host-time pass
    (a prefill and up to HOST_STEPS decode steps, priced from the
    generation's own prompt and decode times; `warm`: time_generation's)."""
    tps = warm["decode_tps"]
    step_s = 1 / tps if tps == tps and tps > 0 else warm["decode_s"]
    host_s = warm["prompt_s"] + min(gen_tokens, HOST_STEPS) * step_s
    return (n - 1) * done_s + trials * n * gen_s + n * host_s


def first_steps(model: nn.Module, prompt: mx.array, steps: int = 3) -> List[float]:
    """Seconds (build + eval) of a fresh model's first decode steps: where a
    compiled engine runs a shape eagerly once and then traces it."""
    build, run = _steps(model, prompt, steps)
    return [b + r for b, r in zip(build, run)]


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


# Fewer interleaved rounds give no spread worth the name: no verdict
# (bench -n 1 once showed 0.37x where 3 rounds said 1.00x, within noise).
MIN_ROUNDS = 3


def round_ratios(trials: List[dict], variant: str, base: str, key: str) -> dict:
    """`variant` over `base` in `key`, per interleaved round: the median of those
    ratios, their spread (min, max) and whether it includes 1.0 or comes from
    under MIN_ROUNDS rounds (`within_noise`: no verdict, faster or slower), and
    the ratio of the medians."""
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
        "min": min(per_round),
        "max": max(per_round),
        "within_noise": len(per_round) < MIN_ROUNDS
        or min(per_round) <= 1.0 <= max(per_round),
        "ratio_of_medians": med_v / med_b,
        "rounds_faster": sum(x > 1.0 for x in per_round),
        "rounds": len(per_round),
    }


def compare_decode_speed(
    models: Dict[str, object], prompt_ids: List[int], n_tokens: int, sampler=None
) -> Dict[str, dict]:
    """Regenerate `n_tokens` (end-of-sequence ignored) from `prompt_ids` on each
    model, each after a short untimed warm-up, timed as `bench` times a trial:
    {name: time_generation(...)}. Same prompt, count and sampler for all."""
    prompt = mx.array(prompt_ids)
    out = {}
    for name, model in models.items():
        time_generation(model, prompt[-8:], 2, sampler)  # compile, first-call costs
        out[name] = time_generation(model, prompt, n_tokens, sampler)
    return out
