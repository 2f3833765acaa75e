"""What structured output costs per token (README, docs/design.md section 5g):
greedy decoding of the embedded SmolLM2 with and without a JSON-schema
grammar processor, each timed per decode step (the replies differ, but each
step is one forward pass, plus, constrained, the processor: the matcher's
advance, its mask and the masked logits), and the processor's own time per
call inside the constrained run (the forward pass evaluated before its timer
starts, which also takes away mlx-lm's overlap of one step with the next).

    PYTHONPATH=. python scripts/structured-overhead.py [--tokens 48] [--rounds 3]
"""

import argparse
import time

import mlx.core as mx


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from mlx_lm.generate import generate_step

    from flashnorm_mlx import load
    from flashnorm_mlx.grammar import Grammars, json_grammar

    model, tok = load()
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["id", "name", "tags"],
        "additionalProperties": False,
    }
    msgs = [{"role": "user", "content": "Describe a cat as JSON: an id, a name, tags."}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
    grammars = Grammars(tok)
    grammar = json_grammar(schema)
    grammars.processor(grammar)  # builds llguidance's tokenizer once

    def run(processors):
        steps = generate_step(
            mx.array(prompt),
            model,
            max_tokens=args.tokens,
            logits_processors=processors,
        )
        n, t0 = 0, None
        for token, _ in steps:
            if t0 is None:  # time decode steps only, from the first token on
                t0 = time.perf_counter()
            n += 1
        return (time.perf_counter() - t0) / max(n - 1, 1), n

    # The processor alone: every call after the first, on the tokens it allowed.
    rows = []
    for _ in range(args.rounds):
        plain, n0 = run(None)
        p = grammars.processor(grammar)
        calls = []

        def timed(tokens, logits):
            mx.eval(tokens, logits)  # the forward pass, outside the timer
            t = time.perf_counter()
            out = p(tokens, logits)
            mx.eval(out)
            calls.append(time.perf_counter() - t)
            return out

        constrained, n1 = run([timed])
        rows.append((plain, constrained, sum(calls[1:]) / max(len(calls) - 1, 1)))
        print(
            f"plain {plain * 1e3:.1f} ms/token ({n0} tokens), constrained "
            f"{constrained * 1e3:.1f} ms/token ({n1} tokens), processor "
            f"{rows[-1][2] * 1e3:.2f} ms/call"
        )
    best = [min(r[i] for r in rows) for i in range(3)]
    print(
        f"best of {args.rounds}: plain {best[0] * 1e3:.1f} ms/token, constrained "
        f"{best[1] * 1e3:.1f} ms/token, processor {best[2] * 1e3:.2f} ms/token"
    )


if __name__ == "__main__":
    main()
