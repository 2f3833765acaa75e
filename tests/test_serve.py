"""`flashnorm-mlx serve` as a real process on 127.0.0.1, called over HTTP with
the `openai` client and with raw requests: answers, streams, concurrency,
bad requests and shutdown. The embedded SmolLM2 server starts once for the
module; max_tokens stay small because this runs on slow CPUs."""

import http.client
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai  # the `test` extra: a real OpenAI client against our server
import pytest
import tiny
from serve_process import REQUEST_TIMEOUT, Server

from flashnorm_mlx.cli import main
from flashnorm_mlx.serve import bind_warning
from flashnorm_mlx.serve.text import StopText

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.kill()


def sse_events(resp):
    """The `data:` payloads of a server-sent event stream, as they arrive."""
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: ") :]


def open_stream(port, path, body, timeout=REQUEST_TIMEOUT):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200, (resp.status, resp.read())
    assert resp.getheader("Content-Type") == "text/event-stream"
    return conn, resp


# --- answers -------------------------------------------------------------------


def test_chat_answers_paris(server):
    r = server.client().chat.completions.create(
        model="default", messages=PARIS, temperature=0, max_tokens=10
    )
    text = r.choices[0].message.content
    print(r.model_dump_json(indent=1))
    assert "Paris" in text, text
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 10, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    t = r.model_extra["timings"]
    assert t["prompt_tokens_per_second"] > 0, t
    assert t["generation_tokens_per_second"] > 0, t


def test_chat_streams_the_same_answer_ending_done(server):
    body = {"messages": PARIS, "temperature": 0, "max_tokens": 10}
    status, plain = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, plain
    # OpenAI's shape (#48 item 6): usage in no chunk without include_usage,
    # in exactly one, the last (no choices), with it.
    for include in (False, True):
        asked = {**body, "stream_options": {"include_usage": include}}
        conn, resp = open_stream(server.port, "/v1/chat/completions", asked)
        events = list(sse_events(resp))
        conn.close()
        print(include, events)
        assert events[-1] == "[DONE]", events
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks), chunks
        with_usage = [i for i, c in enumerate(chunks) if "usage" in c]
        assert with_usage == ([len(chunks) - 1] if include else []), with_usage
        text = "".join(
            c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]
        )
        assert text == plain["choices"][0]["message"]["content"] and "Paris" in text
        finish = chunks[-2] if include else chunks[-1]
        assert finish["choices"][0]["finish_reason"] == "stop", finish
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [], chunks[-1]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    # The same prompt again: all but its last token come from the prompt cache.
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == usage["prompt_tokens"] - 1, usage


def test_openai_client_stream_with_usage(server):
    stream = server.client().chat.completions.create(
        model="default",
        messages=PARIS,
        temperature=0,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text, [c.model_dump() for c in chunks]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_next_turn_reuses_the_conversation_cache(server):
    client = server.client()
    first = client.chat.completions.create(
        model="default", messages=PARIS, temperature=0, max_tokens=10
    )
    turn = PARIS + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = client.chat.completions.create(
        model="default", messages=turn, temperature=0, max_tokens=3
    )
    u = second.usage
    print(first.usage, u)
    # Everything up to the first reply was prefilled before: only the new turn is.
    assert u.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens, u
    assert u.prompt_tokens > u.prompt_tokens_details.cached_tokens, u


def test_stop_string_cuts_the_reply(server):
    r = server.client().chat.completions.create(
        model="default", messages=PARIS, temperature=0, max_tokens=10, stop=["Paris"]
    )
    text = r.choices[0].message.content
    assert "Paris" not in text and "France" in text, text
    assert r.choices[0].finish_reason == "stop", r


def test_completions_endpoint_and_seed(server):
    client = server.client()
    ask = dict(
        model="default",
        prompt="Once upon a time",
        temperature=1.0,
        top_p=0.9,
        max_tokens=3,
        seed=1234,
    )
    # Two seeded requests interleaved token by token must not disturb each other.
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: client.completions.create(**ask), range(2))
    print(a.choices[0].text, "|", b.choices[0].text)
    assert a.object == "text_completion" and a.choices[0].text, a
    assert a.choices[0].text == b.choices[0].text, (a, b)
    assert a.usage.completion_tokens == 3 and a.choices[0].finish_reason == "length"


def test_models_and_health(server):
    models = server.client().models.list()
    ids = [m.id for m in models.data]
    assert ids == ["SmolLM2-135M-Instruct.Q4_1"], ids
    status, health = server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok", health
    assert health["mode"] == "flashnorm", health


# --- several clients -----------------------------------------------------------


def test_concurrent_requests_are_all_answered(server):
    client = server.client()
    prompts = [f"Tell me about the number {i}." for i in range(6)]

    def ask(p):
        return client.completions.create(
            model="default", prompt=p, temperature=0, max_tokens=2
        )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    took = time.perf_counter() - t0
    print(f"{len(prompts)} concurrent requests answered in {took:.1f} s")
    for p, a in zip(prompts, answers):
        n, why = a.usage.completion_tokens, a.choices[0].finish_reason
        assert 1 <= n <= 2 and why in ("stop", "length"), (p, a)
        assert why == "stop" or n == 2, (p, a)


