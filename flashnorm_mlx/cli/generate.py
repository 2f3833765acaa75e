"""`flashnorm-mlx generate [MODEL] -p PROMPT`: one streamed completion."""

import argparse
import sys

from .flags import (
    Parser,
    add_draft_args,
    add_kv_cache_args,
    add_model_args,
    add_sampling_args,
    run_main,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx generate",
        description="Generate one completion; prints tokens/sec and peak memory after it.",
    )
    add_model_args(p)
    p.add_argument(
        "-p", "--prompt", default="Hello", help="prompt text ('-' reads stdin)"
    )
    add_sampling_args(p, max_tokens=100)
    p.add_argument(
        "--system-prompt", default=None, help="system message for the chat template"
    )
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="feed the prompt as raw text",
    )
    add_draft_args(p)
    add_kv_cache_args(p)
    return p


def build_prompt(tokenizer, prompt: str, system_prompt=None, raw: bool = False) -> list:
    """Token ids for a user prompt, through the chat template when the model has one."""
    if not raw and getattr(tokenizer, "chat_template", None):
        messages = (
            [{"role": "system", "content": system_prompt}] if system_prompt else []
        )
        messages.append({"role": "user", "content": prompt})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


@run_main
def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    prompt = (
        sys.stdin.read() if args.prompt == "-" else args.prompt.replace("\\n", "\n")
    )
    if not prompt.strip():  # the model would answer an empty message
        parser.error("-p/--prompt is empty (-p TEXT, or -p - to read stdin)")
    # MLX and mlx-lm (seconds) once the flags are good.
    from mlx_lm import stream_generate

    from ..parallel import distributed
    from .common import load_for_sampling, make_sampler
    from .decoding import draft_model, draft_tally, generation_kwargs

    source, tokenizer, model, config = load_for_sampling(args)
    draft = draft_model(args, tokenizer, source.name)
    kwargs = generation_kwargs(args, model, draft, config, source.name)
    tally = draft_tally(args, args.max_tokens)

    ids = build_prompt(tokenizer, prompt, args.system_prompt, args.ignore_chat_template)
    sampler = make_sampler(args, tokenizer)
    last = None
    responses = stream_generate(
        model, tokenizer, ids, max_tokens=args.max_tokens, sampler=sampler, **kwargs
    )
    for last in distributed.watched(responses, "generating"):
        print(last.text, end="", flush=True)
        if tally is not None:
            tally.add(last.from_draft)
    print()
    print("=" * 10)
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
    print(
        f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec"
    )
    if tally is not None:
        print(tally.line())
    print(f"Peak memory: {last.peak_memory:.3f} GB")
    return 0
