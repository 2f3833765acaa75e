"""Structured output: JSON, or JSON that fits a schema, with llguidance
(docs/design.md section 5g).

Each request gets its own llguidance matcher, wrapped as an mlx-lm logits
processor (GrammarProcessor): before each token it advances the matcher on
the tokens its own sequence has generated since the last call, read from the
token history mlx-lm hands every processor, then masks the logits to what
the grammar allows. It never counts calls or batch rows, so a batch that grows
or shrinks around it cannot put it out of step. serve and generate use it.
"""

import copy
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


CLOSE_WINDOW = 32  # tokens from the budget's end where closing is considered
# The most one token adds to the closing text (", " owes a key and a value:
# ' "": ""'); within that of the end, a token may not leave more than fits.
GROW = 8


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


def tool_call_grammar(
    tools: List[dict],
    start: str,
    end: str,
    special=None,
    required: bool = False,
    once: bool = False,
) -> str:
    """A reply of plain text (never holding `start`), or text then tool calls
    between `start` and `end` whose JSON is {"name", "arguments"} with the
    arguments fitting that tool's `parameters` (mlx-lm's json_tools format).
    special(marker): llguidance's "<[id]>" where the marker is one special
    token (never text to the matcher), else None. required: calls only, from
    the first token (tool_choice "required" or a named tool); once: one call
    at most (parallel_tool_calls false)."""
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
    if required:  # no text: the reply opens on the marker
        text, before = "", f"before: {s_tok or json.dumps(start)}\n"
    calls = f'(before "\\n"? call "\\n"? {e})' + ("" if once else "+")
    return _lark(
        f"start: {calls if required else 'TEXT | ' + calls}\n"
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
        self._build = threading.RLock()  # closing_tokens reads ll under it too
        self._closing = None  # closing_tokens()

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

    def closing_tokens(self):
        """(closers, structural), each [(id, bytes)], from one pass over the
        vocabulary, built once: the tokens whose text could be part of a
        closing text (closing_text: quotes, ": ", brackets, braces), and those
        that can make it longer (quotes, commas, colons, opening brackets,
        backslashes)."""
        with self._build:
            if self._closing is None:
                ll, chars = self.ll, set(b'"]}: ')
                closers, structural = [], []
                for i in range(ll.vocab_size):
                    if ll.is_special_token(i) or not (b := ll.decode_bytes([i])):
                        continue
                    if set(b) <= chars:
                        closers.append((i, b))
                    if any(c in b for c in b'",:[{\\'):
                        structural.append((i, b))
                self._closing = closers, structural
            return self._closing

    def processor(
        self, grammar: str, max_tokens: Optional[int] = None
    ) -> "GrammarProcessor":
        """A fresh processor for one sequence; GrammarError if the grammar
        does not compile. With `max_tokens`, JSON is closed before the
        budget runs out where the grammar allows it (closing)."""
        from llguidance import LLMatcher

        self.check(grammar)
        matcher = LLMatcher(self.ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        eos = getattr(self.tokenizer, "eos_token_ids", None) or []
        p = GrammarProcessor(matcher, self.ll.vocab_size, eos)
        if max_tokens is not None:
            p.budget = max_tokens
            p.closers, p.structural = self.closing_tokens()
            p.decode = self.ll.decode_bytes
        return p


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
        self.budget: Optional[int] = None  # the reply's max tokens, if closing
        self.closers = self.structural = self.decode = None
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

    def settled(self) -> bool:
        """Whether the reply may end here: the grammar accepts what it has
        (or stopped, or failed: nothing more to close)."""
        m = self.matcher
        return m.is_accepting() or m.is_stopped() or m.is_error()

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
            fits = self.near_the_end(bits)
            if fits is not None:  # where the grammar agrees
                closing = bits & fits
                closing[list(self.eos_ids)] = bits[list(self.eos_ids)]
                bits = closing if closing.any() else bits
        if len(bits) < n_logits:  # a model's padded vocabulary: never sampled
            bits = np.concatenate([bits, np.zeros(n_logits - len(bits), dtype=bool)])
        return mx.array(bits[:n_logits])

    def near_the_end(self, bits):
        """None far from the budget's end; else a (vocab,) bool array of the
        tokens that keep the JSON closable: when the tokens left are about the
        closing text's length (+2: the end, a token of one byte), those that
        spell it; within GROW more, any but those after which the closing
        text would need more tokens than are left (a "," with 4 left)."""
        import numpy as np

        left = None if self.budget is None else self.budget - len(self.fed)
        if left is None or left > CLOSE_WINDOW:
            return None
        tail = JsonTail().feed(self.decode(self.fed))
        need = tail.need()
        if left <= len(need) + 2:
            fits = np.zeros(len(bits), dtype=bool)
            fits[[i for i, b in self.closers if need.startswith(b)]] = True
            return fits
        if left > len(need) + 2 + GROW:
            return None
        fits = np.ones(len(bits), dtype=bool)
        # After the token: left - 1 tokens, for the closing text and the end.
        fits[
            [
                i
                for i, b in self.structural
                if bits[i] and len(tail.copy().feed(b).need()) > left - 2
            ]
        ] = False
        return fits

    def __call__(self, tokens, logits):
        import mlx.core as mx

        n = len(tokens) if tokens is not None else 0
        if self.start is None:
            self.start = n
        generated = tokens[self.start :].tolist() if n > self.start else []
        self.advance(generated)
        mask = self.allowed(logits.shape[-1])
        return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))


