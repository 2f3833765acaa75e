"""What the Anthropic and Responses routes share: a request body turned into
a chat completion's, run through the same worker and reply split, its reply
as a stream of ("thought", str), ("text", str), ("call", OpenAI tool call)
and ("done", result) events; and server-sent events with named types."""

import json
import uuid
from typing import Iterator, Tuple

from .schema import RequestError
from .split import reply_split

# Chat completions' sampler fields these APIs lack, taken as they are (an SDK's
# extra_body) and checked by the chat route.
SAMPLER_EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "logit_bias",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "frequency_penalty",
)


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def chat_reply(reply, chat: dict) -> Iterator[Tuple[str, object]]:
    """First ("request", Request), then the reply of the chat body `chat`
    piece by piece: its thought, then its text; a tool call comes whole,
    after the text before it. The worker streams either way: the caller
    collects what it does not stream."""
    service = reply.service
    with service.submitted("chat", {**chat, "stream": True}) as requests:
        (request,) = requests
        split = reply_split(service, request, streaming=False)
        yield "request", request
        while True:
            what, value = reply.next_event(request)
            if what == "error":
                raise value
            final = what == "done"
            piece, thought, calls = "" if final else value[0], "", []
            if split:
                thought, piece, calls = split.feed(piece, final=final)
            if thought:
                yield "thought", thought
            if piece:
                yield "text", piece
            for call in calls:
                yield "call", call
            if final:
                reason = value["finish_reason"]
                if split:
                    reason = split.finish_reason(reason)
                yield "done", {**value, "finish_reason": reason}
                return


def call_arguments(call: dict) -> dict:
    """An OpenAI tool call's arguments as an object ({} where not JSON)."""
    try:
        args = json.loads(call["function"].get("arguments") or "{}")
    except ValueError:
        return {}
    return args if isinstance(args, dict) else {}


def send_event(reply, kind: str, data: dict) -> None:
    """One named event: `event: kind` and its JSON."""
    reply.event(f"event: {kind}\ndata: {json.dumps(data)}\n\n")


def need(body: dict, name: str, ok, what: str):
    """body[name] when ok(value), else a 400 saying what it must be."""
    value = body.get(name)
    if not ok(value):
        raise RequestError(
            f"'{name}' must be {what}, not {json.dumps(value)[:80]}",
            param=name,
            code="invalid_value" if value is not None else "missing_required",
        )
    return value


def chain(first, rest):
    """`first`, then what `rest` yields."""
    yield first
    yield from rest
