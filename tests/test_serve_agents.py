"""serve for agents (#47) on the embedded SmolLM2, one server for the module:
structured output (response_format json_object / json_schema, checked with
`jsonschema`), Anthropic's Messages API through the official `anthropic`
SDK, OpenAI's Responses API through the `openai` SDK (both against chat
completions' greedy text on the same server), and the request shapes
mlx_lm.server's clients send."""

import json
import threading

import anthropic
import jsonschema
import openai
import pytest
from serve_process import Server

KEY = "sk-agents-test"
# A short system message: SmolLM2's default one is ~14 tokens more a request.
ASK = [
    {"role": "system", "content": "JSON only."},
    {"role": "user", "content": "Describe a cat as JSON: an id, a name, tags."},
]
HI = [{"role": "user", "content": "Say hello in five words."}]
CAT = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 12},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "maxItems": 2,
        },
    },
    "required": ["id", "name", "tags"],
    "additionalProperties": False,
}
OTHERS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
]


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--decode-concurrency", "10", api_key=KEY)
    yield s
    s.kill()


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


def chat(server, timeout=120, **body):
    return server.client(timeout=timeout).chat.completions.create(
        model="smol", **{"messages": HI, "max_tokens": 12, "temperature": 0, **body}
    )


def parallel(fn, args):
    """fn(*a) for each a on its own thread; the results in order."""
    out = [None] * len(args)

    def run(i):
        try:
            out[i] = fn(*args[i])
        except Exception as e:  # shown by the caller's assert
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1200)
    return out


# --- structured output -------------------------------------------------------------


def _json_reply(server, response_format, seed, max_tokens=80, messages=ASK):
    r = chat(
        server,
        timeout=900,  # nine at once on a busy 2-core CPU
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.7,
        seed=seed,
        response_format=response_format,
    )
    c = r.choices[0]
    u = r.usage
    return (
        c.message.content,
        c.finish_reason,
        u.prompt_tokens_details.cached_tokens,
        u.completion_tokens,
    )


def _ten_seeds(server, response_format, max_tokens=80):
    """[(text, finish_reason, cached prompt tokens, tokens)] for seeds 0-9: seed 0
    alone, then 1-9 together in one batch, their prompt read from the cache
    seed 0 left (one prefill, not ten: each costs ~0.11 s a token here)."""
    first = _json_reply(server, response_format, 0, max_tokens)
    rest = parallel(
        lambda s: _json_reply(server, response_format, s, max_tokens),
        [(s,) for s in range(1, 10)],
    )
    return [first] + rest


@pytest.mark.slow
def test_json_schema_fits_for_10_seeds_at_temperature_0_7(server):
    got = _ten_seeds(server, fmt(CAT))
    for seed, reply in enumerate(got):
        print(seed, reply)
        assert not isinstance(reply, Exception), reply
        text, finish = reply[:2]
        assert finish == "stop", (seed, text)
        jsonschema.validate(json.loads(text), CAT)
    assert all(r[2] > 0 for r in got[1:]), got  # the batch began from the cache


@pytest.mark.slow
def test_json_object_parses_for_10_seeds(server):
    """A budget of 28 tokens, which SmolLM2's objects at 0.7 often run up
    to: those the grammar closes as the budget ends (grammar.py's
    CLOSE_WINDOW), and every one still parses and ends by itself."""
    got = _ten_seeds(server, {"type": "json_object"}, 28)
    for seed, reply in enumerate(got):
        print(seed, reply)
        assert not isinstance(reply, Exception), reply
        assert reply[1] == "stop", (seed, reply)
        assert isinstance(json.loads(reply[0]), dict), (seed, reply)
    closed = [r for r in got if r[3] >= 28 - 4]  # ended at the budget's edge
    assert closed, [r[3] for r in got]


