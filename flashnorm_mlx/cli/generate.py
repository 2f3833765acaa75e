"""`flashnorm-mlx generate [MODEL] -p PROMPT`: one streamed completion."""

import argparse
import sys

from .flags import Parser, add_model_args, run_main
from .mlx_lm_flags import (
    add_generation_args,
    add_refused_args,
    add_sampling_args,
    add_template_args,
    add_verbose_arg,
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
    add_generation_args(p)
    add_refused_args(p)
    add_template_args(p)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="the reply is JSON that fits this JSON schema (llguidance)",
    )
    fmt.add_argument(
        "--json", action="store_true", help="the reply is a JSON object (llguidance)"
    )
    add_verbose_arg(p)
    return p


def _json_grammar(args):
    """The grammar --json-schema or --json asks for (None: neither); a bad or
    uncompilable schema is one line and exit 1, before the model loads."""
    import json

    from ..errors import UserError
    from ..grammar import GrammarError, json_grammar

    if args.json_schema is None and not args.json:
        return None
    schema = None
    if args.json_schema is not None:
        try:
            with open(args.json_schema) as f:
                schema = json.load(f)
        except (OSError, ValueError) as e:
            raise UserError(f"--json-schema {args.json_schema}: {e}") from None
    try:
        return json_grammar(schema)
    except GrammarError as e:
        raise UserError(f"--json-schema {args.json_schema}: {e}") from None


@run_main
def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    prompt = _checked_prompt(parser, args)
    # MLX and mlx-lm (seconds) once the flags are good.
    from mlx_lm import stream_generate

    from .. import prompt_cache
    from ..chat_template import prompt_ids, set_template
    from ..parallel import distributed
    from .common import (
        build_for_sampling,
        make_sampler,
        read_for_sampling,
        seed_sampling,
    )
    from .decoding import draft_model, draft_tally, generation_kwargs

    grammar = _json_grammar(args)
    cache = None
    source, tokenizer, mode = read_for_sampling(args)  # --mode settled, once
    if args.prompt_cache_file is not None:  # a bad file: one line before the build
        cache, meta = prompt_cache.read(
            args.prompt_cache_file, args.model, mode, args.adapter_path
        )
    model, config = build_for_sampling(args, source, mode)
    if cache is not None:
        prompt_cache.fit(args.prompt_cache_file, cache, meta, model, mode)
        prompt_cache.check_kv_flags(
            args.prompt_cache_file, cache, args.kv_bits, args.kv_group_size
        )
        prompt_cache.use_file_tokenizer(args.prompt_cache_file, meta, tokenizer)
    draft = draft_model(args, tokenizer, source.name, mode)
    seed_sampling(args, source)  # after every build, as mlx-lm draws
    kwargs = generation_kwargs(args, model, draft, config, source.name)
    if cache is not None:  # the file's cache in place of a new one, as mlx-lm
        kwargs["prompt_cache"] = cache
    tally = draft_tally(args, args.max_tokens)
    set_template(
        tokenizer,
        use_default=args.use_default_chat_template,
        extra_eos=args.extra_eos_token,
    )
    ids = prompt_ids(
        tokenizer,
        prompt,
        args.system_prompt,
        args.ignore_chat_template,
        args.prefill_response,
        args.chat_template_config,
        cached=cache is not None,
    )
    sampler = make_sampler(args, tokenizer)
    if grammar is not None:  # the mask after any other processor (grammar.py)
        mask = _grammar_mask(args, tokenizer, grammar)
        kwargs["logits_processors"] = (kwargs.get("logits_processors") or []) + [mask]
    last = None
    responses = stream_generate(
        model,
        tokenizer,
        ids,
        max_tokens=args.max_tokens,
        sampler=sampler,
        prefill_step_size=args.prefill_step_size,
        **kwargs,
    )
    for last in distributed.watched(responses, "generating"):
        print(last.text, end="", flush=True)
        if tally is not None:
            tally.add(last.from_draft)
    print()
    if args.verbose:  # mlx-lm's --verbose False: the reply alone
        _print_stats(last, tally)
    return 0


def _checked_prompt(parser, args) -> str:
    """-p's text (-p -: stdin; a typed \\n a newline), refused where empty;
    flags that cannot go together refused before the model loads."""
    prompt = (
        sys.stdin.read() if args.prompt == "-" else args.prompt.replace("\\n", "\n")
    )
    if not prompt.strip():  # the model would answer an empty message
        parser.error("-p/--prompt is empty (-p TEXT, or -p - to read stdin)")
    if args.prompt_cache_file is not None and args.draft_model:
        # The file holds the model's layers only; the draft would start empty.
        parser.error("--prompt-cache-file and --draft-model cannot be used together")
    return prompt


def _grammar_mask(args, tokenizer, grammar: str):
    """The logits processor that holds the reply to --json/--json-schema."""
    from ..errors import UserError
    from ..grammar import GrammarError, Grammars

    try:
        return Grammars(tokenizer).processor(grammar, args.max_tokens)
    except GrammarError as e:
        raise UserError(f"--json-schema {args.json_schema}: {e}") from None


def _print_stats(last, tally) -> None:
    """mlx-lm's --verbose lines after the reply (and the draft's tally)."""
    print("=" * 10)
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
    print(
        f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec"
    )
    if tally is not None:
        print(tally.line())
    print(f"Peak memory: {last.peak_memory:.3f} GB")
