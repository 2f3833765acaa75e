"""Anthropic's Messages API, POST /v1/messages: the body becomes a chat
completion's (system, turns, tool_use and tool_result blocks as OpenAI's
tool calls and tool messages), runs as one, and is answered as a Message, or
as Anthropic's events when streamed. Errors have Anthropic's shape."""

import json

from ..limits import is_int, is_number
from .replies import (
    SAMPLER_EXTRAS,
    call_arguments,
    chain,
    chat_reply,
    need,
    new_id,
    send_event,
)
from .schema import RequestError

PATH = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# chat_reply's events that are content blocks: (block type, its text's key,
# its delta type); a thought is a thinking block with an empty signature.
BLOCKS = {
    "thought": ("thinking", "thinking", "thinking_delta"),
    "text": ("text", "text", "text_delta"),
}


def _block(kind: str) -> dict:
    return (
        {"type": kind, "thinking": "", "signature": ""}
        if kind == "thinking"
        else {
            "type": kind,
            "text": "",
        }
    )


def owns(path: str) -> bool:
    """Whether `path` is Anthropic's (/v1/messages and below, unknown ones
    too): its errors then come in Anthropic's shape."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(e: RequestError) -> dict:
    """Anthropic's error shape for a RequestError."""
    kind = ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" for b in content
    ):
        return "".join(str(b.get("text", "")) for b in content)
    raise RequestError(f"{where} must be a string or a list of text blocks", where)


