"""A prompt too long for the context, refused from its size before it is
tokenized (tokenizing 15 MB takes tens of seconds and gigabytes).

Every token stands for at most L bytes of text, L the longest token's text
in the vocabulary (+1: a SentencePiece token's leading space, which decoding
it alone drops). So a text of B UTF-8 bytes is at least ceil(B / L) tokens:
a bound, not a guess, where the tokenizer's normalizer never shortens text
(none, or only prepends and replaces, as byte-level BPE and SentencePiece
tokenizers do). With any other normalizer, or a tokenizer class of the model's
own code, there is no bound (None).
"""

import json
from typing import Iterable, Optional

from ..mlx_lm_compat import inner_tokenizer
from .schema import RequestError

SAFE_NORMALIZERS = ("Prepend", "Replace", "Sequence")


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
    texts: Iterable[str], per_token: Optional[int], limit: Optional[int], param: str
) -> None:
    """400 (context_length_exceeded) when `texts` together are more tokens
    than the context holds with one reply token."""
    if per_token is None or limit is None:
        return
    size = sum(len(t.encode()) for t in texts)
    least = -(-size // per_token)
    if least + 1 > limit:
        raise RequestError(
            f"this model's maximum context length is {limit} tokens; the "
            f"request's {size} bytes of text are at least {least} tokens "
            f"(no token is more than {per_token} bytes)",
            param=param,
            code="context_length_exceeded",
        )
