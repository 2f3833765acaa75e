"""Logprobs: scored on the generation thread (one evaluation per step for
every request that asks) and shaped as OpenAI's: chat's `content` entries and
completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`), with chat's `content` beside them as mlx_lm.server sends."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx


@dataclass
class TokenLogprob:
    """One token as text, its logprob (None: an echoed prompt's first token,
    which nothing predicts), its top alternatives, best first, and where its
    text starts in the answer's (characters)."""

    token: str
    logprob: Optional[float]
    top: List[Tuple[str, float]]
    offset: int = 0


def chat_logprobs(entries: List[TokenLogprob]) -> dict:
    """choices[i].logprobs of a chat completion (or of one chunk of a stream)."""

    def one(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def text_logprobs(entries: List[TokenLogprob]) -> dict:
    """choices[i].logprobs of a text completion: parallel lists, one item per
    token. The top dict holds the chosen token too, as OpenAI's (up to
    logprobs + 1 keys); text_offset indexes the choice's whole text (a
    stream's chunks joined)."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.logprob is None else _top_dict(e.top + [(e.token, e.logprob)])
            for e in entries
        ],
        "text_offset": [e.offset for e in entries],
        # mlx_lm.server's shape too (its clients read `content`, as chat's).
        "content": chat_logprobs(entries)["content"],
    }


def _top_dict(pairs: List[Tuple[str, float]]) -> Dict[str, float]:
    """{text: logprob}; tokens that decode to the same text keep the best."""
    out: Dict[str, float] = {}
    for text, lp in pairs:
        out[text] = max(lp, out.get(text, lp))
    return out


def top_logprobs(rows: List[mx.array], tokens: List[int], ks: List[int]):
    """[(logprob of token, [(id, logprob)] of the k best, best first)] for
    each (vocab,) log-softmax row: one evaluation for them all."""
    chosen = [row[t] for row, t in zip(rows, tokens)]
    ids = [
        mx.argpartition(-row, kth=k - 1)[:k] if k else None for row, k in zip(rows, ks)
    ]
    vals = [row[i] if i is not None else None for row, i in zip(rows, ids)]
    mx.eval(chosen, [x for x in ids + vals if x is not None])
    out = []
    for c, i, v in zip(chosen, ids, vals):
        top = (
            sorted(zip(i.tolist(), v.tolist()), key=lambda p: -p[1])
            if i is not None
            else []
        )
        out.append((c.item(), top))
    return out


def score_prompt(model, prompt: List[int], k: int, chunk: int):
    """Log-softmax scores of prompt[1:] given what precedes each, from one
    cached pass over prompt[:-1] in chunks: ([(logprob, top k)] per token, the
    cache, which then holds prompt[:-1])."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = []
    feed = prompt[:-1]
    for i in range(0, len(feed), chunk):
        logits = model(mx.array(feed[i : i + chunk])[None], cache=cache)[0]
        logits = logits.astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        n = lp.shape[0]
        rows += top_logprobs(list(lp), prompt[i + 1 : i + 1 + n], [k] * n)
    return rows, cache


def choice_logprobs(request, entries) -> Optional[dict]:
    """choices[0].logprobs in the request's route shape (chat or text
    completions); None when not asked for."""
    if entries is None:
        return None
    if request.kind == "chat":
        return chat_logprobs(entries)
    return text_logprobs(entries)
