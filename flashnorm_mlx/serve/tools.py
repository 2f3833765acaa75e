"""Tool calling for serve's chat route (docs/design.md section 5e), with mlx-lm's
own pieces: the tokenizer's tool parser (mlx_lm.tool_parsers, chosen by
mlx-lm from the chat template); the reply's calls are cut out of its text by
split.ReplySplit.

A request's `tools` are rendered by the chat template; a model whose template
does not use them answers without them, as mlx_lm.server does, with a warning
logged and in the answer's "warning" field.
"""

import json
from typing import List, Optional

from .log import log
from .schema import RequestError


def template_uses_tools(tokenizer) -> bool:
    """Whether the chat template reads a `tools` variable at all."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def read_tools(body: dict, tokenizer) -> Optional[List[dict]]:
    """The request's `tools` (OpenAI's function list), checked; None when it
    has none or `tool_choice` is "none". A RequestError (400) where the model
    cannot use them."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none", "required") and _named(choice) is None:
        raise RequestError(
            '\'tool_choice\' must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
            code="invalid_value",
        )
    if choice not in (None, "auto", "none") and not tools:
        raise RequestError(
            f"'tool_choice' {json.dumps(choice)[:60]} needs 'tools'",
            param="tool_choice",
            code="invalid_value",
        )
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise RequestError(
            "'parallel_tool_calls' must be true or false",
            param="parallel_tool_calls",
            code="invalid_type",
        )
    if tools is None or tools == [] or choice == "none":
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise RequestError(
            '\'tools\' must be a list of {"type": "function", "function": '
            '{"name", "description", "parameters"}} objects',
            param="tools",
            code="invalid_type",
        )
    if not template_uses_tools(tokenizer):
        return None  # as mlx_lm.server: answered without them (tools_ignored)
    if not getattr(tokenizer, "has_tool_calling", False):
        raise RequestError(
            "this model's chat template renders tools, but mlx-lm has no parser "
            "for its tool-call format, so calls could not be returned; leave "
            "'tools' out",
            param="tools",
            code="tools_not_supported",
        )
    return tools


def _named(choice) -> Optional[str]:
    """The function a tool_choice object names ({"type": "function",
    "function": {"name"}}), else None."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else None


def forced_tools(body: dict, tools: Optional[List[dict]]) -> Optional[List[dict]]:
    """The tools a reply must call one of: all of them for tool_choice
    "required", the one named for a named choice (a 400 where no tool has
    that name); None where the model decides."""
    choice = body.get("tool_choice")
    if not tools or choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return tools
    name = _named(choice)
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise RequestError(
            f"'tool_choice' names {name!r}, which is not in 'tools'",
            param="tool_choice",
            code="invalid_value",
        )
    return named


def tools_ignored(body: dict, tokenizer) -> Optional[str]:
    """The warning for `tools` sent to a model whose chat template has none:
    answered without them, as mlx_lm.server does (agents send tools on every
    turn), logged and said in the answer's "warning" field."""
    tools = body.get("tools")
    if not tools or body.get("tool_choice") == "none":
        return None
    if template_uses_tools(tokenizer):
        return None
    message = (
        "this model's chat template does not use tools: they were ignored and "
        "the model answered without them"
    )
    log(f"warning: {message}", "WARNING")
    return message


def with_tool_history(messages: List[dict], body: dict) -> List[dict]:
    """read_messages' {role, content} messages with the earlier turns' tool
    parts put back for the template: an assistant's `tool_calls` (arguments
    as objects, as mlx_lm.server hands them over) and a tool's `tool_call_id`
    and `name`. A 400 naming the message where a call is malformed."""
    out = []
    for j, (m, raw) in enumerate(zip(messages, body["messages"])):
        m = dict(m)
        calls = raw.get("tool_calls")
        if raw.get("role") == "assistant" and calls is not None:
            where = f"messages[{j}].tool_calls"
            if not isinstance(calls, list):
                raise RequestError(
                    f"{where} must be a list", param=where, code="invalid_type"
                )
            m["tool_calls"] = [
                _call_for_template(c, f"{where}[{i}]") for i, c in enumerate(calls)
            ]
        for key in ("tool_call_id", "name"):
            if raw.get("role") == "tool" and isinstance(raw.get(key), str):
                m[key] = raw[key]
        out.append(m)
    return out


def _call_for_template(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(
            f"{where} must have a function name",
            param=where,
            code="invalid_value",
        )
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        args = "{}"  # a call with no arguments
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # still a string: refused below
    if not isinstance(args, dict):
        raise RequestError(
            f"{where}.function.arguments is not a JSON object: "
            f"{json.dumps(fn.get('arguments'))[:60]}",
            param=f"{where}.function.arguments",
            code="invalid_value",
        )
    return {**call, "function": {**fn, "arguments": args}}