def test_batched_answers_equal_each_alone_and_report_batch_max(server):
    client = server.client()
    prompts = [
        "1, 2, 3, 4, 5, 6, 7, 8,",
        "The capital of France is",
        "Once upon a time, in a land far away, there lived a",
        "Monday, Tuesday,",
    ]

    def ask(p):
        return client.completions.create(
            model="default", prompt=p, temperature=0, max_tokens=8, logprobs=1
        )

    alone = [ask(p) for p in prompts]
    # Together: decoded in one batch, each prompt's cache from the first round.
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    worst = 0.0
    for a, b in zip(alone, together):
        assert a.choices[0].text == b.choices[0].text, (a, b)
        la = a.choices[0].logprobs.token_logprobs
        lb = b.choices[0].logprobs.token_logprobs
        worst = max(worst, max(abs(x - y) for x, y in zip(la, lb)))
        assert b.usage.prompt_tokens_details.cached_tokens > 0, b.usage
    alone_max = [r.model_extra["timings"]["batch_max"] for r in alone]
    together_max = [r.model_extra["timings"]["batch_max"] for r in together]
    print(f"batch_max alone {alone_max}, together {together_max}; logprobs {worst:.1e}")
    # Rounding only: OpenBLAS (blas.py) blocks a batch's matmul by its rows.
    assert worst <= 1e-4, worst
    assert alone_max == [1] * 4 and together_max == [4] * 4, (alone_max, together_max)


def test_a_long_generation_does_not_starve_a_short_one(server):
    # Greedy counting goes on well past the few tokens this test waits for.
    long_body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "temperature": 0}
    conn, resp = open_stream(
        server.port, "/v1/completions", {**long_body, "max_tokens": 400}
    )
    events = sse_events(resp)
    next(events), next(events)  # the role chunk, then the first token: it is generating
    t0 = time.perf_counter()
    status, short = server.request(
        "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}
    )
    took = time.perf_counter() - t0
    assert status == 200 and short["usage"]["completion_tokens"] == 2, short
    # Still going after the short answer: the long one was not run to its end first.
    _, health = server.request("GET", "/health")
    assert health["active"] == 1, health
    assert json.loads(next(events))["choices"][0]["finish_reason"] is None
    print(f"short request answered in {took:.1f} s beside a 400-token stream")
    resp.close(), conn.close()  # the client leaves: the server must drop its generation
    deadline = time.time() + 30
    while time.time() < deadline:
        _, health = server.request("GET", "/health")
        if health["active"] == 0 and health["queued"] == 0:
            break
        time.sleep(0.5)
    assert health["active"] == 0, health


# --- bad requests --------------------------------------------------------------

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
BAD = {  # name: (path, body, status, param)
    "invalid JSON": (CHAT, b"{bad json", 400, None),
    "not an object": (CHAT, [1, 2], 400, None),
    "negative max_tokens": (
        CHAT,
        {"messages": HI, "max_tokens": -5},
        400,
        "max_tokens",
    ),
    "zero max_tokens": (CHAT, {"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens a string": (
        CHAT,
        {"messages": HI, "max_tokens": "ten"},
        400,
        "max_tokens",
    ),
    "max_tokens true": (CHAT, {"messages": HI, "max_tokens": True}, 400, "max_tokens"),
    "temperature a string": (
        CHAT,
        {"messages": HI, "temperature": "hot"},
        400,
        "temperature",
    ),
    # mlx-lm's range, the CLI's too (tests/test_limits.py): >= 0, no ceiling.
    "temperature below zero": (
        CHAT,
        {"messages": HI, "temperature": -0.5},
        400,
        "temperature",
    ),
    "top_p zero": (CHAT, {"messages": HI, "top_p": 0}, 400, "top_p"),
    "seed a float": (CHAT, {"messages": HI, "seed": 1.5}, 400, "seed"),
    "stop a number": (CHAT, {"messages": HI, "stop": 5}, 400, "stop"),
    "five stop strings": (CHAT, {"messages": HI, "stop": list("abcde")}, 400, "stop"),
    "stream a string": (CHAT, {"messages": HI, "stream": "yes"}, 400, "stream"),
    "nine choices": (CHAT, {"messages": HI, "n": 9}, 400, "n"),
    "no messages": (CHAT, {"max_tokens": 3}, 400, "messages"),
    "messages a string": (CHAT, {"messages": "hi"}, 400, "messages"),
    "unknown role": (CHAT, {"messages": [{"role": "bot", "content": "x"}]}, 400, None),
    "content a number": (
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),
    "over-long prompt": (
        CHAT,
        {"messages": [{"role": "user", "content": "hello " * 9000}]},
        400,
        "messages",
    ),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    "token id out of range": (
        "/v1/completions",
        {"prompt": [1, 2, 10**9]},
        400,
        "prompt",
    ),
    "unknown route": ("/v1/nothing", {}, 404, None),
}


def test_bad_requests_get_openai_errors_and_the_server_lives_on(server):
    wrong = []
    for name, (path, body, status, param) in BAD.items():
        got, reply = server.request("POST", path, body)
        err = reply.get("error") if isinstance(reply, dict) else None
        ok = (
            got == status
            and isinstance(err, dict)
            and set(err) == {"message", "type", "param", "code"}
            and err["message"]
            and (param is None or err["param"] == param)
        )
        if not ok:
            wrong.append((name, got, reply))
    for method, path, status in [
        ("GET", CHAT, 405),
        ("DELETE", "/v1/models", 405),
        ("GET", "/nothing", 404),
    ]:
        got, reply = server.request(method, path)
        if got != status or "error" not in reply:
            wrong.append((method, path, got, reply))
    assert not wrong, "\n".join(map(str, wrong))
    _, over = server.request("POST", CHAT, BAD["over-long prompt"][1])
    assert over["error"]["code"] == "context_length_exceeded", over

    # The openai client reads the error body as OpenAI's own.
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model="default", messages=HI, max_tokens=-1
        )
    assert e.value.code == "invalid_value" and e.value.param == "max_tokens", e.value

    # No Content-Length, and a body larger than allowed.
    for head, status in [
        (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 411),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 999999999\r\n\r\n",
            413,
        ),
    ]:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(head)
            reply = b""
            while chunk := s.recv(65536):  # the server closes after an error
                reply += chunk
            reply = reply.decode()
        assert reply.startswith(f"HTTP/1.1 {status}"), reply
        assert '"error"' in reply, reply

    # Still alive and answering.
    status, r = server.request(
        "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 1}
    )
    assert status == 200 and r["usage"]["completion_tokens"] == 1, r
    assert (
        "Traceback" not in server.log() and "internal error" not in server.log()
    ), server.log()


