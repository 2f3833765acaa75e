"""Tool calls through `flashnorm-mlx serve` (#37 part 4): a tiny Qwen model
whose tokenizer has a Qwen-style tool-aware template (mlx-lm picks its
json_tools parser from it), and whose reply is forced, token by token,
through logit_bias plus a strong repetition penalty: each scripted token gets
a smaller bias than the one before, and once sampled the penalty sinks it, so
greedy decoding walks the script and then ends on <|im_end|>. The reference
is the script itself: what it says in text and in the tool call."""

import json
from dataclasses import replace

import pytest
import tiny
from serve_process import Server

from flashnorm_mlx.serve.chat_body import read_chat
from flashnorm_mlx.serve.schema import RequestError
from flashnorm_mlx.thinking import ReplySplit

# The reply, one added token each: words, then a json_tools call split over
# three tokens, so that a stream sees the call arrive in pieces.
SCRIPT = [
    "Let me look. ",
    "<tool_call>",
    '\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n',
    "</tool_call>",
]
EOS = "<|im_end|>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]

# Qwen2.5's template, cut down: tools in the system turn, earlier tool calls
# in <tool_call> tags, tool results as their own turn.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Answer a call as JSON in tool-call tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for tool_call in m.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}\n<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tool_tokenizer(path):
    """tiny.py's byte-level tokenizer with SCRIPT's tokens and TEMPLATE; the
    scripted tokens' ids, in order, then the EOS id."""
    from tokenizers import AddedToken, Tokenizer

    tiny.write_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in SCRIPT])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tok.token_to_id(t) for t in SCRIPT + [EOS]]
    assert max(ids) < tiny.VOCAB, ids
    return ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny.make_qwen(tmp_path_factory.mktemp("tools"), "qwen3_untied")
    return path, write_tool_tokenizer(path)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(str(model_dir[0]))
    yield s
    s.kill()


def forced(ids) -> dict:
    """Request fields that make greedy decoding walk `ids`, then stop."""
    return {
        "temperature": 0,
        "max_tokens": 12,
        "logit_bias": {str(t): 100 - 10 * i for i, t in enumerate(ids)},
        "repetition_penalty": 1000,
        "repetition_context_size": len(ids),
    }


def check_call(call):
    assert call["type"] == "function" and call["id"], call
    assert call["function"]["name"] == "get_weather", call
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}, call


def test_tool_call_is_parsed_into_tool_calls(server, model_dir):
    body = {"messages": ASK, "tools": TOOLS, **forced(model_dir[1])}
    status, r = server.request("POST", "/v1/chat/completions", body)
    print(json.dumps(r, indent=1))
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] == SCRIPT[0], message  # no tag text left in it
    (call,) = message["tool_calls"]
    check_call(call)
    assert r["usage"]["completion_tokens"] == len(SCRIPT) + 1, r["usage"]
    # The OpenAI SDK reads it as tool calls too.
    f = forced(model_dir[1])
    sdk = server.client().chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=f["max_tokens"],
        logit_bias=f["logit_bias"],
        extra_body={k: f[k] for k in ("repetition_penalty", "repetition_context_size")},
    )
    check_call(sdk.choices[0].message.tool_calls[0].model_dump())
    # The template rendered the tools: the same request without them is shorter.
    status, plain = server.request(
        "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 1}
    )
    assert status == 200 and (
        plain["usage"]["prompt_tokens"] + 100 < r["usage"]["prompt_tokens"]
    ), (plain["usage"], r["usage"])


def test_tool_call_streams_as_tool_calls_deltas(server, model_dir):
    import http.client

    body = {"messages": ASK, "tools": TOOLS, "stream": True, **forced(model_dir[1])}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = [
        line.decode().strip()[len("data: ") :]
        for line in resp
        if line.startswith(b"data: ")
    ]
    conn.close()
    print("\n".join(events))
    assert events[-1] == "[DONE]", events
    deltas = [json.loads(e)["choices"] for e in events[:-1]]
    deltas = [c[0] for c in deltas if c]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
    assert content == SCRIPT[0], content
    assert len(calls) == 1 and calls[0]["index"] == 0, calls
    check_call(calls[0])
    assert deltas[-1]["finish_reason"] == "tool_calls", deltas[-1]


