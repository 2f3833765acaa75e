"""A request's prompts: chat messages as the chat template wants them, and
a completions request's prompts as token ids."""

from typing import Callable, List

from ..limits import is_int
from .schema import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_content(content, i: int) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") == "text"
        and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RequestError(
        f"messages[{i}].content must be a string or a list of text parts",
        param=f"messages[{i}].content",
        code="invalid_type",
    )


def read_messages(body: dict) -> List[dict]:
    """Chat messages as the chat template wants them ({role, content} strings)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "'messages' must be a non-empty list of {role, content} objects",
            param="messages",
            code="invalid_type" if messages is not None else "missing_required",
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(
                f"messages[{i}] must be an object with a role in {', '.join(ROLES)}",
                param=f"messages[{i}]",
                code="invalid_value",
            )
        content = m.get("content")
        # An assistant turn that only called tools has no content.
        if content is None and m["role"] in ("assistant", "tool"):
            content = ""
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text_content(content, i)})
    return out


def read_template_kwargs(body: dict) -> dict:
    """A chat request's `chat_template_kwargs` (mlx_lm.server's field: e.g.
    {"enable_thinking": false}), a copy, with OpenAI's `reasoning_effort`
    under its own name (gpt-oss's template reads it); {} where absent."""
    kwargs = body.get("chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError(
            "'chat_template_kwargs' must be an object of template arguments",
            param="chat_template_kwargs",
            code="invalid_type",
        )
    if effort is not None and not isinstance(effort, str):
        raise RequestError(
            "'reasoning_effort' must be a string (low, medium, high)",
            param="reasoning_effort",
            code="invalid_type",
        )
    kwargs = dict(kwargs or {})
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


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
