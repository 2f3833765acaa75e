"""OpenAI's Responses API, POST /v1/responses, without server-side state: the
body (input as a string or items, instructions, function tools, text.format)
becomes a chat completion's, runs as one, and is answered as a Response, or
as the Responses events the openai SDK reads when streamed."""

import json
import time

from ..limits import is_int
from .replies import (
    SAMPLER_EXTRAS,
    chain,
    chat_reply,
    need,
    new_id,
    send_event,
)
from .schema import RequestError


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") in ("input_text", "output_text", "text")
        and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}.content must be a string or text parts", "input")


def _messages(body: dict) -> list:
    out = []
    if body.get("instructions") is not None:
        instructions = need(
            body, "instructions", lambda v: isinstance(v, str), "a string"
        )
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a list of items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in (
            "user",
            "assistant",
            "system",
            "developer",
        ):
            out.append(
                {"role": item["role"], "content": _content(item.get("content"), where)}
            )
        elif kind == "function_call":
            _check_arguments(item.get("arguments"), where)
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {
                    "name": item.get("name"),
                    "arguments": item.get("arguments") or "{}",
                },
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": (
                        output if isinstance(output, str) else json.dumps(output)
                    ),
                }
            )
        elif kind == "reasoning":
            pass  # an earlier thought: templates drop them (Qwen3's, DeepSeek's)
        else:
            raise RequestError(
                f"{where} must be a message, reasoning, function_call or "
                "function_call_output",
                "input",
            )
    return out


def _check_arguments(arguments, where: str) -> None:
    """A function_call item's arguments: a JSON object in a string (a 400
    naming the item otherwise, as the chat route names its message)."""
    try:
        ok = isinstance(json.loads(arguments or "{}"), dict)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise RequestError(
            f"{where}.arguments must be a JSON object in a string, not "
            f"{json.dumps(arguments)[:60]}",
            f"{where}.arguments",
        )


