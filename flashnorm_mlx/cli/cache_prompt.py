"""`flashnorm-mlx cache-prompt [MODEL] -p PROMPT -o FILE`: a prompt's KV cache
saved for `generate --prompt-cache-file` (mlx-lm's cache_prompt; prompt_cache.py)."""

import argparse
import json
import os
import sys
from pathlib import Path

from .flags import Parser, add_model_args, run_main
from .mlx_lm_flags import (
    add_adapter_args,
    add_eos_token_arg,
    add_kv_cache_args,
    add_trust_remote_code_arg,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx cache-prompt",
        description="Cache the state of a prompt to be reused with "
        "`flashnorm-mlx generate --prompt-cache-file` (and chat); the file "
        "records the model, mode and weights it was made with.",
    )
    add_model_args(p)
    add_adapter_args(p)
    add_trust_remote_code_arg(p)
    p.add_argument(
        "-p",
        "--prompt",
        required=True,
        help="Message to be processed by the model ('-' reads from stdin)",
    )
    p.add_argument(
        "-o",
        "--prompt-cache-file",
        required=True,
        help="The file to save the prompt cache in (a .safetensors file)",
    )
    p.add_argument(
        "--system-prompt",
        default=None,
        help="a system message before the prompt: chat --prompt-cache-file with "
        "the same --system-prompt reuses it",
    )
    p.add_argument(
        "--force", action="store_true", help="replace an existing prompt-cache file"
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="Number of prompt tokens to process at a time",
    )
    add_eos_token_arg(p)
    add_kv_cache_args(p)  # the saved cache as generate would hold it
    return p


@run_main
def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    out = Path(args.prompt_cache_file).expanduser()
    if not out.parent.is_dir():
        parser.error(f"-o/--prompt-cache-file: no such folder: {out.parent}")
    if out.is_dir() or (out.exists() and not args.force):
        parser.error(f"{out} exists (--force replaces a file)")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        parser.error("-p/--prompt is empty (-p TEXT, or -p - to read stdin)")
    # MLX and mlx-lm (seconds) once the flags are good.
    from .. import prompt_cache
    from ..chat_template import cache_prompt_ids
    from ..decode_options import KVOptions, check_kv_options
    from .common import build, read_model

    # One process: a tensor-parallel rank's cache holds its shard's heads alone
    # (build refuses a multi-rank launch).
    source, tokenizer, mode = read_model(args)
    tokenizer_config = prompt_cache.tokenizer_config(args.eos_token)
    prompt_cache.apply_tokenizer_config(tokenizer_config, tokenizer, source.name)
    model, config = build(source, mode, args)
    kv = KVOptions.from_args(args)
    check_kv_options(kv, model, config, source.name)
    ids = cache_prompt_ids(tokenizer, prompt, args.system_prompt)
    meta = prompt_cache.identity(args.model, mode, model, args.adapter_path)
    meta["tokenizer_config"] = json.dumps(tokenizer_config)
    n = prompt_cache.save(out, model, ids, meta, args.prefill_step_size, kv)
    size = os.path.getsize(out)
    print(f"Wrote {out}: {n} prompt tokens cached ({mode}), {size / 1e6:.2f} MB")
    return 0
