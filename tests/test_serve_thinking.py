"""Thinking models through `flashnorm-mlx serve` (#57 part 1): a tiny Qwen3
whose vocabulary has <think> and </think> and whose template opens a thought
(as Qwen3's does), its reply forced token by token as test_serve_tools forces
one. The reference is mlx_lm.server itself, run on the same checkpoint with
the same request: the thought and the answer must come apart as it splits
them, plain and streamed. The Anthropic and Responses shapes are read through
the official SDKs."""

import json
import socket
import subprocess
import sys
import threading

import anthropic
import pytest
import tiny
from serve_process import REQUEST_TIMEOUT, START_TIMEOUT, Server
from test_serve_tools import forced

# The reply, one added token each: a thought, its end, the answer.
SCRIPT = ["Let me think.", "</think>", "\n\nHi there."]
THOUGHT, ANSWER = SCRIPT[0], SCRIPT[2]
EOS = "<|im_end|>"
ASK = [{"role": "user", "content": "Hello?"}]
# ChatML whose generation prompt opens a thought, or writes an empty one
# where enable_thinking is false (Qwen3's); reasoning_effort in a system line.
TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\n"
    "Reasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


def write_thinking_tokenizer(path):
    """tiny.py's tokenizer with <think>, </think>, SCRIPT's tokens and
    TEMPLATE; the scripted tokens' ids, then the EOS id."""
    from tokenizers import AddedToken, Tokenizer

    tiny.write_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    added = ["<think>"] + [t for t in SCRIPT]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tok.token_to_id(t) for t in SCRIPT + [EOS]]
    assert max(ids) < tiny.VOCAB, ids
    return ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import mlx.core as mx

    path = tiny.make_qwen(tmp_path_factory.mktemp("thinking"), "qwen3_untied")
    # mlx_lm.load (the reference's) refuses the rotary buffer tiny.py writes.
    weights = mx.load(str(path / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if "rotary_emb" not in k}
    mx.save_safetensors(str(path / "model.safetensors"), kept)
    return path, write_thinking_tokenizer(path)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(str(model_dir[0]))
    yield s
    s.kill()


def test_count_tokens_is_what_messages_bills(server):
    """anthropic's messages.count_tokens: the input tokens messages.create
    reports (first in the module: nothing cached yet, so all of them)."""
    client = anthropic.Anthropic(
        base_url=server.url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT
    )
    ask = dict(model="m", system="Count me.", messages=ASK)
    counted = client.messages.count_tokens(**ask).input_tokens
    made = client.messages.create(**ask, max_tokens=1).usage
    assert made.cache_read_input_tokens == 0, made
    assert counted == made.input_tokens > 10, (counted, made)
    # Every Anthropic path answers errors in Anthropic's shape.
    for method, path, body in (
        ("POST", "/v1/messages/count_tokens", {"messages": "hi"}),
        ("POST", "/v1/messages/nope", {}),
        ("GET", "/v1/messages/count_tokens", None),
        ("DELETE", "/v1/messages", None),
    ):
        status, r = server.request(method, path, body)
        assert status >= 400 and r["type"] == "error", (path, status, r)
        assert set(r["error"]) == {"type", "message"}, (path, r)


class MlxLmServer(Server):
    """`python -m mlx_lm.server` on the same checkpoint: the reference. It
    takes no port 0, so a free one is picked; ready at its 'Starting httpd'."""

    def __init__(self, model):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.api_key = "none"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm.server", "--model", str(model)]
            + ["--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines, self.ready = [], threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if not self.ready.wait(START_TIMEOUT) or self.proc.poll() is not None:
            self.kill()
            pytest.fail(f"mlx_lm.server did not start:\n{self.log()}")

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "Starting httpd" in line:
                self.ready.set()
        self.ready.set()


def stream_chat(server, body) -> list:
    """The data events of a streamed chat completion, parsed ([DONE] left out)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = [line.decode().strip()[6:] for line in resp if line.startswith(b"data: ")]
    conn.close()
    assert events[-1] == "[DONE]", events
    return [json.loads(e) for e in events[:-1]]


def joined(events) -> dict:
    """A stream's deltas joined: {reasoning, content}."""
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    return {
        k: "".join(d.get(k) or "" for d in deltas)
        for k in ("reasoning", "reasoning_content", "content")
    }


def test_thought_splits_as_mlx_lm_server_plain_and_streamed(server, model_dir):
    body = {"messages": ASK, **forced(model_dir[1])}
    reference = MlxLmServer(model_dir[0])
    try:
        status, want = reference.request("POST", "/v1/chat/completions", body)
        assert status == 200, (want, reference.log())
        want_stream = joined(stream_chat(reference, {**body, "stream": True}))
    finally:
        reference.kill()
    status, got = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, got
    print(json.dumps({"mlx_lm.server": want, "serve": got}, indent=1))
    w, g = want["choices"][0]["message"], got["choices"][0]["message"]
    assert (g["reasoning"], g["content"]) == (w["reasoning"], w["content"]), (g, w)
    assert (g["reasoning"], g["content"]) == (THOUGHT, ANSWER), g  # not empty
    assert g["reasoning_content"] == g["reasoning"], g
    usage = got["usage"]
    assert usage["completion_tokens"] == len(SCRIPT) + 1, usage
    # The thought and its end marker, as mlx-lm counts tokens.
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 2, usage
    events = stream_chat(server, {**body, "stream": True})
    g = joined(events)
    assert (g["reasoning"], g["content"]) == (
        want_stream["reasoning"],
        want_stream["content"],
    ), (g, want_stream)
    assert g["reasoning_content"] == g["reasoning"] == THOUGHT, g
    # The openai SDK reads the message and its extra field.
    sdk = server.client().chat.completions.create(
        messages=ASK,
        model="m",
        max_tokens=body["max_tokens"],
        logit_bias=body["logit_bias"],
        temperature=0,
        extra_body={
            k: body[k] for k in ("repetition_penalty", "repetition_context_size")
        },
    )
    message = sdk.choices[0].message
    assert message.content == ANSWER and message.reasoning == THOUGHT, message


def test_no_thought_where_thinking_is_off(server, model_dir):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    body = {"messages": ASK, **forced(model_dir[1]), **off}
    status, r = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, r
    message = r["choices"][0]["message"]
    # The prompt's own </think> sinks under the penalty: the order moves.
    assert "reasoning" not in message, r
    assert THOUGHT in message["content"] and ANSWER in message["content"], r
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0, r
    client = anthropic.Anthropic(
        base_url=server.url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT
    )
    m = client.messages.create(
        model="m",
        max_tokens=12,
        messages=ASK,
        thinking={"type": "disabled"},
        extra_body=_sampler(model_dir),
    )
    assert [b.type for b in m.content] == ["text"], m.content


def _sampler(model_dir) -> dict:
    f = forced(model_dir[1])
    return {
        k: f[k] for k in ("logit_bias", "repetition_penalty", "repetition_context_size")
    }


def test_anthropic_thinking_block_plain_and_streamed(server, model_dir):
    client = anthropic.Anthropic(
        base_url=server.url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT
    )
    ask = dict(model="m", max_tokens=12, messages=ASK)
    m = client.messages.create(**ask, extra_body=_sampler(model_dir))
    assert [b.type for b in m.content] == ["thinking", "text"], m.content
    assert (m.content[0].thinking, m.content[1].text) == (THOUGHT, ANSWER), m
    with client.messages.stream(**ask, extra_body=_sampler(model_dir)) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"], final.content
    assert final.content[0].thinking == THOUGHT, final.content
    assert final.content[1].text == ANSWER, final.content
    assert "thinking" in kinds and "signature" in kinds, kinds  # as Anthropic streams
    # A thought in the history is taken (and left to the template).
    history = ASK + [
        {
            "role": "assistant",
            "content": [m.content[0].model_dump(), {"type": "text", "text": "Hi"}],
        },
        {"role": "user", "content": "Again?"},
    ]
    again = client.messages.create(**{**ask, "messages": history, "max_tokens": 1})
    assert again.usage.output_tokens == 1, again


def test_responses_reasoning_item_plain_and_streamed(server, model_dir):
    client = server.client()
    ask = dict(model="m", input="Hello?", max_output_tokens=12, temperature=0)
    r = client.responses.create(**ask, extra_body=_sampler(model_dir))
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    assert r.output[0].content[0].text == THOUGHT and r.output_text == ANSWER, r
    assert r.usage.output_tokens_details.reasoning_tokens == 2, r.usage
    with client.responses.stream(**ask, extra_body=_sampler(model_dir)) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds, kinds
    assert [o.type for o in final.output] == ["reasoning", "message"], final.output
    assert final.output[0].content[0].text == THOUGHT, final.output
    assert final.output_text == ANSWER, final


def test_reasoning_effort_reaches_the_template(server):
    # <|im_start|>, the text byte by byte, <|im_end|>, a newline.
    line = 1 + len("system\nReasoning: high") + 2
    base = {"messages": ASK, "max_tokens": 1}
    counts = []
    for extra in ({}, {"reasoning_effort": "high"}):
        status, r = server.request("POST", "/v1/chat/completions", {**base, **extra})
        assert status == 200, r
        counts.append(r["usage"]["prompt_tokens"])
    assert counts[1] - counts[0] == line, counts
    r = server.client().responses.create(
        model="m", input="Hello?", max_output_tokens=1, reasoning={"effort": "high"}
    )
    assert r.usage.input_tokens == counts[1], (r.usage, counts)
    status, r = server.request(
        "POST", "/v1/chat/completions", {**base, "reasoning_effort": 3}
    )
    assert status == 400 and r["error"]["param"] == "reasoning_effort", r


def test_chat_session_gives_the_thought_apart(model_dir):
    """`flashnorm-mlx chat`'s session: the thought to on_thought (the UI shows
    it dimmed), the answer alone to on_text, as serve splits them."""
    from mlx_lm.sample_utils import make_logits_processors

    from flashnorm_mlx.cli.chat import PlainUI, run_chat
    from flashnorm_mlx.jobs.conversation import ChatSession
    from flashnorm_mlx.loading import build_model, read_source
    from flashnorm_mlx.modes import FLASHNORM

    source = read_source(str(model_dir[0]))
    model, _ = build_model(source, FLASHNORM)
    f = forced(model_dir[1])
    processors = make_logits_processors(
        {int(k): v for k, v in f["logit_bias"].items()},
        f["repetition_penalty"],
        f["repetition_context_size"],
    )
    session = ChatSession(model, source.tokenizer, max_tokens=12)
    session.logits_processors = processors

    lines, text, thought, stats = ["Hello?"], [], [], []

    class UI(PlainUI):
        def read(self):
            return lines.pop() if lines else None

        def text(self, segment):
            text.append(segment)

        def thought(self, segment):
            thought.append(segment)

        def end_reply(self, s):
            stats.append(s)

    assert run_chat(session, UI(), 12) == 0
    assert ("".join(thought), "".join(text)) == (THOUGHT, ANSWER), (thought, text)
    assert stats[0].generation_tokens == len(SCRIPT) + 1, stats


# --- the small gaps (#57 part 7) ------------------------------------------------

WEATHER = {"name": "get_weather", "parameters": {"type": "object"}}


def test_tools_ignored_is_said_on_all_three_apis(server):
    """This template has no tools: answered without them, and each API's
    answer says so (chat completions did; Messages and Responses too)."""
    tool = {"type": "function", "function": WEATHER}
    asks = {
        "/v1/chat/completions": {"messages": ASK, "tools": [tool]},
        "/v1/messages": {
            "messages": ASK,
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        },
        "/v1/responses": {
            "input": "Hello?",
            "tools": [{"type": "function", **WEATHER}],
        },
    }
    for path, body in asks.items():
        status, r = server.request("POST", path, {**body, "max_tokens": 1})
        assert status == 200 and "ignored" in r.get("warning", ""), (path, r)


def _events(server, path, body) -> list:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    lines = [line.decode().strip() for line in resp]
    conn.close()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ")]


def test_anthropic_usage_is_the_same_in_every_event(server):
    """message_start and message_delta count input and cached tokens alike
    (the second ask reads its prompt from the cache)."""
    body = {"messages": ASK, "system": "Usage.", "max_tokens": 2, "stream": True}
    for _ in range(2):
        events = _events(server, "/v1/messages", body)
        start = events[0]["message"]["usage"]
        end = next(e for e in events if e["type"] == "message_delta")["usage"]
        for key in ("input_tokens", "cache_read_input_tokens"):
            assert start[key] == end[key], (key, start, end)
    assert end["cache_read_input_tokens"] > 0, end


def test_completions_logprobs_carry_both_shapes(server):
    body = {"prompt": "Hello", "max_tokens": 3, "logprobs": 2, "temperature": 0}
    status, r = server.request("POST", "/v1/completions", body)
    assert status == 200, r
    lp = r["choices"][0]["logprobs"]
    assert [c["token"] for c in lp["content"]] == lp["tokens"], lp
    assert [c["logprob"] for c in lp["content"]] == lp["token_logprobs"], lp
    assert all(len(c["top_logprobs"]) == 2 for c in lp["content"]), lp


def test_the_terminal_shows_a_thought_dim_and_the_answer_on_its_own_line():
    import io

    from rich.console import Console

    from flashnorm_mlx.cli.chat import RichUI

    ui = RichUI()
    out = io.StringIO()
    ui.console = Console(file=out, force_terminal=True, color_system="standard")
    ui.thought(THOUGHT)
    ui.text("Hi")
    ui.end_reply(None)
    shown = out.getvalue()
    print(repr(shown))
    assert "\x1b[2;3m" + THOUGHT in shown, shown  # dim, italic
    assert shown.index(THOUGHT) < shown.index("\nHi"), shown