def _format(body: dict):
    """text.format as a chat completion's response_format (None: text)."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: fmt.get(k) for k in ("name", "schema", "strict")}
        return {"type": "json_schema", "json_schema": spec}
    return fmt  # json_object, or an error from the chat route's check


def to_chat(body: dict) -> dict:
    """The chat completion body a Responses body asks for."""
    if body.get("previous_response_id") is not None:
        raise RequestError(
            "'previous_response_id' is not supported: this server keeps no "
            "responses; send the whole conversation in 'input'",
            "previous_response_id",
            "unsupported_parameter",
        )
    chat = {"messages": _messages(body)}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = need(
            body, "max_output_tokens", lambda v: is_int(v) and v >= 1, "an integer >= 1"
        )
    # cache_salt: vLLM's field, as on chat completions (extra_body in the SDKs).
    for name in ("model", "temperature", "top_p", "cache_salt", *SAMPLER_EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    fmt = _format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    tools = body.get("tools")
    if tools:
        if not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
            raise RequestError("only function tools are supported", "tools")
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    k: t[k]
                    for k in ("name", "description", "parameters", "strict")
                    if k in t
                },
            }
            for t in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        # Responses names the function flat; chat completions nest it.
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    effort = body.get("reasoning")
    if effort is not None:
        need(body, "reasoning", lambda v: isinstance(v, dict), "an object")
        if effort.get("effort") is not None:
            chat["reasoning_effort"] = effort["effort"]  # to the template
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat


def _response(
    body: dict, rid: str, model: str, status: str, output: list, warning=None
):
    """A Response object; `warning`: tools the template ignored, said as
    chat completions say it."""
    return {
        **({"warning": warning} if warning else {}),
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "usage": None,
    }


def _usage(result: dict) -> dict:
    u = result["usage"]
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]
        },
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"]
        },
        "total_tokens": u["total_tokens"],
    }


def _message(mid: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": mid,
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
    }


def _reasoning(rid: str, text: str, status: str = "completed") -> dict:
    """A thought as Responses' reasoning item (its text whole, no summary)."""
    content = (
        [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    )
    return {
        "type": "reasoning",
        "id": rid,
        "status": status,
        "summary": [],
        "content": content,
    }


def _call(call: dict) -> dict:
    return {
        "type": "function_call",
        "id": new_id("fc_"),
        "call_id": call.get("id") or new_id("call_"),
        "name": call["function"]["name"],
        "arguments": call["function"].get("arguments") or "{}",
        "status": "completed",
    }


def responses(reply) -> None:
    """POST /v1/responses."""
    body = reply.read_json()
    reply.service.fits_messages(body, "input")  # counted before they are converted
    chat = to_chat(body)
    events = chat_reply(reply, chat)
    try:
        _, request = next(events)
        rid, mid = new_id("resp_"), new_id("msg_")
        if body.get("stream") is True:
            _stream(reply, body, events, rid, request)
            return
        text, thought, output, result = "", "", [], None
        for what, value in events:
            if what == "thought":
                thought += value
            elif what == "text":
                text += value
            elif what == "call":
                output.append(_call(value))
            else:
                result = value
        if text or not output:
            output.insert(0, _message(mid, text))
        if thought:  # before the message, as OpenAI's reasoning models answer
            output.insert(0, _reasoning(new_id("rs_"), thought))
        reply.send_json(200, _finished(body, rid, request, output, result))
    finally:
        events.close()


def _finished(body, rid, request, output, result) -> dict:
    length = result["finish_reason"] == "length"
    status = "incomplete" if length else "completed"
    r = _response(body, rid, request.model, status, output, request.warning)
    r["usage"] = _usage(result)
    if length:
        r["incomplete_details"] = {"reason": "max_output_tokens"}
    return r


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _stream(reply, body, events, rid, request) -> None:
    """Responses' events: a message item open while text arrives, closed
    before a function_call item (each whole), then response.completed."""
    first = next(events)  # errors before the first piece are still a JSON error
    reply.start_events()
    out = _Events(reply)
    started = _response(body, rid, request.model, "in_progress", [], request.warning)
    out.event("response.created", response=started)
    out.event("response.in_progress", response=started)
    try:
        for what, value in chain(first, events):
            if what == "thought":
                out.thought(value)
            elif what == "text":
                out.text(value)
            elif what == "call":
                out.call(value)
            else:
                out.finish(body, rid, request, value)
    except RequestError as e:
        out.event("error", code=e.code, message=e.message, param=e.param)


class _Events:
    """One streamed response: its numbered events, its output items, and the
    reasoning and message items open while their text arrives."""

    def __init__(self, reply):
        self.reply = reply
        self.seq = iter(range(1 << 30))
        self.output: list = []
        self.msg: dict = {}  # the open message's place and text
        self.rs: dict = {}  # the open reasoning's

    def event(self, kind, **data):
        data = {"type": kind, "sequence_number": next(self.seq), **data}
        send_event(self.reply, kind, data)

    def thought(self, value: str):
        if not self.rs:
            self._open(self.rs, "rs_", _reasoning)
        self.rs["text"] = self.rs.get("text", "") + value
        self.event("response.reasoning_text.delta", **_at(self.rs), delta=value)

    def text(self, value: str):
        self._close_reasoning()
        if not self.msg:
            self._open_message()
        self.msg["text"] = self.msg.get("text", "") + value
        self.event(
            "response.output_text.delta", **_at(self.msg), delta=value, logprobs=[]
        )

    def call(self, value):
        """A function_call item, sent whole: the open items closed first."""
        self._close_reasoning()
        self._close_message()
        item, i = _call(value), len(self.output)
        opened = {**item, "arguments": "", "status": "in_progress"}
        self.event("response.output_item.added", output_index=i, item=opened)
        args = dict(item_id=item["id"], output_index=i)
        delta, whole = "response.function_call_arguments", item["arguments"]
        self.event(f"{delta}.delta", **args, delta=whole)
        self.event(f"{delta}.done", **args, arguments=whole)
        self.event("response.output_item.done", output_index=i, item=item)
        self.output.append(item)

    def finish(self, body, rid, request, value):
        """The last event: a message item even where no text came."""
        self._close_reasoning()
        output = self.output
        if not output or (len(output) == 1 and output[0]["type"] == "reasoning"):
            self._open_message()
        self._close_message()
        done = _finished(body, rid, request, output, value)
        incomplete = done["status"] == "incomplete"
        self.event(
            "response.incomplete" if incomplete else "response.completed",
            response=done,
        )

    def _open(self, place: dict, prefix: str, item):
        place.update(
            item_id=new_id(prefix), output_index=len(self.output), content_index=0
        )
        self.output.append(item(place["item_id"], "", "in_progress"))
        self.event(
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=self.output[-1],
        )

    def _open_message(self):
        self._open(self.msg, "msg_", _message)
        self.event("response.content_part.added", **_at(self.msg), part=_part(""))

    def _close_reasoning(self):
        if not self.rs:
            return
        at, text = _at(self.rs), self.rs.get("text", "")
        self.event("response.reasoning_text.done", **at, text=text)
        self._done(at, _reasoning(at["item_id"], text))
        self.rs.clear()

    def _close_message(self):
        if not self.msg:
            return
        at, text = _at(self.msg), self.msg.get("text", "")
        self.event("response.output_text.done", **at, text=text, logprobs=[])
        self.event("response.content_part.done", **at, part=_part(text))
        self._done(at, _message(at["item_id"], text))
        self.msg.clear()

    def _done(self, at: dict, item: dict):
        self.output[at["output_index"]] = item
        self.event(
            "response.output_item.done", output_index=at["output_index"], item=item
        )


def _at(msg: dict) -> dict:
    return {k: msg[k] for k in ("item_id", "output_index", "content_index")}
