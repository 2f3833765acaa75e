"""Structured output for serve's routes (docs/design.md section 5g): a
request's `response_format` (OpenAI's json_object / json_schema) or its
`strict` tools become an llguidance grammar, checked while the request is
read (a 400 naming what cannot be compiled), and one GrammarProcessor per
prompt that the generation thread runs as a logits processor."""

import json
from typing import List, Optional

from ..grammar import GrammarError, json_grammar, tool_call_grammar
from .chat_body import Chat
from .schema import Request, RequestError

OVERRUN = 48  # at most, past max_tokens, to close JSON the budget cut short


def _bad(message: str, param: str, code: str = "invalid_value") -> RequestError:
    return RequestError(message, param=param, code=code)


TEXT = "text"  # format_schema's answer for plain text: no grammar


def format_schema(fmt, param: str = "response_format"):
    """What OpenAI's response_format asks for: TEXT, None (any JSON object)
    or a JSON schema (a dict); a 400 for any other shape."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return TEXT
    if kind == "json_object":
        return None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _bad(
                f"'{param}' of type json_schema needs "
                '{"json_schema": {"name", "schema": {...}}}',
                param,
            )
        return spec["schema"]
    raise _bad(
        f'\'{param}\' must be {{"type": "text"}}, {{"type": "json_object"}} or '
        f'{{"type": "json_schema", "json_schema": {{...}}}}, not '
        f"{json.dumps(fmt)[:80]}",
        param,
    )


def strict_tools(tools: Optional[List[dict]]) -> List[dict]:
    """The tools with `strict: true` (on the tool or its function)."""
    return [
        t
        for t in tools or []
        if t.get("strict") is True or t["function"].get("strict") is True
    ]


def _check_json_tools(tokenizer) -> None:
    """A 400 where the model's tool-call format is not JSON between markers."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    if not module.endswith("json_tools"):
        raise _bad(
            "'strict' tools, tool_choice \"required\" or a named tool need a "
            "model whose tool calls are JSON between markers (mlx-lm's "
            f"json_tools); this model's parser is {module or None}",
            "tools",
            "unsupported_parameter",
        )


def _grammar(tokenizer, schema, tools, special, **how) -> str:
    """The one grammar a request is held to: its tools' calls (how:
    tool_call_grammar's required and once; their parameters are compiled
    with the processor) or its response_format's JSON."""
    if tools:
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        return tool_call_grammar(tools, start, end, special, **how)
    try:
        return json_grammar(schema)
    except GrammarError as e:
        param = "response_format"
        raise _bad(f"'{param}' schema cannot be used: {e}", param, "invalid_schema")


def constrain(
    service, requests: List[Request], fmt, chat: Optional[Chat] = None
) -> None:
    """Give each request its own grammar processor, where the body asks for
    one (fmt: its response_format; a chat's strict tools, or those its
    tool_choice forces, docs/serve.md "Tools"): what is asked is checked
    first, then the one grammar compiled."""
    schema = format_schema(fmt)
    forced = chat.forced if chat is not None else None
    strict = forced or strict_tools(chat.tools if chat is not None else None)
    if strict and schema is not TEXT:
        raise _bad(
            "'response_format' and tool calls cannot be combined", "response_format"
        )
    if strict:
        _check_json_tools(service.tokenizer)
    elif schema is TEXT:
        return
    # A forced call is one unless the body says parallel_tool_calls true
    # (docs/serve.md "Tools"); else one where it says false.
    parallel = chat.parallel if chat is not None else None
    once = parallel is False or (bool(forced) and parallel is not True)
    how = dict(required=bool(forced), once=once)
    special = service.grammars.special
    grammar = _grammar(service.tokenizer, schema, strict, special, **how)
    param = "tools" if strict else "response_format"
    for r in requests:
        # Keys the schema requires may be unwritten at max_tokens: the reply
        # may run OVERRUN more to write them and close (docs/serve.md).
        left = service.settings.max_context
        left = OVERRUN if left is None else left - len(r.prompt) - r.max_tokens
        r.overrun = max(0, min(OVERRUN, left))
        try:
            r.constraint = service.grammars.processor(grammar, r.max_tokens)
        except GrammarError as e:
            raise _bad(f"'{param}' cannot be used: {e}", param, "invalid_schema")
