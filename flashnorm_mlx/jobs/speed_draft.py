"""`bench --draft-model D`: the model alone against the model with a draft
(speculative decoding), same prompt and token count, rounds interleaved
(docs/design.md section 3f).

Speculative decoding pays off only when the draft is cheap and its tokens are
accepted often; a draft too slow or too wrong makes decoding slower, so it is
measured, never assumed. Both are FlashNorm models on the engine asked for
(stock, mlx-lm's class, for a family FlashNorm does not cover);
the alone rows are timed as bench times every variant (`time_generation`),
the draft rows the same way over mlx-lm's `speculative_generate_step`, with
end-of-sequence ignored, greedy.
"""

import statistics
import time
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..decode_options import DraftTally, check_same_vocabulary
from ..errors import UserError
from ..loading import Source, build_model, read_source
from ..models import run_mode
from ..timing import spread, time_generation


def time_speculative(
    model, draft, prompt: mx.array, gen_tokens: int, k: int, prefill_step_size: int
) -> dict:
    """Exactly `gen_tokens` tokens through mlx-lm's speculative_generate_step,
    timed as `time_generation` times generate_step."""
    from mlx_lm.generate import generation_stream, speculative_generate_step

    mx.synchronize()
    tally = DraftTally(k, gen_tokens)
    tokens: List[int] = []
    tic = time.perf_counter()
    t_first = t_last = tic
    steps = speculative_generate_step(
        prompt,
        model,
        draft,
        num_draft_tokens=k,
        max_tokens=gen_tokens,
        prefill_step_size=prefill_step_size,
    )
    for token, _, from_draft in steps:
        t_last = time.perf_counter()
        if not tokens:
            t_first = t_last
        tokens.append(int(token))
        tally.add(from_draft)
    mx.synchronize(generation_stream)
    accepted, proposed, rounds = tally.counts()
    decode_s = t_last - t_first
    return {
        "prompt_s": t_first - tic,
        "decode_s": decode_s,
        "decode_tps": (len(tokens) - 1) / decode_s if decode_s > 0 else float("nan"),
        "generated_tokens": len(tokens),
        "accepted": accepted,
        "proposed": proposed,
        "steps": rounds,
        "tokens": tokens,
    }


def _vocabulary(source: Source, draft: Source, config: dict, draft_config: dict):
    """The draft's tokens must be the model's (one line where they are not)."""
    if source.tokenizer is not None and draft.tokenizer is not None:
        check_same_vocabulary(
            source.tokenizer, draft.tokenizer, source.name, draft.name
        )
    elif config.get("vocab_size") != draft_config.get("vocab_size"):
        raise UserError(
            f"--draft-model {draft.name} has another vocabulary size than "
            f"{source.name}: a draft must share the model's tokenizer"
        )


def run_draft_bench(
    source: Source,
    draft_path: str,
    prompt_tokens: int,
    gen_tokens: int,
    trials: int,
    num_draft_tokens: int = 3,
    seed: int = 0,
    prefill_step_size: int = 2048,
    progress=None,
    **kwargs,
) -> dict:
    """Decode tok/s of the model alone and with the draft, per round and as
    medians, the acceptance rate, and whether both gave the same tokens.
    kwargs: `build_model`'s (dtype, quantize, quantized_way, engine)."""
    say = progress or (lambda what: None)
    draft_source = read_source(draft_path, need_tokenizer=False)
    _vocabulary(source, draft_source, source.config, draft_source.config)
    say("building the model")
    # FlashNorm where it covers the family, stock (mlx-lm's class) where not.
    model, config = build_model(source, run_mode(source.config, None), **kwargs)
    say("building the draft")
    draft, _ = build_model(draft_source, run_mode(draft_source.config, None), **kwargs)
    # Random ids, as bench's rows take them (speed.prompt_ids).
    vocab = config.get("vocab_size") or 32000
    prompt = mx.array(
        np.random.default_rng(seed).integers(0, vocab, prompt_tokens).tolist()
    )
    k = num_draft_tokens
    say("warming up")  # every shape once: compiled steps, first-use checks
    time_generation(model, prompt, min(gen_tokens, 8), None, prefill_step_size)
    time_speculative(model, draft, prompt, min(gen_tokens, 8), k, prefill_step_size)
    rounds = []
    for i in range(trials):
        say(f"round {i + 1}/{trials}")
        alone = time_generation(model, prompt, gen_tokens, None, prefill_step_size)
        drafted = time_speculative(
            model, draft, prompt, gen_tokens, k, prefill_step_size
        )
        rounds.append({"alone": alone, "draft": drafted})
    return _report(source.name, draft_source.name, prompt_tokens, gen_tokens, k, rounds)


def _report(name, draft_name, prompt_tokens, gen_tokens, k, rounds) -> dict:
    alone = [r["alone"]["decode_tps"] for r in rounds]
    drafted = [r["draft"]["decode_tps"] for r in rounds]
    accepted = sum(r["draft"]["accepted"] for r in rounds)
    proposed = sum(r["draft"]["proposed"] for r in rounds)
    steps = sum(r["draft"]["steps"] for r in rounds)
    return {
        "model": name,
        "draft_model": draft_name,
        "settings": {
            "prompt_tokens": prompt_tokens,
            "generation_tokens": gen_tokens,
            "num_draft_tokens": k,
            "trials": len(rounds),
        },
        "alone_decode_tps": spread(alone),
        "draft_decode_tps": spread(drafted),
        "speedup": statistics.median(d / a for d, a in zip(drafted, alone)),
        "accepted": accepted,
        "proposed": proposed,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "accepted_per_step": accepted / steps if steps else 0.0,
        "same_tokens": all(
            r["alone"]["tokens"] == r["draft"]["tokens"] for r in rounds
        ),
        "rounds": [
            {side: {k: v for k, v in r[side].items() if k != "tokens"} for side in r}
            for r in rounds
        ],
    }


def lines(result: dict) -> List[str]:
    """The report as the command prints it."""
    s = result["settings"]
    a, d = result["alone_decode_tps"], result["draft_decode_tps"]
    return [
        f"{result['model']} alone against with draft {result['draft_model']} "
        f"({s['prompt_tokens']}-token prompt, {s['generation_tokens']} tokens, "
        f"{s['num_draft_tokens']} drafted per step, {s['trials']} rounds, greedy, "
        "end-of-sequence ignored)",
        f"alone:      {a['median']:.1f} decode tok/s (min {a['min']:.1f}, max "
        f"{a['max']:.1f})",
        f"with draft: {d['median']:.1f} decode tok/s (min {d['min']:.1f}, max "
        f"{d['max']:.1f}): {result['speedup']:.2f}x alone (median of rounds)",
        f"draft tokens accepted: {result['accepted']}/{result['proposed']} "
        f"({100 * result['acceptance_rate']:.1f}%), "
        f"{result['accepted_per_step']:.2f} per step",
        "same tokens with and without the draft: "
        + ("yes" if result["same_tokens"] else "NO (a float near-tie?)"),
    ]


def check(trials: int, gen_tokens: int, prompt_tokens: int) -> Optional[str]:
    """What is wrong with the numbers, or None."""
    if trials < 1:
        return f"-n/--num-trials must be at least 1 (got {trials})"
    if prompt_tokens < 1:
        return f"-p/--prompt-tokens must be at least 1 (got {prompt_tokens})"
    if gen_tokens < 2:
        return f"-g/--generation-tokens must be at least 2 (got {gen_tokens})"
    return None