@pytest.mark.slow
def test_four_schemas_concurrently_joining_at_different_times(server):
    """Each request joins once the one before it is decoding (its first
    streamed piece), so the batch grows under running matchers, and shrinks
    as each ends."""
    schemas = [CAT] + OTHERS
    started = [threading.Event() for _ in schemas]
    results = [None] * len(schemas)

    def run(i):
        if i:
            started[i - 1].wait(300)
        stream = server.client(timeout=600).chat.completions.create(
            model="smol",
            messages=ASK,
            max_tokens=80,
            temperature=0.7,
            seed=100 + i,
            response_format=fmt(schemas[i]),
            stream=True,
        )
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if text:
                started[i].set()
        started[i].set()
        results[i] = (text, finish)

    parallel(run, [(i,) for i in range(len(schemas))])
    for schema, reply in zip(schemas, results):
        print(reply)
        assert reply is not None and reply[1] == "stop", reply
        jsonschema.validate(json.loads(reply[0]), schema)


def test_unsupported_schemas_are_400_naming_the_feature(server):
    bad = {"type": "object", "if": {"type": "object"}, "then": {}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, response_format=fmt(bad))
    err = e.value.body
    print(err)
    assert err["param"] == "response_format" and '"if"' in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, response_format={"type": "xml"})
    assert "json_schema" in e.value.body["message"], e.value.body


# --- Anthropic's Messages API ------------------------------------------------------

N = 6  # greedy tokens compared across the APIs (each ~0.11 s here)


def claude(server, key=KEY):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def test_messages_create_and_stream_give_chat_completions_greedy_text(server):
    want = chat(server, max_tokens=N)
    text, usage = want.choices[0].message.content, want.usage
    for system in (None, "You are brief."):
        extra = {"system": system} if system else {}
        ref = chat(
            server,
            max_tokens=N,
            messages=([{"role": "system", "content": system}] if system else []) + HI,
        )
        m = claude(server).messages.create(
            model="smol", max_tokens=N, messages=HI, **extra
        )
        print(m)
        assert m.model == "smol" and m.content[0].text == ref.choices[0].message.content
        u = ref.usage
        assert m.usage.output_tokens == u.completion_tokens, (m.usage, u)
        assert (
            m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
            == u.prompt_tokens
        )
        assert (
            m.stop_reason
            == {"length": "max_tokens", "stop": "end_turn"}[
                ref.choices[0].finish_reason
            ]
        )
    with claude(server).messages.stream(model="smol", max_tokens=N, messages=HI) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    print(pieces, final)
    assert "".join(pieces) == text == final.content[0].text, (pieces, text)
    assert final.usage.output_tokens == usage.completion_tokens, final.usage
    assert (
        final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
        == usage.prompt_tokens
    )
    assert (
        final.stop_reason == "max_tokens"
        if want.choices[0].finish_reason == "length"
        else "end_turn"
    )


def test_messages_multi_turn_stop_sequences_and_end_turn(server):
    turns = HI + [
        {"role": "assistant", "content": "Hello there, friend!"},
        {"role": "user", "content": "Now count to five."},
    ]
    ref = chat(server, messages=turns, max_tokens=40)
    text = ref.choices[0].message.content
    m = claude(server).messages.create(model="smol", max_tokens=40, messages=turns)
    print(repr(text), m)
    assert m.content[0].text == text
    assert m.stop_reason == (
        "end_turn" if ref.choices[0].finish_reason == "stop" else "max_tokens"
    )
    # A stop sequence from the middle of that reply: cut there, and named.
    word = text.split()[2]
    m = claude(server).messages.create(
        model="smol", max_tokens=40, messages=turns, stop_sequences=[word]
    )
    print(m)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word, m
    assert m.content[0].text == text[: text.index(word)], m


