"""A multi-turn chat that keeps its KV cache across turns.

Each turn prefills only what the cache does not hold, so a template that
re-renders earlier turns costs a partial re-prefill, never a wrong answer; a
Ctrl-C stops the reply and keeps the session (docs/design.md section 5d).
"""

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import mlx.core as mx

from ..decode_options import DraftTally, KVOptions, make_cache
from ..errors import ChatError, ContextOverflow  # noqa: F401 (raised here)
from ..parallel import distributed
from ..thinking import ReplySplit, starts_in_thought

PREFILL_CHUNK_S = 0.5  # seconds a prefill chunk aims at: Ctrl-C waits for one
PREFILL_FIRST_CHUNK = 4  # tokens, before any chunk was timed (~0.3 s on a 2-core CPU)


@dataclass
class TurnStats:
    """What one `ChatSession.send` did."""

    reply: str  # the reply text as kept in the history
    reply_ids: List[int]  # generated ids, end-of-sequence included when hit
    prompt_tokens: int  # tokens prefilled this turn
    cached_tokens: int  # tokens of the prompt reused from the cache
    trimmed_tokens: int  # cached tokens discarded because the rendering changed
    context_tokens: int  # tokens the cache holds after the turn
    generation_tokens: int
    prompt_tps: float  # prefill tokens/sec of this turn's prefill
    generation_tps: float  # decode tokens/sec
    peak_memory_gb: float  # peak during this turn
    finish_reason: str  # "stop", "length" or "interrupted"
    dropped_messages: int = 0  # oldest messages dropped to fit the context
    max_tokens: int = 0  # the reply budget after capping to the context
    # Prompt tokens fed before a Ctrl-C cut the prefill (None: all of them).
    prefilled_tokens: Optional[int] = None
    draft: Optional[str] = None  # with a draft model: its accepted tokens

    def line(self) -> str:
        """One human-readable stats line; no rates for a turn interrupted
        before its reply, which was dropped."""
        if self.finish_reason == "interrupted" and not self.reply_ids:
            done = self.prompt_tokens
            if self.prefilled_tokens is not None:
                done = self.prefilled_tokens
            return (
                f"interrupted before the reply ({done} of {self.prompt_tokens} "
                f"prompt tokens read): the message was dropped | peak "
                f"{self.peak_memory_gb:.3f} GB"
            )
        cached = f" (+{self.cached_tokens} cached)" if self.cached_tokens else ""
        end = " | interrupted" if self.finish_reason == "interrupted" else ""
        draft = f" | {self.draft}" if self.draft else ""
        return (
            f"{self.generation_tokens} tokens, {self.generation_tps:.1f} tok/s | "
            f"prompt {self.prompt_tokens} tokens{cached}, {self.prompt_tps:.1f} tok/s"
            f"{draft} | peak {self.peak_memory_gb:.3f} GB{end}"
        )


