"""Speculative decoding and KV cache options, as mlx-lm runs them: mlx-lm's own
pieces handed their arguments, and ours only where it falls short (the
--max-kv-size cache), the one-line checks and the draft tally
(docs/design.md section 3f).
"""

from dataclasses import dataclass, field
from typing import List, Optional

from .errors import UserError

KV_KEEP = 4  # first tokens a rotating cache keeps, as mlx-lm's make_prompt_cache


@dataclass
class KVOptions:
    """mlx-lm's KV cache settings (its generate's flags, its defaults)."""

    max_kv_size: Optional[int] = None
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000

    @classmethod
    def from_args(cls, args) -> "KVOptions":
        return cls(
            max_kv_size=getattr(args, "max_kv_size", None),
            kv_bits=getattr(args, "kv_bits", None),
            kv_group_size=getattr(args, "kv_group_size", 64),
            quantized_kv_start=getattr(args, "quantized_kv_start", 5000),
        )

    @property
    def plain(self) -> bool:
        """No option set: mlx-lm's default caches."""
        return self.max_kv_size is None and self.kv_bits is None

    def quantize_kwargs(self) -> dict:
        """What `stream_generate` / `generate_step` pass on to
        `maybe_quantize_kv_cache`."""
        return dict(
            kv_bits=self.kv_bits,
            kv_group_size=self.kv_group_size,
            quantized_kv_start=self.quantized_kv_start,
        )


def make_cache(model, max_kv_size: Optional[int] = None) -> list:
    """mlx-lm's `make_prompt_cache(model)`, each full-attention layer's
    `KVCache` made a `RotatingKVCache(max_kv_size, keep=4)` where a size is
    given (sliding-window layers keep their own rotating caches): what
    `make_prompt_cache(model, max_kv_size)` gives a class without `make_cache`,
    for every class alike, ours and mlx-lm's."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    if max_kv_size is None:
        return cache
    return [
        RotatingKVCache(max_size=max_kv_size, keep=KV_KEEP) if type(c) is KVCache else c
        for c in cache
    ]


def head_dims(config: dict) -> List[int]:
    """The attention head width a checkpoint's config names, [] where unknown."""
    if config.get("head_dim"):
        return [int(config["head_dim"])]
    heads, width = config.get("num_attention_heads"), config.get("hidden_size")
    # Another family's config may name them otherwise (GPT-2's n_head, n_embd).
    return [width // heads] if isinstance(heads, int) and isinstance(width, int) else []


def check_kv_options(kv: KVOptions, model, config: dict, name: str) -> None:
    """One line for quantized KV settings the model cannot take: quantization
    groups run along the head dimension, which the group size must divide, and
    mlx-lm quantizes no rotating cache (sliding-window layers)."""
    from mlx_lm.models.cache import RotatingKVCache

    if kv.kv_bits is None:
        return
    if any(isinstance(c, RotatingKVCache) for c in make_cache(model)):
        raise UserError(
            f"--kv-bits: {name} has sliding-window layers, whose rotating KV "
            "caches mlx-lm cannot quantize"
        )
    for h in head_dims(config):
        if h % kv.kv_group_size:
            raise UserError(
                f"--kv-group-size {kv.kv_group_size} does not divide {name}'s head "
                f"dim {h}: KV quantization groups run along it (try 32)"
            )


def check_same_vocabulary(tokenizer, draft_tokenizer, name: str, draft: str) -> None:
    """A draft proposes token ids the target checks: both must mean the same
    tokens. mlx-lm compares the vocabulary sizes; the whole map is compared here
    too (same size, other tokens is another vocabulary all the same)."""
    ours, theirs = tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if len(ours) != len(theirs) or ours != theirs:
        raise UserError(
            f"--draft-model {draft} has another vocabulary than {name} "
            f"({len(theirs)} tokens against {len(ours)}, or other tokens): a "
            "draft must share the model's tokenizer"
        )


@dataclass
class DraftTally:
    """Accepted draft tokens of one generation, from mlx-lm's `from_draft`
    flags in order (the end-of-sequence token's included).

    mlx-lm's `speculative_generate_step` proposes `min(k, tokens left)` drafts
    per step, yields the accepted ones (`from_draft`) and then the target's
    own token, unless the limit came first; `steps()` replays that."""

    num_draft_tokens: int
    max_tokens: int
    flags: List[bool] = field(default_factory=list)

    def add(self, from_draft: bool) -> None:
        self.flags.append(bool(from_draft))

    def counts(self):
        """(accepted, proposed, steps)."""
        k, limit = self.num_draft_tokens, self.max_tokens
        i = made = accepted = proposed = steps = 0
        while i < len(self.flags):
            n = min(limit - made, k)
            proposed, steps = proposed + n, steps + 1
            taken = 0
            while taken < n and i < len(self.flags) and self.flags[i]:
                taken, i, made = taken + 1, i + 1, made + 1
            accepted += taken
            if made < limit and i < len(self.flags):  # the target's own token
                if self.flags[i]:  # not mlx-lm's order: the replay is wrong
                    raise ValueError("from_draft flags out of mlx-lm's order")
                i, made = i + 1, made + 1
        return accepted, proposed, steps

    def short(self) -> str:
        """For chat's stats line."""
        accepted, proposed, steps = self.counts()
        per_step = accepted / steps if steps else 0.0
        return f"draft {accepted}/{proposed} accepted, {per_step:.2f} per step"

    def line(self) -> str:
        accepted, proposed, steps = self.counts()
        rate = 100 * accepted / proposed if proposed else 0.0
        per_step = accepted / steps if steps else 0.0
        return (
            f"Draft: {accepted}/{proposed} draft tokens accepted ({rate:.1f}%), "
            f"{per_step:.2f} per step of {self.num_draft_tokens} drafted"
        )


def after_prefix(prefix, processor):
    """A logits processor that sees `prefix` (an mx.array of the tokens a kept
    cache already holds) before the tokens it is given, as when mlx-lm
    prefills the whole prompt."""
    import mlx.core as mx

    return lambda tokens, logits: processor(mx.concatenate([prefix, tokens]), logits)


def load_draft(path: str, tokenizer, name: str, build):
    """The draft model built through `build(source)` (the target's loader),
    refused in one line where its tokenizer is not the target's."""
    from .loading import read_source

    source = read_source(path)
    if source.tokenizer is None:
        raise UserError(f"--draft-model {path} has no tokenizer to compare with")
    check_same_vocabulary(tokenizer, source.tokenizer, name, path)
    model, _ = build(source)
    return model
