"""OpenAI's chat and text completion objects (http.py sends them): a reply's
message, a streamed chunk, the id and model every one carries, and one usage
for several prompts or choices. Plain dicts from the worker's results."""

from typing import List, Optional

from ..thinking import ReplySplit
from .schema import Request


def total_usage(usages: List[dict], n: int = 1) -> dict:
    """One usage for several prompts, n choices each: each prompt counted
    once (as OpenAI counts n), every choice's completion summed."""
    if len(usages) == 1:
        return usages[0]
    prompts = usages[::n]
    made = sum(u["completion_tokens"] for u in usages)
    read = sum(u["prompt_tokens"] for u in prompts)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in prompts)
    thought = sum(u["completion_tokens_details"]["reasoning_tokens"] for u in usages)
    return {
        "prompt_tokens": read,
        "completion_tokens": made,
        "total_tokens": read + made,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": thought},
    }


def message(split: Optional[ReplySplit], result: dict, choice: dict) -> dict:
    """A choice's chat message: its thought (as mlx_lm.server's `reasoning`
    and vLLM's `reasoning_content`), content and tool calls; `choice`'s
    finish_reason becomes "tool_calls" where the split found a call."""
    if split is None:
        return {"role": "assistant", "content": result["text"]}
    got = split.feed(result["text"], final=True)
    choice["finish_reason"] = split.finish_reason(result["finish_reason"])
    out = {"role": "assistant", "content": got.content}
    if got.reasoning:
        out.update(reasoning=got.reasoning, reasoning_content=got.reasoning)
    if got.calls:
        out["tool_calls"] = got.calls
    return out


def head(request: Request, mode: str, chunk: bool) -> dict:
    """The fields every completion object or chunk of `request` carries."""
    if request.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
        prefix = "chatcmpl-"
    else:
        obj, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + request.id,
        "object": obj,
        "created": request.created,
        "model": request.model,
        "system_fingerprint": f"flashnorm-mlx-{mode}",
        **({"warning": request.warning} if request.warning else {}),
    }


def chunk(
    request: Request,
    mode: str,
    text: Optional[str],
    finish=None,
    role=False,
    logprobs=None,
    calls=None,
    thought="",
    index: int = 0,
) -> dict:
    """One streamed chunk of choice `index`: a chat delta (role, content,
    thought, tool calls) or a text piece."""
    if request.kind == "chat":
        delta = {"role": "assistant"} if role else {}
        if text is not None and (text or not thought):
            delta["content"] = text
        if thought:
            delta.update(reasoning=thought, reasoning_content=thought)
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    choice.update(finish_reason=finish, logprobs=logprobs)
    return {**head(request, mode, chunk=True), "choices": [choice]}