def test_a_conversation_with_earlier_tool_calls_renders(server):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 2}
    status, r = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, r
    bad = dict(messages[1], tool_calls=[{"function": {"arguments": "{"}}])
    status, r = server.request(
        "POST", "/v1/chat/completions", {**body, "messages": [ASK[0], bad]}
    )
    assert status == 400 and r["error"]["param"] == "messages[1].tool_calls[0]", r


CALLED = [
    ASK[0],
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_tool_history_is_kept_without_tools(server, tokenizer):
    """An agent drops `tools` (or says "none") to force a final answer: the
    earlier call still renders, as the template renders it with the call."""
    called = [dict(m) for m in CALLED]
    call = called[1]["tool_calls"][0]
    called[1]["tool_calls"] = [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    want = tokenizer.apply_chat_template(called, add_generation_prompt=True)
    status, r = server.request("POST", "/tokenize", {"messages": CALLED})
    assert status == 200 and r["tokens"] == list(want), (r, len(want))
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        body = {"messages": CALLED, "max_tokens": 1, **extra}
        status, r = server.request("POST", "/v1/chat/completions", body)
        assert status == 200, r
        assert r["usage"]["prompt_tokens"] == len(want), (extra, r["usage"], len(want))


def test_malformed_arguments_in_the_history_are_400_on_every_route(server):
    bad = [dict(m) for m in CALLED]
    bad[1] = {**bad[1], "tool_calls": [{**CALLED[1]["tool_calls"][0]}]}
    bad[1]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": "{"}
    status, r = server.request(
        "POST", "/v1/chat/completions", {"messages": bad, "max_tokens": 1}
    )
    where = "messages[1].tool_calls[0].function.arguments"
    assert status == 400 and r["error"]["param"] == where, r
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": "Paris"}
    turns = [ASK[0], {"role": "assistant", "content": [use]}]
    status, r = server.request(
        "POST", "/v1/messages", {"system": "S", "messages": turns, "max_tokens": 1}
    )
    assert status == 400 and r["type"] == "error", r  # Anthropic's shape
    # The turn as the client numbered it (the system prompt is no turn).
    assert "messages[1]: a tool_use" in r["error"]["message"], r
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
    ]
    status, r = server.request("POST", "/v1/responses", {"input": items})
    assert status == 400 and r["error"]["param"] == "input[1].arguments", r


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "always"}, "tool_choice"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": "get_weather"}, "tools"),
    ],
)
def test_bad_tool_fields_are_400(server, extra, param):
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 1, **extra}
    status, r = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and r["error"]["param"] == param, r


def test_tool_grammars_that_cannot_be_made_are_400(server):
    """structured.constrain: a grammar for strict tools and response_format
    at once, and tool parameters llguidance cannot compile (with the
    request's grammar processor)."""
    strict = {**TOOLS[0], "strict": True}
    bad = {"type": "object", "if": {"type": "object"}, "then": {}}
    uncompiled = {**strict, "function": {**TOOLS[0]["function"], "parameters": bad}}
    for extra, param, said in (
        ({"response_format": {"type": "json_object"}}, "response_format", "combined"),
        ({"tools": [uncompiled]}, "tools", "'tools' cannot be used"),
    ):
        body = {"messages": ASK, "tools": [strict], "max_tokens": 1, **extra}
        status, r = server.request("POST", "/v1/chat/completions", body)
        assert status == 400 and r["error"]["param"] == param, r
        assert said in r["error"]["message"], r


# --- the pieces, in-process: no server ----------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model_dir[0])


