"""Structured output: JSON, or JSON that fits a schema, with llguidance
(docs/design.md section 5g).

Each request gets its own llguidance matcher, wrapped as an mlx-lm logits
processor (GrammarProcessor): before each token it advances the matcher on
the tokens its own sequence has generated since the last call, read from the
token history mlx-lm hands every processor, then masks the logits to what
the grammar allows. It never counts calls or batch rows, so a batch that grows
or shrinks around it cannot put it out of step. serve and generate use it.
"""

import json
import threading
from typing import List, Optional

# Compact JSON, one way to write it: no runs of whitespace for a small model to
# loop in, and the separators models write anyway.
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile; the message says why."""


def json_grammar(schema: Optional[dict]) -> str:
    """llguidance's grammar for JSON that fits `schema` (None: any JSON object)."""
    from llguidance import LLMatcher

    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(str(e)) from None


def tool_call_grammar(tools: List[dict], start: str, end: str, special=None) -> str:
    """A reply of plain text (never holding `start`), or text then tool calls
    between `start` and `end` whose JSON is {"name", "arguments"} with the
    arguments fitting that tool's `parameters` (mlx-lm's json_tools format).
    special(marker): llguidance's "<[id]>" where the marker is one special
    token (never text to the matcher), else None."""
    calls = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call = {"anyOf": calls} if len(calls) > 1 else calls[0]
    call = {**call, "x-guidance": JSON_OPTIONS}
    special = special or (lambda marker: None)
    s_tok, e_tok = special(start), special(end)
    if s_tok:  # a special token: text can never hold it
        text = "TEXT: /(.|\\n)*/\n"
        before = f"before: TEXT {s_tok}\n"
    else:  # text up to the first marker, which text alone may not hold
        s = _lark_regex(start)
        text = f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{s}(.|\\n)*/\n"
        before = f"before[lazy]: /(.|\\n)*{s}/\n"
    e = e_tok or json.dumps(end)
    return _lark(
        f'start: TEXT | (before "\\n"? call "\\n"? {e})+\n'
        + text
        + before
        + f"call: %json {json.dumps(call)}\n"
    )


def _lark_regex(text: str) -> str:
    """`text` as a literal inside a lark /regex/."""
    import re

    return re.escape(text).replace("/", "\\/")


def _lark(source: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(source)


class Grammars:
    """llguidance's view of one tokenizer (built once, ~1 s, on first use)
    and the matchers made from it."""

    def __init__(self, tokenizer, lock: Optional[threading.Lock] = None):
        self.tokenizer = tokenizer
        self.lock = lock or threading.Lock()  # the tokenizer's, where shared
        self._ll = None
        self._build = threading.Lock()

    @property
    def ll(self):
        with self._build:
            if self._ll is None:
                import llguidance.hf

                from .mlx_lm_compat import inner_tokenizer

                eos = sorted(getattr(self.tokenizer, "eos_token_ids", None) or [])
                with self.lock:
                    self._ll = llguidance.hf.from_tokenizer(
                        inner_tokenizer(self.tokenizer), eos_token=eos or None
                    )
            return self._ll

    def special(self, marker: str) -> Optional[str]:
        """llguidance's "<[id]>" for a marker that is one special token to
        it (an added token such as <tool_call>), else None."""
        with self.lock:
            ids = self.tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and self.ll.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return None

    def check(self, grammar: str) -> None:
        """GrammarError naming what llguidance cannot compile in `grammar`."""
        from llguidance import LLMatcher

        message = LLMatcher.validate_grammar(grammar, self.ll)
        if message:
            raise GrammarError(message)

    def processor(self, grammar: str) -> "GrammarProcessor":
        """A fresh processor for one sequence; GrammarError if the grammar
        does not compile."""
        from llguidance import LLMatcher

        self.check(grammar)
        matcher = LLMatcher(self.ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        eos = getattr(self.tokenizer, "eos_token_ids", None) or []
        return GrammarProcessor(matcher, self.ll.vocab_size, eos)


class GrammarProcessor:
    """An mlx-lm logits processor: processor(tokens, logits) -> logits, where
    `tokens` is the sequence's history (the prompt or its end, then what it
    generated) and logits (1, vocab). Reply tokens the matcher has not seen
    are consumed; ones it saw that the history no longer holds (a draft's
    rejected tokens) are rolled back."""

    def __init__(self, matcher, vocab_size: int, eos_ids=()):
        self.matcher, self.vocab_size = matcher, vocab_size
        # The history's length at the first call, which comes before any reply
        # token: the whole prompt (generate_step, BatchGenerator) or its last
        # token only (mlx-lm's speculative step). The reply follows it.
        self.start: Optional[int] = None
        self.eos_ids = sorted(eos_ids)
        self.fed: List[int] = []  # the reply tokens the matcher has seen
        self.took: List[bool] = []  # whether it consumed each (not once stopped)
        self.failed: Optional[str] = None  # why the matcher stopped agreeing

    def advance(self, generated: List[int]) -> None:
        """Bring the matcher to `generated` (this sequence's tokens so far).
        Tokens after the grammar stopped (a draft's past end of sequence) are
        not fed to it, so a rollback undoes only what it consumed."""
        k = 0
        n = min(len(self.fed), len(generated))
        while k < n and self.fed[k] == generated[k]:
            k += 1
        if k < len(self.fed):
            self.matcher.rollback(sum(self.took[k:]))
            del self.fed[k:], self.took[k:]
        for t in generated[k:]:
            self.fed.append(t)
            self.took.append(not self.matcher.is_stopped())
            if self.took[-1] and not self.matcher.consume_token(t):
                self.failed = self.failed or self.matcher.get_error() or f"{t} refused"

    def allowed(self, n_logits: int):
        """(n_logits,) bool mx.array of the tokens the grammar allows next; an
        errored matcher allows end of sequence only."""
        import mlx.core as mx
        import numpy as np

        m = self.matcher
        if m.is_error():
            bits = np.zeros(self.vocab_size, dtype=bool)
            bits[list(self.eos_ids)] = True
        else:
            raw = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
            bits = np.unpackbits(raw, bitorder="little")[: self.vocab_size]
            bits = bits.astype(bool)
        if len(bits) < n_logits:  # a model's padded vocabulary: never sampled
            bits = np.concatenate([bits, np.zeros(n_logits - len(bits), dtype=bool)])
        return mx.array(bits[:n_logits])

    def __call__(self, tokens, logits):
        import mlx.core as mx

        n = len(tokens) if tokens is not None else 0
        if self.start is None:
            self.start = n
        generated = tokens[self.start :].tolist() if n > self.start else []
        self.advance(generated)
        mask = self.allowed(logits.shape[-1])
        return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))
