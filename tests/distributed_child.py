"""One rank of a tests/test_distributed.py launch.

`cases cases.json out.npz`: build every case sharded over the launch's group;
rank 0 saves what it computed. Each case: {"name", "model", "mode", optional
"quantize": [bits, group]}; saved per case: float32 logits of TOKENS (one
uncached forward) and GREEDY greedy tokens through mlx-lm's generate_step (the
KV-cache path). The parent compares them with one process on the same weights.

`die|hang ARGS...`: `flashnorm-mlx generate ARGS` where rank 1, after two tokens,
exits (status 0, so mlx.launch leaves rank 0 to notice) or stops answering;
rank 0 must end with one line, not hang.
"""

import json
import os
import sys
import time

import mlx.core as mx
import numpy as np

from flashnorm_mlx import distributed
from flashnorm_mlx.loading import build_model, read_source

TOKENS = [5, 17, 99, 3, 250, 42, 7, 7, 180, 64, 11, 2]
GREEDY = 12


def run_case(case: dict, group):
    from mlx_lm.generate import generate_step, generation_stream

    source = read_source(case["model"], need_tokenizer=False)
    quantize = tuple(case["quantize"]) if case.get("quantize") else None
    model, _ = build_model(
        source, case["mode"], dtype=mx.float32, quantize=quantize, group=group
    )
    # Evaluated now: collectives pair up by order, so this forward's all-sums
    # must not wait and meet the generation stream's in another order per rank.
    logits = model(mx.array(TOKENS)[None]).astype(mx.float32)
    mx.eval(logits)
    prompt = mx.array(TOKENS[:4])
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=GREEDY)]
    mx.synchronize(generation_stream)
    return np.array(logits), np.array(tokens)


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


def main():
    if sys.argv[1] in ("die", "hang"):
        sys.exit(faulty_generate(sys.argv[1], sys.argv[2:]))
    cases = json.loads(open(sys.argv[2]).read())
    launch = distributed.join()
    assert launch is not None and launch.size == 2, "expected 2 ranks"
    out = {}
    for case in cases:
        logits, tokens = run_case(case, launch.group)
        out[f"{case['name']}/logits"] = logits
        out[f"{case['name']}/tokens"] = tokens
    distributed.barrier("done")
    if launch.rank == 0:
        np.savez(sys.argv[3], **out)
    print(f"rank {launch.rank}: {len(cases)} cases", flush=True)


if __name__ == "__main__":
    main()