def test_calls_split_anywhere_in_the_text_are_found(tokenizer):
    """The reply's text cut at every point into two pieces: the same content
    and call each time (a marker may arrive split over pieces)."""
    text = "".join(SCRIPT) + " done"
    for cut in range(len(text) + 1):
        tc = ReplySplit(tokenizer, TOOLS, streaming=True, thought=False)
        _, a, calls_a = tc.feed(text[:cut])
        _, b, calls_b = tc.feed(text[cut:], final=True)
        assert a + b == SCRIPT[0] + " done", (cut, a, b)
        (call,) = calls_a + calls_b
        check_call(call)
        assert tc.finish_reason("stop") == "tool_calls"
        assert tc.finish_reason("length") == "length"


def test_an_unclosed_call_at_the_end_is_still_parsed(tokenizer):
    tc = ReplySplit(tokenizer, TOOLS, streaming=False, thought=False)
    _, content, calls = tc.feed("".join(SCRIPT[:4]), final=True)
    assert content == SCRIPT[0] and len(calls) == 1, (content, calls)
    check_call(calls[0])


class _NoTools:
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    has_chat_template = True
    has_tool_calling = False


class _ToolsNoParser(_NoTools):
    chat_template = "{{ tools | tojson }}{% for m in messages %}{% endfor %}"


def _chat(tokenizer, **fields):
    return read_chat({"messages": ASK, **fields}, tokenizer)


def test_models_whose_template_renders_tools_without_a_parser_refuse_them():
    with pytest.raises(RequestError) as e:
        _chat(_ToolsNoParser(), tools=TOOLS)
    assert "no parser" in e.value.message and e.value.status == 400, e.value.message
    assert _chat(_ToolsNoParser(), tools=TOOLS, tool_choice="none").tools is None
    assert _chat(_ToolsNoParser()).tools is None


def test_tools_to_a_template_without_them_are_dropped_with_a_warning():
    """As mlx_lm.server: answered without them (agents send tools every turn)."""
    chat = _chat(_NoTools(), tools=TOOLS)
    assert chat.tools is None and "ignored" in chat.warning, chat
    assert _chat(_ToolsNoParser(), tools=TOOLS, tool_choice="none").warning is None
    assert _chat(_NoTools()).warning is None


def test_forced_tools_need_a_json_tool_call_format():
    from types import SimpleNamespace

    from flashnorm_mlx.serve.structured import constrain

    chat = _chat(_NoTools(), tools=TOOLS)
    forced = replace(chat, tools=TOOLS, forced=TOOLS)  # as a template with tools
    with pytest.raises(RequestError) as e:
        constrain(SimpleNamespace(tokenizer=_NoTools()), [], None, forced)
    assert (e.value.param, e.value.code) == ("tools", "unsupported_parameter"), e


def test_tool_choice_forces_the_tools_it_names(tokenizer):
    """The Chat record's forced tools: all for "required", the one named;
    a name not in `tools` is the 400 it always was (message, param, code)."""
    other = {"type": "function", "function": {"name": "t"}}
    tools = [other, *TOOLS]
    assert _chat(tokenizer, tools=tools).forced is None
    assert _chat(tokenizer, tools=tools, tool_choice="required").forced == tools
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = _chat(tokenizer, tools=tools, tool_choice=named, parallel_tool_calls=True)
    assert chat.forced == TOOLS and chat.parallel is True, chat
    with pytest.raises(RequestError) as e:
        _chat(tokenizer, tools=tools, tool_choice={**named, "function": {"name": "f"}})
    got = (e.value.message, e.value.param, e.value.code, e.value.status)
    want = "'tool_choice' names 'f', which is not in 'tools'"
    assert got == (want, "tool_choice", "invalid_value", 400), got


# --- strict tools: the call's arguments held to the parameters (#47) -----------