def common_prefix(a: List[int], b: List[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class ChatSession:
    """Model, tokenizer, message history and the prompt cache that matches it.

    `cache_ids` are the token ids the KV cache holds, in order; the cache's
    offset always equals `len(cache_ids)` between turns.
    """

    model: object
    tokenizer: object  # mlx-lm TokenizerWrapper with a chat template
    system_prompt: Optional[str] = None
    max_tokens: int = 256
    sampler: Optional[Callable] = None  # default: greedy
    logits_processors: Optional[list] = None
    max_context: Optional[int] = None  # tokens; None: unlimited
    prefill_step_size: int = 2048
    # Speculative decoding and KV cache options (docs/design.md section 3f): the
    # draft's cache layers follow the model's in `cache`, as mlx-lm lays them out.
    draft_model: Optional[object] = None
    num_draft_tokens: int = 3
    kv: KVOptions = field(default_factory=KVOptions)
    tally: Optional[DraftTally] = field(default=None, init=False)  # last reply's
    messages: List[dict] = field(default_factory=list, init=False)
    cache: list = field(default_factory=list, init=False)
    cache_ids: List[int] = field(default_factory=list, init=False)
    # The last reply and the full prompt it answered, for /compare.
    last_prompt_ids: List[int] = field(default_factory=list, init=False)
    last_reply_ids: List[int] = field(default_factory=list, init=False)

    def __post_init__(self):
        if not _has_chat_template(self.tokenizer):
            raise ChatError(
                "the tokenizer has no chat template; `chat` needs one "
                "(use `generate --ignore-chat-template` for plain completion)"
            )
        if self.max_context is not None and self.max_context < 2:
            raise ChatError(
                f"the context must hold at least 2 tokens, not {self.max_context}"
            )
        self.reset()

    # --- conversation ------------------------------------------------------

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and empty the cache."""
        self.messages = (
            [{"role": "system", "content": self.system_prompt}]
            if self.system_prompt
            else []
        )
        self.cache = self._new_cache()
        self.cache_ids = []

    def _new_cache(self) -> list:
        cache = make_cache(self.model, self.kv.max_kv_size)
        if self.draft_model is not None:
            cache += make_cache(self.draft_model)
        return cache

    def seed_cache(self, cache: list, ids: List[int]) -> None:
        """Start from a saved prompt cache holding `ids` (prompt_cache.py): a
        conversation whose tokens begin with them prefills only the rest."""
        self.cache, self.cache_ids = cache, list(ids)

    def render(self, messages: Optional[List[dict]] = None) -> List[int]:
        """Token ids of a conversation through the chat template, ready for a reply."""
        ids = self.tokenizer.apply_chat_template(
            self.messages if messages is None else messages,
            add_generation_prompt=True,
        )
        return [int(i) for i in ids]

    def _fit(self, messages: List[dict], max_tokens: int):
        """(ids, messages, dropped): drop the oldest turns until prompt + reply fit."""
        ids = self.render(messages)
        limit = self.max_context
        if limit is None:
            return ids, messages, 0
        first = 1 if messages and messages[0]["role"] == "system" else 0
        dropped = 0
        while len(ids) + max_tokens > limit and len(messages) - first > 1:
            # Drop the oldest user message and everything up to the next one.
            end = first + 1
            while end < len(messages) - 1 and messages[end]["role"] != "user":
                end += 1
            dropped += end - first
            messages = messages[:first] + messages[end:]
            ids = self.render(messages)
        if len(ids) >= limit:
            raise ContextOverflow(
                f"message refused: the prompt needs {len(ids)} tokens and the "
                f"context holds {limit} (shorten it or raise --max-context)"
            )
        return ids, messages, dropped

    # --- cache -------------------------------------------------------------

    def _reuse_cache(self, ids: List[int]) -> int:
        """Trim the cache to its common prefix with ids (one token left to feed)."""
        from mlx_lm.models.cache import trim_prompt_cache

        keep = min(common_prefix(self.cache_ids, ids), len(ids) - 1)
        excess = len(self.cache_ids) - keep
        if excess and trim_prompt_cache(self.cache, excess) != excess:
            # Not trimmable (e.g. a rotating cache past its window): start over.
            self.cache, keep = self._new_cache(), 0
        self.cache_ids = self.cache_ids[:keep]
        return keep

    def _sync_cache(self, fed: List[int]) -> None:
        """Make the cache hold a prefix of `fed` in every layer, as far as it got.

        After an interrupt some layers may have taken a token others have not;
        trim all to the shortest, never past what is known to have been fed.
        """
        offsets = [_offset(c) for c in self.cache]
        keep = min([len(fed), *offsets])
        for c, off in zip(self.cache, offsets):
            if off > keep and (
                not c.is_trimmable() or c.trim(off - keep) != off - keep
            ):
                self.cache, keep = self._new_cache(), 0
                break
        self.cache_ids = list(fed[:keep])

    # --- one turn ----------------------------------------------------------

    def send(
        self,
        text: str,
        on_text: Optional[Callable[[str], None]] = None,
        max_tokens: Optional[int] = None,
        on_prefill: Optional[Callable[[int, int], None]] = None,
        on_thought: Optional[Callable[[str], None]] = None,
    ) -> TurnStats:
        """Add a user message, stream the reply through on_text, return its stats.
        on_prefill(done, total) comes before each prefill chunk; on_thought,
        where given, gets a thinking model's thought apart from the answer."""
        max_tokens = max_tokens or self.max_tokens
        messages = self.messages + [{"role": "user", "content": text}]
        ids, messages, dropped = self._fit(messages, max_tokens)
        if self.max_context is not None:
            max_tokens = min(max_tokens, self.max_context - len(ids))
        cached = len(self.cache_ids)
        try:
            keep = self._reuse_cache(ids)
        except KeyboardInterrupt:
            self._sync_cache(self.cache_ids)  # the trim may have run half-way
            raise
        trimmed = cached - keep
        new_ids = ids[keep:]

        mx.reset_peak_memory()
        # All but the last token here, in chunks; mlx-lm's stream_generate
        # feeds the last one and samples from its logits.
        progress, prefill_s, reply_ids, last = [0], 0.0, [], None
        write = _Thoughts.around(self.tokenizer, ids, on_text, on_thought)
        try:
            prefill_s = self._prefill(new_ids[:-1], on_prefill, progress)
            last, interrupted = self._stream(new_ids, max_tokens, write, reply_ids)
        except KeyboardInterrupt:  # in the prefill: the turn is dropped below
            interrupted = True
        if isinstance(write, _Thoughts):
            write.end()
        fed = self.cache_ids + new_ids + reply_ids if reply_ids else self.cache_ids
        self._sync_cache(fed)
        eos = set(self.tokenizer.eos_token_ids)
        reply = self.tokenizer.decode([t for t in reply_ids if t not in eos])
        if reply_ids:  # an interrupt before the first token leaves no trace
            self.messages = messages + [{"role": "assistant", "content": reply}]
            self.last_prompt_ids, self.last_reply_ids = list(ids), list(reply_ids)
        prompt_tps = 0.0
        if last is not None and last.prompt_tps > 0:  # mlx-lm timed the last token
            prompt_s = prefill_s + last.prompt_tokens / last.prompt_tps
            prompt_tps = len(new_ids) / prompt_s
        return TurnStats(
            reply=reply,
            reply_ids=reply_ids,
            prompt_tokens=len(new_ids),
            cached_tokens=keep,
            trimmed_tokens=trimmed,
            context_tokens=len(self.cache_ids),
            generation_tokens=len(reply_ids),
            prompt_tps=prompt_tps,
            generation_tps=last.generation_tps if last else 0.0,
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            finish_reason=(
                "interrupted" if interrupted else (last.finish_reason or "stop")
            ),
            dropped_messages=dropped,
            max_tokens=max_tokens,
            prefilled_tokens=None if last is not None else progress[0],
            draft=self.tally.short() if self.draft_model and reply_ids else None,
        )

    def _prefill(self, ids: List[int], on_prefill, progress: List[int]) -> float:
        """Feed `ids` to the cache in chunks of about PREFILL_CHUNK_S each (at
        most prefill_step_size tokens; powers of two, so a compiled engine
        traces few shapes); progress[0]: tokens fed so far. Returns seconds."""
        from mlx_lm.generate import generation_stream, maybe_quantize_kv_cache

        start, launch = time.perf_counter(), distributed.current()
        step = min(PREFILL_FIRST_CHUNK, self.prefill_step_size)
        while progress[0] < len(ids):
            if on_prefill is not None:
                on_prefill(progress[0], len(ids) + 1)
            chunk = ids[progress[0] : progress[0] + step]
            t = time.perf_counter()
            with mx.stream(generation_stream):
                n = len(self.model.layers)
                self.model(mx.array(chunk)[None], cache=self.cache[:n])
                if self.draft_model is not None:
                    self.draft_model(mx.array(chunk)[None], cache=self.cache[n:])
                maybe_quantize_kv_cache(self.cache, **self.kv.quantize_kwargs())
                mx.eval([c.state for c in self.cache])
            progress[0] += len(chunk)
            # The rate just measured sets the next chunk, at most twice this one.
            fit = len(chunk) * PREFILL_CHUNK_S / max(time.perf_counter() - t, 1e-6)
            fit = 1 << (max(int(fit), 1).bit_length() - 1)
            step = max(1, min(2 * step, fit, self.prefill_step_size))
            if launch is not None:  # ranks feed the same chunks: the slowest's
                step = mx.distributed.all_min(mx.array(step), group=launch.group)
                step = int(step.item())
        return time.perf_counter() - start

    def _stream(self, new_ids, max_tokens, on_text, reply_ids):
        """(last response, interrupted), the reply's ids appended to reply_ids:
        mlx-lm's stream_generate on the cache, which holds all of new_ids but
        the last; Ctrl-C stops the reply and keeps what was generated."""
        from mlx_lm import stream_generate

        processors = self.logits_processors
        if processors and len(new_ids) > 1:
            # They see the whole prompt of the turn, as when mlx-lm prefills.
            prefix = mx.array(new_ids[:-1])
            processors = [_after(prefix, p) for p in processors]
        last, interrupted = None, False
        kwargs = self.kv.quantize_kwargs()
        if self.draft_model is not None:
            kwargs.update(
                draft_model=self.draft_model, num_draft_tokens=self.num_draft_tokens
            )
            self.tally = DraftTally(self.num_draft_tokens, max_tokens)
        responses = stream_generate(
            self.model,
            self.tokenizer,
            mx.array(new_ids[-1:]),
            max_tokens=max_tokens,
            sampler=self.sampler,
            logits_processors=processors,
            prompt_cache=self.cache,
            prefill_step_size=self.prefill_step_size,
            **kwargs,
        )
        try:
            for last in responses:
                # Every token stream_generate yields has been fed to the cache.
                reply_ids.append(last.token)
                if self.draft_model is not None:
                    self.tally.add(last.from_draft)
                if on_text and last.text:
                    on_text(last.text)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            responses.close()
        return last, interrupted


class _Thoughts:
    """A reply's text cut as serve cuts it (thinking.py, docs/serve.md
    "Thinking models"): thought to on_thought, the rest to on_text."""

    def __init__(self, split, on_text, on_thought):
        self.split, self.on_text, self.on_thought = split, on_text, on_thought

    @classmethod
    def around(cls, tokenizer, prompt, on_text, on_thought):
        """on_text itself where there is no thought to cut out."""
        if on_thought is None or not getattr(tokenizer, "has_thinking", False):
            return on_text
        thought = starts_in_thought(tokenizer, prompt)
        return cls(ReplySplit(tokenizer, None, False, thought), on_text, on_thought)

    def __call__(self, text: str, final: bool = False) -> None:
        thought, content, _ = self.split.feed(text, final)
        if thought:
            self.on_thought(thought)
        if content and self.on_text:
            self.on_text(content)

    def end(self) -> None:
        self("", final=True)


def _after(prefix, processor):
    """`processor` with `prefix` before the tokens it is given."""
    return lambda tokens, logits: processor(mx.concatenate([prefix, tokens]), logits)


def _offset(c) -> int:
    return int(getattr(c, "offset", 0))


def _has_chat_template(tokenizer) -> bool:
    flag = getattr(tokenizer, "has_chat_template", None)
    if flag is not None:
        return bool(flag)
    return getattr(tokenizer, "chat_template", None) is not None