def _messages(body: dict) -> list:
    """Anthropic's turns as OpenAI chat messages."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    turns = need(body, "messages", lambda v: isinstance(v, list) and v, "a list")
    for i, m in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(f"{where} must have role user or assistant", where)
        blocks = m.get("content")
        if isinstance(blocks, str):
            blocks = [{"type": "text", "text": blocks}]
        if not isinstance(blocks, list):
            raise RequestError(f"{where}.content must be a string or blocks", where)
        text, calls = "", []
        for b in blocks:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text += str(b.get("text", ""))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("input", {}), dict):
                    raise RequestError(
                        f"{where}: a tool_use block's input must be an object", where
                    )
                args = json.dumps(b.get("input") or {})
                calls.append(
                    {
                        "id": b.get("id"),
                        "type": "function",
                        "function": {"name": b.get("name"), "arguments": args},
                    }
                )
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                pass  # earlier thoughts: templates drop them (Qwen3's, DeepSeek's)
            elif kind == "tool_result" and m["role"] == "user":
                content = b.get("content", "")
                result = content if isinstance(content, str) else _text(content, where)
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": b.get("tool_use_id"),
                        "content": result,
                    }
                )
            else:
                raise RequestError(
                    f"{where}: a {kind!r} block is not supported here (text, "
                    "thinking and tool_use from the assistant, tool_result from "
                    "the user)",
                    where,
                )
        if text or calls or not out or out[-1]["role"] != "tool":
            turn = {"role": m["role"], "content": text}
            out.append({**turn, "tool_calls": calls} if calls else turn)
    return out


def to_chat(body: dict, counting: bool = False) -> dict:
    """The chat completion body a Messages body asks for (counting: a
    count_tokens body, which has no max_tokens)."""
    chat = {"messages": _messages(body)}
    if not counting:
        chat["max_tokens"] = need(
            body, "max_tokens", lambda v: is_int(v) and v >= 1, "an integer >= 1"
        )
    # cache_salt: vLLM's field, as on chat completions (extra_body in the SDKs).
    for name in ("model", "temperature", "top_p", "cache_salt", *SAMPLER_EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("temperature") is not None:
        need(body, "temperature", lambda v: is_number(v) and 0 <= v <= 1, "from 0 to 1")
    kwargs = _template_kwargs(body)
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    stops = body.get("stop_sequences")
    if stops:
        chat["stop"] = stops
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools
        ):
            raise RequestError(
                "'tools' must be a list of {name, input_schema}", "tools"
            )
        chat["tools"] = [
            {
                "type": "function",
                **({"strict": True} if t.get("strict") else {}),
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {"type": "object"},
                },
            }
            for t in tools
        ]
    chat.update(_tool_choice(body.get("tool_choice")))
    return chat


def _tool_choice(choice) -> dict:
    """Anthropic's tool_choice as chat completion fields: "any" is
    "required", "tool" a named function (both enforced: structured.py);
    disable_parallel_tool_use is parallel_tool_calls false."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "none", "any", "tool") or (
        kind == "tool" and not isinstance(choice.get("name"), str)
    ):
        raise RequestError(
            '\'tool_choice\' must be {"type": "auto"}, "any", "none" or '
            '{"type": "tool", "name": ...}',
            "tool_choice",
        )
    out = {"tool_choice": {"any": "required"}.get(kind, kind)}
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs` (an SDK's extra_body, checked by the chat route)
    with Anthropic's `thinking` said as the template's enable_thinking."""
    kwargs = body.get("chat_template_kwargs")
    kwargs = dict(kwargs) if isinstance(kwargs, dict) else kwargs
    thinking = body.get("thinking")
    if thinking is None:
        return kwargs
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise RequestError(
            '\'thinking\' must be {"type": "enabled", "budget_tokens": N}, '
            '{"type": "adaptive"} or {"type": "disabled"}',
            "thinking",
        )
    if isinstance(kwargs, dict) or kwargs is None:
        kwargs = {"enable_thinking": kind != "disabled", **(kwargs or {})}
    return kwargs


def _usage(result: dict) -> dict:
    """Anthropic's usage: input_tokens counts the prompt not read from cache."""
    u = result["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "output_tokens": u["completion_tokens"],
        "cache_read_input_tokens": cached,
    }


def _stop(result: dict):
    """(stop_reason, stop_sequence) of a finished reply."""
    hit = result.get("stop_sequence")
    if hit is not None:
        return "stop_sequence", hit
    return STOP_REASONS.get(result["finish_reason"], "end_turn"), None


def _tool_use(call: dict) -> dict:
    return {
        "type": "tool_use",
        "id": call.get("id") or new_id("toolu_"),
        "name": call["function"]["name"],
        "input": call_arguments(call),
    }


def count_tokens(reply) -> None:
    """POST /v1/messages/count_tokens: the prompt's tokens as Messages would
    bill them, the whole prompt (a create's input_tokens plus its
    cache_read_input_tokens)."""
    body = reply.read_json()
    reply.service.fits_messages(body)  # counted before they are converted
    chat = to_chat(body, counting=True)
    reply.send_json(200, {"input_tokens": len(reply.service.chat_prompt(chat))})


def messages(reply) -> None:
    """POST /v1/messages."""
    body = reply.read_json()
    reply.service.fits_messages(body)  # counted before they are converted
    chat = to_chat(body)
    stream = body.get("stream") is True
    events = chat_reply(reply, chat)
    try:
        _answer(reply, events, stream)
    finally:
        events.close()  # a client that left: its request is cancelled now


def _answer(reply, events, stream: bool) -> None:
    _, request = next(events)
    message = {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        # Tools the template ignored: said as chat completions say it.
        **({"warning": request.warning} if request.warning else {}),
    }
    if not stream:
        for what, value in events:
            if what in BLOCKS:
                kind, key, _ = BLOCKS[what]
                if not message["content"] or message["content"][-1]["type"] != kind:
                    message["content"].append(_block(kind))
                message["content"][-1][key] += value
            elif what == "call":
                message["content"].append(_tool_use(value))
            else:
                message["stop_reason"], message["stop_sequence"] = _stop(value)
                message["usage"] = _usage(value)
        reply.send_json(200, message)
        return
    _stream(reply, events, message, request)


def _stream(reply, events, message: dict, request) -> None:
    first = next(events)  # errors before the first piece are still a JSON error
    reply.start_events()
    # What message_delta's usage says too: the prompt less what was cached.
    usage = {
        "input_tokens": len(request.prompt) - request.cached,
        "output_tokens": 0,
        "cache_read_input_tokens": request.cached,
    }
    out = _Blocks(reply)
    out.event("message_start", message={**message, "usage": usage})
    try:
        for what, value in chain(first, events):
            if what in BLOCKS:
                out.piece(*BLOCKS[what], value)
            elif what == "call":
                out.call(value)
            else:
                out.finish(value)
    except RequestError as e:
        send_event(reply, "error", error_body(e))


class _Blocks:
    """One streamed message: its content blocks numbered in order, a text or
    thinking block open while its pieces arrive."""

    def __init__(self, reply):
        self.reply = reply
        self.index, self.open_kind = -1, None

    def event(self, kind: str, **data):
        send_event(self.reply, kind, {"type": kind, **data})

    def piece(self, kind: str, key: str, delta_type: str, value: str):
        if self.open_kind != kind:
            self._close()
            self.open_kind = kind
            self._start(_block(kind))
        self._delta({"type": delta_type, key: value})

    def call(self, value):
        """A tool_use block, sent whole."""
        self._close()
        use = _tool_use(value)
        self._start({**use, "input": {}})
        self._delta(
            {"type": "input_json_delta", "partial_json": json.dumps(use["input"])}
        )
        self.event("content_block_stop", index=self.index)

    def finish(self, value):
        self._close()
        reason, hit = _stop(value)
        self.event(
            "message_delta",
            delta={"stop_reason": reason, "stop_sequence": hit},
            usage=_usage(value),  # the final counts, all of them
        )
        self.event("message_stop")

    def _start(self, block: dict):
        self.index += 1
        self.event("content_block_start", index=self.index, content_block=block)

    def _delta(self, delta: dict):
        self.event("content_block_delta", index=self.index, delta=delta)

    def _close(self):
        if self.open_kind == "thinking":  # Anthropic signs a thought before its stop
            self._delta({"type": "signature_delta", "signature": ""})
        if self.open_kind:
            self.event("content_block_stop", index=self.index)
            self.open_kind = None