STRICT_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strict_tools_constrain_the_calls_arguments(server, model_dir, seed):
    """The random tiny model is pushed into a call (logit bias on <tool_call>),
    then samples at temperature 1: with strict, every call it makes parses
    and fits the parameters; without, the same start gives none that does."""
    import jsonschema

    start = model_dir[1][1]  # <tool_call>'s id
    tool = {
        **TOOLS[0],
        "function": {**TOOLS[0]["function"], "parameters": STRICT_PARAMS},
    }
    body = {
        "messages": ASK,
        "max_tokens": 80,  # byte-level: a call is some 60 tokens
        "temperature": 1.0,
        "seed": seed,
        "logit_bias": {str(start): 100},
    }
    replies = {}
    for strict in (True, False):
        t = {**tool, "function": {**tool["function"], "strict": strict}}
        status, r = server.request(
            "POST", "/v1/chat/completions", {**body, "tools": [t]}
        )
        print(strict, json.dumps(r)[:600])
        assert status == 200, r
        replies[strict] = r["choices"][0]["message"].get("tool_calls") or []
    assert replies[True], "no call made under strict"
    for call in replies[True]:
        assert call["function"]["name"] == "get_weather", call
        jsonschema.validate(json.loads(call["function"]["arguments"]), STRICT_PARAMS)

    def fits(call):
        try:
            jsonschema.validate(
                json.loads(call["function"]["arguments"]), STRICT_PARAMS
            )
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    assert not any(fits(c) for c in replies[False]), replies[False]


def test_model_is_the_folders_name_not_its_path(server, model_dir):
    """Served from an absolute folder path: answers name the folder only."""
    status, r = server.request(
        "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 1}
    )
    assert status == 200 and r["model"] == model_dir[0].name, r["model"]
    status, r = server.request("GET", "/v1/models")
    assert r["data"][0]["id"] == model_dir[0].name, r


# --- the same calls through Anthropic's and OpenAI's agent APIs (#47) ----------


def test_anthropic_tool_use_and_tool_result_blocks(server, model_dir):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
    f = forced(model_dir[1])
    m = client.messages.create(
        model="tiny",
        max_tokens=f["max_tokens"],
        messages=ASK,
        tools=[tool],
        extra_body={k: f[k] for k in f if k != "max_tokens"},
    )
    print(m)
    assert m.stop_reason == "tool_use", m
    text, use = m.content
    assert text.text == SCRIPT[0] and use.type == "tool_use", m.content
    assert use.name == "get_weather" and use.input == {"city": "Paris"}, use
    with client.messages.stream(
        model="tiny",
        max_tokens=f["max_tokens"],
        messages=ASK,
        tools=[tool],
        extra_body={k: f[k] for k in f if k != "max_tokens"},
    ) as s:
        final = s.get_final_message()
    assert final.content[1].input == {"city": "Paris"}, final
    assert final.stop_reason == "tool_use", final
    # The call and its result go back as blocks, rendered by the template.
    turns = ASK + [
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}
            ],
        },
    ]
    more = client.messages.create(model="tiny", max_tokens=2, messages=turns)
    assert more.usage.input_tokens + more.usage.cache_read_input_tokens > len(
        "Sunny"
    ), more.usage


def test_responses_function_call_items(server, model_dir):
    f = forced(model_dir[1])
    fn = TOOLS[0]["function"]
    r = server.client().responses.create(
        model="tiny",
        input=ASK,
        max_output_tokens=f["max_tokens"],
        tools=[{"type": "function", **fn}],
        extra_body={k: f[k] for k in f if k != "max_tokens"},
    )
    print(r)
    message, call = r.output
    assert message.content[0].text == SCRIPT[0], r.output
    assert call.type == "function_call" and call.name == "get_weather", call
    assert json.loads(call.arguments) == {"city": "Paris"}, call
    events = list(
        server.client().responses.create(
            model="tiny",
            input=ASK,
            max_output_tokens=f["max_tokens"],
            tools=[{"type": "function", **fn}],
            extra_body={k: f[k] for k in f if k != "max_tokens"},
            stream=True,
        )
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["message", "function_call"], done
    assert json.loads(done[1].arguments) == {"city": "Paris"}, done
    # A client that joins the deltas gets the same arguments (sent whole: one).
    deltas = [e.delta for e in events if e.type.endswith("arguments.delta")]
    assert json.loads("".join(deltas)) == {"city": "Paris"}, deltas
    # The call and its output go back as items.
    status, r2 = server.request(
        "POST",
        "/v1/responses",
        {
            "input": ASK
            + [
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            ],
            "max_output_tokens": 2,
        },
    )
    assert status == 200 and r2["status"] in ("completed", "incomplete"), r2


def _call_fits(call, name="get_weather") -> bool:
    import jsonschema

    try:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, STRICT_PARAMS)
    except (ValueError, jsonschema.ValidationError):
        return False
    return call.function.name == name


