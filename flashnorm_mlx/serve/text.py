"""A reply's text, token by token: the exact decoding in context (Detokenizer)
and the cut at the first stop string (StopText). Pure Python over the
tokenizer's decode; the generation thread calls them under the tokenizer lock
(docs/design.md section 5e)."""

from typing import Callable, List, Optional

REPLACEMENT = "\ufffd"  # what decode makes of a character cut between tokens


class Detokenizer:
    """Text grown a token at a time, always the exact decoding in context:
    the pieces of tokens added after `context` join to
    decode(context + tokens)[len(decode(context)):] (and the context's trailing
    partial character, if it ends in one).

    Each piece is a window re-decoded, decode(ids[prefix:] + [t]) less the
    window's text before (decode(ids[prefix:read])), so spaces a tokenizer
    drops at the start of a text (mlx-lm's streaming detokenizers drop the
    first token's leading space) are kept. A piece that ends in U+FFFD, a
    character whose bytes are not all in yet, is held back and comes whole
    with the token that completes it (as TGI and vLLM do); past HOLD_MAX
    tokens it is let go (bytes that never make a character)."""

    HOLD_MAX = 16
    CONTEXT = 4  # tokens of context kept before the text not yet sent

    def __init__(self, decode: Callable, context: List[int] = ()):
        self.decode = decode
        self.ids = list(context)
        read = len(self.ids)
        # A context cut inside a character: its last bytes wait for the reply's.
        while read > max(0, len(self.ids) - 3) and self._text(
            read - self.CONTEXT, read
        ).endswith(REPLACEMENT):
            read -= 1
        self.prefix, self.read = max(0, read - self.CONTEXT), read
        self.prefix_text = self._text(self.prefix, read)
        self.emitted = 0  # characters given out by add and flush

    def _text(self, start: int, end: int, extra: List[int] = ()) -> str:
        return self.decode(self.ids[max(0, start) : end] + list(extra))

    def piece(self, token: int, final: bool = False) -> str:
        """The text `token` would add now (held back: ""); nothing changes."""
        text = self._text(self.prefix, len(self.ids), [token])
        held = len(self.ids) + 1 - self.prefix
        if len(text) > len(self.prefix_text) and (
            final or not text.endswith(REPLACEMENT) or held > self.HOLD_MAX
        ):
            return text[len(self.prefix_text) :]
        return ""

    def add(self, token: int, final: bool = False) -> str:
        """Add `token`; the text it adds (final: nothing held back)."""
        piece = self.piece(token, final)
        self.ids.append(token)
        if piece:
            self.prefix, self.read = self.read, len(self.ids)
            self.prefix_text = self._text(self.prefix, self.read)
            self.emitted += len(piece)
        return piece

    def flush(self) -> str:
        """The text still held back (a last partial character, as U+FFFD)."""
        text = self._text(self.prefix, len(self.ids))
        if len(self.ids) == self.read or len(text) <= len(self.prefix_text):
            return ""
        piece = text[len(self.prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self._text(self.prefix, self.read)
        self.emitted += len(piece)
        return piece


class StopText:
    """Cuts generated text at the first stop string, holding back any tail
    that could still grow into one, so a stream never sends a stop string."""

    def __init__(self, stops: List[str]):
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.hit: Optional[str] = None  # the stop string that ended the text

    def add(self, piece: str):
        """(new text safe to send, whether a stop string was hit)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            self.hit = next(
                s for s in self.stops if self.text.find(s, self.sent) == end
            )
            out, self.text, self.sent = self.text[self.sent : end], self.text[:end], end
            return out, True
        # The longest tail of the text that is the start of some stop string.
        longest = max(map(len, self.stops), default=0)
        tail = self.text[max(self.sent, len(self.text) - longest + 1) :]
        hold = next(
            (
                len(tail) - i
                for i in range(len(tail))
                if any(s.startswith(tail[i:]) for s in self.stops)
            ),
            0,
        )
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
