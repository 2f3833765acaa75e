"""A prompt too long for the context, refused from its size before it is
tokenized (tokenizing 15 MB takes tens of seconds and gigabytes).

Every token stands for at most L bytes of text, L the longest token's text
in the vocabulary (+1: a SentencePiece token's leading space, which decoding
it alone drops). So a text of B UTF-8 bytes is at least ceil(B / L) tokens:
a bound, not a guess, where the tokenizer's normalizer never shortens text
(none, or only prepends and replaces, as byte-level BPE and SentencePiece
tokenizers do). With any other normalizer, or a tokenizer class of the model's
own code, there is no bound (None).

A request as a whole is bounded too, before anything is tokenized: its
prompts together at most REQUEST_CONTEXTS contexts, and each chat message
at least one token (500,000 empty messages are not an empty prompt). While
its prompts are tokenized, one at a time (the tokenizer's lock taken for
each, so other requests' prompts go between), the first that cannot fit
ends it (Budget).
"""

import json
from typing import Iterable, Optional

from ..mlx_lm_compat import inner_tokenizer
from .schema import RequestError

SAFE_NORMALIZERS = ("Prepend", "Replace", "Sequence")
REQUEST_CONTEXTS = 4  # a request's prompts together, in contexts (n choices aside)


def bytes_per_token(tokenizer) -> Optional[int]:
    """L above, computed once (about a second for a 50k vocabulary)."""
    hf = inner_tokenizer(tokenizer)
    if not type(hf).__module__.startswith("transformers."):
        return None  # the model's own class (--trust-remote-code): any text in or out
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow (Python) tokenizer: nothing known of its normalizer
    if not all(k in SAFE_NORMALIZERS for k in _kinds(backend)):
        return None
    n = len(tokenizer.get_vocab())
    texts = hf.batch_decode([[i] for i in range(n)])
    return max(len(t.encode()) for t in texts) + 1


def _kinds(backend) -> list:
    """The normalizer's types, a Sequence's members included ([]: none)."""
    spec = json.loads(backend.to_str()).get("normalizer")
    out, todo = [], [spec] if spec else []
    while todo:
        n = todo.pop()
        out.append(n.get("type"))
        todo += n.get("normalizers") or []
    return out


def check_fits(
    texts: Iterable[str],
    per_token: Optional[int],
    limit: Optional[int],
    param: str,
    items: int = 0,
) -> None:
    """400 (context_length_exceeded) when `texts` together, and `items`
    tokens besides (one per chat message), are more tokens than `limit`
    holds with one reply token."""
    if limit is None:
        return
    size = sum(len(t.encode()) for t in texts) if per_token else 0
    least = (-(-size // per_token) if per_token else 0) + items
    if least + 1 > limit:
        held = f"{size} bytes of text" if per_token else ""
        held += (" and " if held and items else "") + (
            f"{items} messages" if items else ""
        )
        per = f" (no token is more than {per_token} bytes)" if per_token else ""
        raise RequestError(
            f"this model's maximum context length is {limit} tokens; the "
            f"request's {held} are at least {least} tokens{per}",
            param=param,
            code="context_length_exceeded",
        )


class Budget:
    """A request's prompts' tokens as they are tokenized, one prompt at a
    time: a 400 at the first prompt past the context, or past the request's
    REQUEST_CONTEXTS contexts in all."""

    def __init__(self, limit: Optional[int], param: str):
        self.limit, self.param, self.spent = limit, param, 0

    def take(self, n: int) -> None:
        if self.limit is None:
            return
        self.spent += n
        if n + 1 > self.limit or self.spent > self.limit * REQUEST_CONTEXTS:
            most = self.limit * REQUEST_CONTEXTS
            raise RequestError(
                f"this model's maximum context length is {self.limit} tokens, "
                f"and a request's prompts together at most {most}; a prompt "
                f"of {n} tokens brings this one to {self.spent}",
                param=self.param,
                code="context_length_exceeded",
            )