def test_required_tool_choice_gives_one_valid_call_every_seed(server):
    """tool_choice "required" with one function, the random model sampling at
    temperature 1 (no logit bias), 10 seeds at once through the openai SDK:
    each reply is exactly one call, its arguments valid for the schema."""
    from concurrent.futures import ThreadPoolExecutor

    tool = {
        **TOOLS[0],
        "function": {**TOOLS[0]["function"], "parameters": STRICT_PARAMS},
    }
    client = server.client()

    def ask(seed):
        return client.chat.completions.create(
            model="m",
            messages=ASK,
            tools=[tool],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        ).choices[0]

    with ThreadPoolExecutor(10) as pool:
        choices = list(pool.map(ask, range(10)))
    for seed, c in enumerate(choices):
        print(seed, c.message.content, c.message.tool_calls)
    assert [len(c.message.tool_calls or []) for c in choices] == [1] * 10, choices
    assert all(_call_fits(c.message.tool_calls[0]) for c in choices), choices
    assert all(c.finish_reason == "tool_calls" for c in choices), choices
    # Said explicitly, parallel calls are let through: still calls only, each valid.
    r = client.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=True,
        temperature=1.0,
        seed=5,  # two calls at this seed
        max_tokens=120,
    )
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 2 and all(map(_call_fits, calls)), r
    assert r.choices[0].message.content == "", r


def test_a_named_tool_is_the_one_called_and_parallel_false_gives_one(server):
    other = {"type": "function", "function": {"name": "t"}}  # the context is 512
    tool = {
        **TOOLS[0],
        "function": {**TOOLS[0]["function"], "parameters": STRICT_PARAMS},
    }
    client = server.client()
    for seed in range(2):
        r = client.chat.completions.create(
            model="m",
            messages=ASK,
            tools=[other, tool],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=80,
        )
        calls = r.choices[0].message.tool_calls
        assert calls and len(calls) == 1 and _call_fits(calls[0]), r


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    """Without a grammar (auto, not strict), the reply is cut to one call:
    Service.parse carries the body's parallel_tool_calls (its Chat record)
    to the Request that reply_split reads. No worker: parse only."""
    from flashnorm_mlx.serve.bounds import bytes_per_token
    from flashnorm_mlx.serve.schema import Settings
    from flashnorm_mlx.serve.service import Service
    from flashnorm_mlx.serve.split import reply_split

    settings = Settings(max_context=512)
    service = Service(None, "m", settings, worker=lambda *a: None)
    service.tokenizer, service.vocab_size = tokenizer, tiny.VOCAB
    service.bytes_per_token = bytes_per_token(tokenizer)
    text = "".join(SCRIPT) + "".join(SCRIPT[1:])
    for parallel, n in ((None, 2), (True, 2), (False, 1)):
        body = {"messages": ASK, "tools": TOOLS, "parallel_tool_calls": parallel}
        (request,) = service.parse("chat", body)
        _, content, calls = reply_split(service, request, False).feed(text, True)
        assert content == SCRIPT[0] and len(calls) == n, (parallel, calls)


def test_forced_tools_on_the_anthropic_and_responses_routes(server):
    import anthropic

    tool = {"name": "get_weather", "input_schema": STRICT_PARAMS}
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    m = client.messages.create(
        model="m",
        max_tokens=80,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 1.0, "seed": 3},
    )
    assert [b.type for b in m.content] == ["tool_use"], m.content
    assert m.content[0].name == "get_weather" and m.stop_reason == "tool_use", m
    r = server.client().responses.create(
        model="m",
        input="Weather in Paris?",
        max_output_tokens=80,
        tools=[{"type": "function", **tool, "parameters": STRICT_PARAMS}],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=1.0,
        extra_body={"seed": 3},
    )
    assert [o.type for o in r.output] == ["function_call"], r.output
    assert r.output[0].name == "get_weather", r.output