def test_messages_errors_have_anthropics_shape_and_x_api_key(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(server, key="wrong").messages.create(
            model="s", max_tokens=2, messages=HI
        )
    assert e.value.body["error"]["type"] == "authentication_error", e.value.body
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(server).messages.create(model="s", max_tokens=0, messages=HI)
    body = e.value.body
    print(body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"], body


def test_messages_tools_on_a_template_without_them_still_answer(server):
    """SmolLM2's template has no tools: answered as mlx_lm.server does, text only."""
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    m = claude(server).messages.create(
        model="s", max_tokens=4, messages=HI, tools=[tool]
    )
    assert m.content and m.content[0].type == "text", m


# --- OpenAI's Responses API --------------------------------------------------------


def test_responses_create_streamed_and_not_give_chat_completions_greedy_text(server):
    ref = chat(
        server, max_tokens=N, messages=[{"role": "system", "content": "Be kind."}] + HI
    )
    text = ref.choices[0].message.content
    c = server.client()
    r = c.responses.create(
        model="smol",
        input=HI[0]["content"],
        instructions="Be kind.",
        max_output_tokens=N,
    )
    print(r)
    assert r.output_text == text and r.model == "smol", r
    assert r.usage.output_tokens == ref.usage.completion_tokens
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    r = c.responses.create(
        model="smol", input=HI, instructions="Be kind.", max_output_tokens=N
    )
    assert r.output_text == text, r
    events = list(
        c.responses.create(
            model="smol",
            input=HI,
            instructions="Be kind.",
            max_output_tokens=N,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    print(kinds)
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text and events[-1].response.output_text == text, (deltas, text)
    with c.responses.stream(
        model="smol", input=HI, instructions="Be kind.", max_output_tokens=N
    ) as s:  # the SDK's helper (its final response needs a completed reply)
        got = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    assert got == text, (got, text)


def test_responses_text_format_and_previous_response_id(server):
    c = server.client()
    r = c.responses.create(
        model="smol",
        input=ASK[1]["content"],
        instructions=ASK[0]["content"],
        max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "cat", "schema": CAT}},
    )
    print(r.output_text)
    jsonschema.validate(json.loads(r.output_text), CAT)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="smol", input="hi", previous_response_id="resp_1")
    assert "previous_response_id" in e.value.body["message"], e.value.body


# --- where mlx_lm.server's clients trip -------------------------------------------

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def test_tools_to_a_template_without_them_are_answered_with_a_warning(server):
    """mlx_lm.server's shape: tools on every turn, to a model that has none."""
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}},
        }
    ]
    body = {"model": "m", "messages": HI, "tools": tools, "max_tokens": 3}
    status, r = server.request("POST", "/v1/chat/completions", body, AUTH)
    print(r)
    assert status == 200 and "tools" in r["warning"], r
    assert any("tools" in line and "WARNING" in line.upper() for line in server.lines)


@pytest.mark.parametrize("logprobs", [True, 2])
def test_completions_take_logprobs_true_and_an_integer(server, logprobs):
    body = {"model": "m", "prompt": "Hello", "max_tokens": 3, "logprobs": logprobs}
    status, r = server.request("POST", "/v1/completions", body, AUTH)
    print(r)
    assert status == 200, r
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == r["usage"]["completion_tokens"], lp
    assert all(len(t) == (1 if logprobs is True else 2) for t in lp["top_logprobs"]), lp


def test_chat_completions_without_v1_is_served(server):
    body = {"messages": HI, "max_tokens": 3, "temperature": 0}
    status, r = server.request("POST", "/chat/completions", body, AUTH)
    assert status == 200 and r["choices"][0]["message"]["content"], r
    ref = chat(server, max_tokens=3)
    assert r["choices"][0]["message"]["content"] == ref.choices[0].message.content


def test_model_echoes_the_request_or_the_command_lines_name(server):
    body = {"model": "my-model", "messages": HI, "max_tokens": 2}
    status, r = server.request("POST", "/v1/chat/completions", body, AUTH)
    assert status == 200 and r["model"] == "my-model", r
    del body["model"]
    status, r = server.request("POST", "/v1/chat/completions", body, AUTH)
    assert status == 200 and r["model"] == "SmolLM2-135M-Instruct.Q4_1", r
    assert "/" not in r["model"], r
