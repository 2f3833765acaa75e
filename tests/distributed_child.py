"""One rank of a tests/test_distributed.py launch.

`cases SIZE cases.json out.npz`: build every case sharded over the launch's
group (SIZE ranks); rank 0 saves what it computed. Each case: {"name",
"model" (None: the embedded SmolLM2), "mode" (a modes.MODES name), optional "quantize": [bits,
group], optional "layers": the model's first blocks only}; saved per case: float32 logits of the prompt TOKENS and of DECODE
greedy steps through the KV cache, and those greedy tokens. The parent
compares them with one process on the same weights.

`die|hang ARGS...`: `flashnorm-mlx generate ARGS` where rank 1, after two tokens,
exits (status 0, so mlx.launch leaves rank 0 to notice) or stops answering;
rank 0 must end with one line, not hang. `fail-load ARGS...`: rank 1 alone
fails to read the model; its line must be the only one.
"""

import dataclasses
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import MODES
from flashnorm_mlx.parallel import distributed

TOKENS = [5, 17, 99, 3, 250, 42, 7, 7, 180, 64, 11, 2]
DECODE = 8  # cached steps: each the same sharded path; a launch spins on 2 cores


def run_case(case: dict, group):
    """(logits (len(TOKENS) + DECODE, vocab) float32, greedy tokens (DECODE,)):
    the prompt in one cached forward, then DECODE greedy steps, each evaluated
    before the next (collectives pair up by order on every rank)."""
    from mlx_lm.models.cache import make_prompt_cache

    source = read_source(case["model"], need_tokenizer=False)
    if case.get("layers"):
        source = first_layers(source, case["layers"])
    quantize = tuple(case["quantize"]) if case.get("quantize") else None
    model, _ = build_model(
        source, MODES[case["mode"]], dtype=mx.float32, quantize=quantize, group=group
    )
    cache = make_prompt_cache(model)
    out = model(mx.array(TOKENS)[None], cache=cache)[0].astype(mx.float32)
    mx.eval(out)
    rows, tokens = [np.array(out)], []
    for _ in range(DECODE):
        tokens.append(int(np.argmax(rows[-1][-1])))
        out = model(mx.array([[tokens[-1]]]), cache=cache)[0].astype(mx.float32)
        mx.eval(out)
        rows.append(np.array(out))
    return np.concatenate(rows), np.array(tokens)


def first_layers(source, n: int):
    """A Llama-layout source cut to its first `n` blocks, their weights as stored."""
    cut = [f"model.layers.{i}." for i in range(n, source.config["num_hidden_layers"])]
    weights = {k: v for k, v in source.weights.items() if not k.startswith(tuple(cut))}
    config = dict(source.config, num_hidden_layers=n)
    return dataclasses.replace(source, config=config, weights=weights, folder=None)


def faulty_generate(fault: str, argv):
    import mlx_lm

    from flashnorm_mlx.cli import generate

    stream = mlx_lm.stream_generate

    def rank1_fails(*args, **kwargs):
        for i, response in enumerate(stream(*args, **kwargs)):
            if i == 2 and distributed.current().rank == 1:
                if fault == "die":
                    os._exit(0)
                time.sleep(600)
            yield response

    mlx_lm.stream_generate = rank1_fails
    return generate.main(argv)


def rank1_cannot_load(argv):
    """`flashnorm-mlx generate ARGS` where rank 1 alone fails to read MODEL."""
    from flashnorm_mlx.cli import common, generate
    from flashnorm_mlx.errors import LoadError

    read = common.read_source

    def read_source(*args, **kwargs):
        if distributed.current().rank == 1:
            raise LoadError("test: rank 1 cannot read the model")
        return read(*args, **kwargs)

    common.read_source = read_source
    return generate.main(argv)


def main():
    if sys.argv[1] in ("die", "hang"):
        sys.exit(faulty_generate(sys.argv[1], sys.argv[2:]))
    if sys.argv[1] == "fail-load":
        sys.exit(rank1_cannot_load(sys.argv[2:]))
    size, cases = int(sys.argv[2]), json.loads(open(sys.argv[3]).read())
    launch = distributed.join()
    assert launch is not None and launch.size == size, f"expected {size} ranks"
    out, seconds = {}, {}
    for case in cases:
        t0 = time.perf_counter()
        logits, tokens = run_case(case, launch.group)
        out[f"{case['name']}/logits"] = logits
        out[f"{case['name']}/tokens"] = tokens
        seconds[case["name"]] = round(time.perf_counter() - t0, 2)
    distributed.barrier("done")
    if launch.rank == 0:
        np.savez(sys.argv[4], **out)
        print(f"{size} ranks, seconds per case: {json.dumps(seconds)}", flush=True)


if __name__ == "__main__":
    main()