def closing_text(text: bytes) -> bytes:
    """The shortest text that closes JSON `text` (compact: ", " and ": " as
    the grammar writes them): the open string, an owed value as "", then each
    open array and object. A schema may want other values: the grammar has the
    last word."""
    return JsonTail().feed(text).need()


class JsonTail:
    """closing_text's reading of JSON, fed bytes at a time, so the closing
    text after one more token costs that token's bytes only."""

    def __init__(self):
        self.stack, self.expect = [], []
        self.in_string = self.escaped = self.key = False
        self.last = self.solid = b""  # the last byte, the last one not a space

    def copy(self) -> "JsonTail":
        c = copy.copy(self)
        c.stack, c.expect = list(self.stack), list(self.expect)
        return c

    def feed(self, text: bytes) -> "JsonTail":
        stack, expect = self.stack, self.expect
        for c in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == 0x5C:  # backslash
                    self.escaped = True
                elif c == 0x22:
                    self.in_string = False
                    if self.key:
                        expect[-1], self.key = "colon", False
                    elif stack:
                        expect[-1] = "after"
            elif c == 0x22:
                self.in_string = True
                self.key = bool(stack) and expect[-1] == "key"
            elif c in b"[{":
                stack.append(c)
                expect.append("key" if c == 0x7B else "value")
            elif c in b"]}":
                if stack:
                    stack.pop(), expect.pop()
                if stack:
                    expect[-1] = "after"
            elif c == 0x3A and stack:  # colon
                expect[-1] = "value"
            elif c == 0x2C and stack:  # comma
                expect[-1] = "key" if stack[-1] == 0x7B else "value"
            elif c not in b" \n\t\r" and stack and expect[-1] == "value":
                expect[-1] = "after"  # a number or literal: closers end it
        if text:
            self.last = text[-1:]
            self.solid = text.rstrip()[-1:] or self.solid
        return self

    def need(self) -> bytes:
        stack, in_string = self.stack, self.in_string
        out = b'"' if in_string else b""
        if stack:
            owed = self.expect[-1]
            # After "," or ":" the grammar writes its space first.
            sep = b" " if not in_string and self.last in (b",", b":") else b""
            if in_string and self.key or not in_string and owed == "colon":
                out += b': ""'
            elif (
                not in_string
                and owed == "key"
                and stack[-1] == 0x7B
                and self.solid == b","
            ):
                out += sep + b'"": ""'
            elif not in_string and owed == "value" and self.solid in (b":", b","):
                out += sep + b'""'
        return out + bytes(0x7D if c == 0x7B else 0x5D for c in reversed(stack))
