"""A chat completion body's chat fields, read once into a Chat record: the
messages as the chat template wants them, the tools (with mlx-lm's tool
parser, docs/design.md section 5e), the tools tool_choice forces, and the
template's arguments. The service renders and constrains from the record,
never from the body again; the Anthropic and Responses routes translate
into such a body first."""

import json
from dataclasses import dataclass
from typing import List, Optional

from .schema import RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = (
    "this model's chat template does not use tools: they were ignored and "
    "the model answered without them"
)


@dataclass(frozen=True)
class Chat:
    messages: List[dict]  # {role, content} strings, earlier tool calls put back
    tools: Optional[List[dict]]  # None: none, tool_choice "none", or unrendered
    forced: Optional[List[dict]]  # a reply calls one of these (tool_choice)
    parallel: Optional[bool]  # parallel_tool_calls; None: unsaid
    template_kwargs: dict  # chat_template_kwargs, reasoning_effort
    warning: Optional[str]  # tools sent to a template without them (IGNORED)


def read_chat(body: dict, tokenizer) -> Chat:
    """A chat body's chat fields, checked in this order (the first bad one
    is the 400): messages, the template, tools, template arguments, the
    earlier turns' tool calls, the tool tool_choice names."""
    raw = body.get("messages")
    messages = _read_messages(raw)
    if not getattr(tokenizer, "has_chat_template", False):
        raise RequestError(
            "this model has no chat template; use /v1/completions",
            param="messages",
        )
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    _check_tool_fields(tools, choice, parallel)
    rendered = _read_tools(tools, choice, tokenizer)
    kwargs = _template_kwargs(
        body.get("chat_template_kwargs"), body.get("reasoning_effort")
    )
    # Earlier calls stay whatever tools and tool_choice say: agents drop
    # tools to force a final answer (docs/serve.md, "Tools").
    messages = _with_tool_history(messages, raw)
    ignored = bool(tools) and choice != "none" and not template_uses_tools(tokenizer)
    return Chat(
        messages=messages,
        tools=rendered,
        forced=_forced(rendered, choice),
        parallel=parallel,
        template_kwargs=kwargs,
        warning=IGNORED if ignored else None,
    )


def chat_messages(body: dict) -> List[dict]:
    """A body's messages as read_chat reads them (/tokenize renders these)."""
    raw = body.get("messages")
    return _with_tool_history(_read_messages(raw), raw)


def template_uses_tools(tokenizer) -> bool:
    """Whether the chat template reads a `tools` variable at all."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


# --- messages ----------------------------------------------------------------


def _read_messages(messages) -> List[dict]:
    """Chat messages as the chat template wants them ({role, content} strings)."""
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


def _with_tool_history(messages: List[dict], raw: List[dict]) -> List[dict]:
    """The {role, content} messages with the earlier turns' tool parts put
    back for the template: an assistant's `tool_calls` (arguments as
    objects, as mlx_lm.server hands them over) and a tool's `tool_call_id`
    and `name`. A 400 naming the message where a call is malformed."""
    out = []
    for j, (m, sent) in enumerate(zip(messages, raw)):
        m = dict(m)
        calls = sent.get("tool_calls")
        if sent.get("role") == "assistant" and calls is not None:
            where = f"messages[{j}].tool_calls"
            if not isinstance(calls, list):
                raise RequestError(
                    f"{where} must be a list", param=where, code="invalid_type"
                )
            m["tool_calls"] = [
                _call_for_template(c, f"{where}[{i}]") for i, c in enumerate(calls)
            ]
        for key in ("tool_call_id", "name"):
            if sent.get("role") == "tool" and isinstance(sent.get(key), str):
                m[key] = sent[key]
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


# --- tools and the template's arguments ----------------------------------------


def _check_tool_fields(tools, choice, parallel) -> None:
    """tool_choice and parallel_tool_calls, alone and against `tools`."""
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
    if parallel not in (None, True, False):
        raise RequestError(
            "'parallel_tool_calls' must be true or false",
            param="parallel_tool_calls",
            code="invalid_type",
        )


def _read_tools(tools, choice, tokenizer) -> Optional[List[dict]]:
    """The request's `tools` (OpenAI's function list), checked; None when it
    has none, `tool_choice` is "none" or the template does not render them
    (answered without them, as mlx_lm.server does: Chat.warning). A 400
    where the model renders them but cannot return its calls."""
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
        return None
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


def _forced(tools: Optional[List[dict]], choice) -> Optional[List[dict]]:
    """The tools a reply must call one of: all of them for tool_choice
    "required", the one named for a named choice (a 400 where no tool has
    that name); None where the model decides."""
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


def _template_kwargs(kwargs, effort) -> dict:
    """A chat request's `chat_template_kwargs` (mlx_lm.server's field: e.g.
    {"enable_thinking": false}), a copy, with OpenAI's `reasoning_effort`
    under its own name (gpt-oss's template reads it); {} where absent."""
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