# --- n choices, decoded as one batch (#57 part 5) ---------------------------------


def test_n_choices_greedy_equal_seeded_reproducible(server):
    client = server.client()
    ask = dict(model="m", messages=ASK, max_tokens=6)
    one = client.chat.completions.create(**ask, temperature=0)
    greedy = client.chat.completions.create(**ask, temperature=0, n=3)
    texts = [c.message.content for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2], greedy
    assert texts == [one.choices[0].message.content] * 3, (texts, one)
    # Usage as OpenAI counts n: the prompt once, every choice's tokens.
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens, greedy.usage
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.model_extra["timings"]["batch_max"] == 3, greedy  # one batch
    seeded = [
        client.chat.completions.create(**ask, temperature=1.0, seed=7, n=3)
        for _ in range(2)
    ]
    a, b = ([c.message.content for c in r.choices] for r in seeded)
    assert a == b and len(set(a)) == 3, (a, b)  # each choice its own stream
    # The first choice is the seed's own (n=1 gives it too).
    alone = client.chat.completions.create(**ask, temperature=1.0, seed=7)
    assert alone.choices[0].message.content == a[0], (alone, a)
    # Streamed: each choice's chunks by index, usage once at the end.
    stream = client.chat.completions.create(
        **ask, temperature=0, n=3, stream=True, stream_options={"include_usage": True}
    )
    got, usage = ["", "", ""], None
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert got == texts, (got, texts)
    assert usage.prompt_tokens == one.usage.prompt_tokens, usage
    assert usage.completion_tokens == greedy.usage.completion_tokens, usage
    status, r = server.request(
        "POST", "/v1/completions", {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 2}
    )
    assert status == 200 and len(r["choices"]) == 4, r
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3], r


# --- --chat-template with tools (#57 part 6) ---------------------------------------


def test_a_template_given_on_the_command_line_brings_its_tool_parser(
    model_dir, tmp_path
):
    """The model's own template (ChatML) has no tools; --chat-template gives
    Qwen's: its tool calls are parsed (the parser mlx-lm infers from it)."""
    import shutil

    from mlx_lm.utils import load_tokenizer

    from flashnorm_mlx.chat_template import set_template

    plain = shutil.copytree(model_dir[0], tmp_path / "plain")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config["chat_template"] = (  # tiny.py's ChatML
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(plain)
    assert not tok.has_tool_calling
    set_template(tok, TEMPLATE)
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>", tok
    s = Server(str(plain), "--chat-template", TEMPLATE)
    try:
        body = {"messages": ASK, "tools": TOOLS, **forced(model_dir[1])}
        status, r = s.request("POST", "/v1/chat/completions", body)
    finally:
        s.kill()
    assert status == 200, r
    (call,) = r["choices"][0]["message"]["tool_calls"]
    check_call(call)


# --- a strict reply cut by max_tokens still closes (#57 part 7) ---------------------

ABC = {
    "type": "object",
    "required": ["a", "b", "c"],
    "additionalProperties": False,
    "properties": {k: {"type": "string"} for k in "abc"},
}


def test_a_schema_reply_cut_by_max_tokens_still_writes_its_required_keys(server):
    """16 tokens hold one key of the random model's strings (0 of 10 parsed
    before): the reply runs past max_tokens to write the keys it owes and
    close, and says it was cut (finish_reason length)."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "abc", "schema": ABC}}

    def ask(seed):
        body = {"messages": ASK, "max_tokens": 16, "temperature": 1.0, "seed": seed}
        status, r = server.request(
            "POST", "/v1/chat/completions", {**body, "response_format": fmt}
        )
        assert status == 200, r
        return r

    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(ask, range(10)))
    for r in replies:
        text, made = r["choices"][0]["message"]["content"], r["usage"]
        print(repr(text), made["completion_tokens"], r["choices"][0]["finish_reason"])
        jsonschema.validate(json.loads(text), ABC)
        assert 16 < made["completion_tokens"] <= 16 + 48, made
        assert r["choices"][0]["finish_reason"] == "length", r
