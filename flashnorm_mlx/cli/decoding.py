"""The speculative decoding and KV cache flags (cli/flags.py's
`add_draft_args`, `add_kv_cache_args`) made into what generate, chat and serve
run with (docs/design.md section 3f; serve's worker choice is cli/serve.py's:
the shared CLI imports no command's library). Imports MLX."""

from .. import models
from ..decode_options import (
    DraftTally,
    KVOptions,
    check_kv_options,
    load_draft,
    make_cache,
)
from ..errors import UserError
from ..parallel import distributed
from .common import build, say_note


def draft_model(args, tokenizer, name: str, mode):
    """The --draft-model, built like the model (its Mode `mode`; the same
    dtype, quantization and engine flags), or None."""
    if not getattr(args, "draft_model", None):
        return None
    if distributed.current() is not None:  # untried sharded; mlx_lm.server refuses it
        raise UserError("--draft-model: not under mlx.launch with several ranks")

    def build_draft(source):
        if not models.is_covered(source.config):  # stock, whatever the model's mode
            say_note(f"--draft-model: {models.stock_note(source.config)}")
        return build(source, models.run_mode(source.config, mode, or_stock=True), args)

    return load_draft(args.draft_model, tokenizer, name, build_draft)


def generation_kwargs(args, model, draft, config: dict, name: str) -> dict:
    """stream_generate's keyword arguments for the flags: a prompt cache made
    here (the draft's layers after the model's, as mlx-lm lays them out) and
    mlx-lm's KV quantization settings."""
    kv = KVOptions.from_args(args)
    check_kv_options(kv, model, config, name)
    cache = make_cache(model, kv.max_kv_size)
    kwargs = dict(prompt_cache=cache, **kv.quantize_kwargs())
    if draft is not None:
        cache += make_cache(draft)
        kwargs.update(draft_model=draft, num_draft_tokens=args.num_draft_tokens)
    return kwargs


def draft_tally(args, max_tokens: int):
    """A DraftTally where a draft runs, else None."""
    if not getattr(args, "draft_model", None):
        return None
    return DraftTally(args.num_draft_tokens, max_tokens)
