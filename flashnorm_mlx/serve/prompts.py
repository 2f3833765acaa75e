"""A completions request's prompts as token ids (a chat's messages are
read by chat_body.py)."""

from typing import Callable, List

from ..limits import is_int
from .schema import RequestError

MAX_PROMPTS = 64  # prompts in one completions request (one choice each)


def read_prompts(body: dict, encode: Callable, vocab_size: int) -> List[List[int]]:
    """A completions request's prompts as token ids: a string or a list of
    token ids, or a list of those (one choice each, as lm-evaluation-harness
    sends a batch)."""
    prompt = body.get("prompt")
    one = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)
    )
    many = prompt if isinstance(prompt, list) and not one else [prompt]
    if not many or len(many) > MAX_PROMPTS:
        raise RequestError(
            f"'prompt' must be one prompt or a list of 1 to {MAX_PROMPTS}",
            param="prompt",
            code="invalid_value" if many else "invalid_type",
        )
    return [_prompt_ids(p, encode, vocab_size) for p in many]


def _prompt_ids(prompt, encode: Callable, vocab_size: int) -> List[int]:
    if isinstance(prompt, str):
        return list(encode(prompt))
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise RequestError(
                f"'prompt' token ids must be in [0, {vocab_size})",
                param="prompt",
                code="invalid_value",
            )
        return list(prompt)
    raise RequestError(
        "'prompt' must be a string or a list of token ids, or a list of those",
        param="prompt",
        code="invalid_type" if prompt is not None else "missing_required",
    )