# --- shutdown (last: it stops the module's server) -----------------------------


def test_ctrl_c_mid_stream_stops_cleanly(server):
    conn, resp = open_stream(
        server.port,
        "/v1/completions",
        {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 400},
    )
    events = sse_events(resp)
    next(events), next(events)
    rc = server.stop(signal.SIGINT)
    rest = list(events)  # the stream ends rather than hanging
    conn.close()
    print(server.log())
    assert rc == 0, server.log()
    assert rest and rest[-1] == "[DONE]", rest
    assert "Traceback" not in server.log() and "stopped" in server.lines[-1]


# --- --mode stock, SIGTERM, the command line -----------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("serve"), "gqa_untied")


def test_stock_mode_serves_the_same_function_and_sigterm_stops_it(tiny_dir):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from flashnorm_mlx import load

    s = Server(str(tiny_dir), "--mode", "stock", "--dtype", "float32")
    try:
        _, health = s.request("GET", "/health")
        assert health["mode"] == "stock", health
        status, r = s.request(
            "POST",
            "/v1/completions",
            {"prompt": "hello", "max_tokens": 8, "temperature": 0},
        )
        assert status == 200, r
        # Reference: our FlashNorm model on the same weights, greedy, in this process.
        model, tok = load(str(tiny_dir), dtype=mx.float32)
        prompt = tok.encode("hello")
        ids = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
        ids = ids[: next((i for i, t in enumerate(ids) if t in tok.eos_token_ids), 8)]
        # The exact decoding in context (mlx-lm's streaming detokenizer shows
        # ids the tokenizer does not know as "!"; decode leaves them out).
        want = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
        assert r["choices"][0]["text"] == want, (r, want)
        assert s.stop(signal.SIGTERM) == 0, s.log()
        assert "Traceback" not in s.log() and "stopped" in s.lines[-1], s.log()
    finally:
        s.kill()


def test_port_in_use_and_bad_port_are_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["serve", "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "cannot listen" in err[0], (rc, err)
    rc = main(["serve", "--port", "70000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--port" in err[0], (rc, err)
    rc = main(["serve", "/no/such/model", "--port", "0"])  # found on the worker thread
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "no such file" in err[0], (rc, err)
    # Listening on every interface is said at once, before the model loads.
    rc = main(["serve", "/no/such/model", "--port", "0", "--host", "0.0.0.0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 2, (rc, err)
    assert "warning: serving on 0.0.0.0" in err[0] and "no such file" in err[1], err


def test_other_addresses_get_a_warning():
    assert bind_warning("127.0.0.1") is None and bind_warning("localhost") is None
    assert bind_warning("::1") is None
    for host in ("0.0.0.0", "192.168.1.5", "myhost.local"):
        assert "warning" in (bind_warning(host) or ""), host


def test_stop_text_never_sends_a_stop_string():
    s = StopText(["STOP", "\n\n"])
    sent = [s.add(p) for p in ["Hello ", "ST", "O", "nly", " then S", "TOP more"]]
    print(sent)
    assert "".join(p for p, _ in sent) == "Hello STOnly then "
    assert sent[-1][1] and not any(hit for _, hit in sent[:-1])


def test_help_shows_every_default():
    from flashnorm_mlx.cli import serve

    parser = serve.setup_arg_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest != "help":
            text = formatter._get_help_string(action) or ""
            assert action.help and "default" in text, (action.option_strings, text)
