"""`flashnorm-mlx serve` for clients beyond the OpenAI SDK (#37 part 4): CORS
for web pages (as mlx_lm.server's --allowed-origins), OpenAI's JSON error body
for every refused method and path, and vLLM's tokenizer endpoints, checked
against the model's own tokenizer and through lm-evaluation-harness's
RemoteTokenizer (lm-eval with no tokenizer of its own scores as it does with a
local tokenizer folder). Runs on the embedded SmolLM2."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from serve_process import Server

ORIGIN = "http://page.example"


@pytest.fixture(scope="module")
def server():
    s = Server("--allowed-origins", f"{ORIGIN},http://other.example")
    yield s
    s.kill()


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer, read by the loader the server uses."""
    from flashnorm_mlx.loading import read_source
    from flashnorm_mlx.loading.source import default_model_path

    return read_source(str(default_model_path())).tokenizer


def raw(server, method, path, headers=None, body=None):
    """(status, headers dict, body bytes) of one request."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


# --- CORS ------------------------------------------------------------------------


def test_preflight_for_an_allowed_origin_gets_the_cors_headers(server):
    status, h, body = raw(
        server,
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    print(status, h, body)
    assert status == 204 and body == b"", (status, body)
    assert h.get("Access-Control-Allow-Origin") == ORIGIN, h
    assert "POST" in h["Access-Control-Allow-Methods"], h
    # A "*" alone does not cover Authorization: it must be named.
    assert "Authorization" in h["Access-Control-Allow-Headers"], h


def test_other_origins_get_no_cors_header_and_answers_carry_it(server):
    status, h, _ = raw(
        server, "OPTIONS", "/v1/models", {"Origin": "http://evil.example"}
    )
    assert status == 204 and "Access-Control-Allow-Origin" not in h, h
    status, h, body = raw(server, "GET", "/v1/models", {"Origin": ORIGIN})
    assert status == 200 and h.get("Access-Control-Allow-Origin") == ORIGIN, h
    # Errors too, or a page cannot read why it was refused.
    status, h, body = raw(server, "GET", "/nowhere", {"Origin": ORIGIN})
    assert status == 404 and h.get("Access-Control-Allow-Origin") == ORIGIN, h


@pytest.mark.parametrize(
    "method, path, status, code",
    [
        ("PUT", "/v1/chat/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
        ("PATCH", "/v1/completions", 405, "method_not_allowed"),
        ("GET", "/v2/nothing", 404, "not_found"),
        ("POST", "/nothing", 404, "not_found"),
        ("BREW", "/v1/models", 501, "method_not_allowed"),  # not even a method
        ("CONNECT", "/v1/models", 501, "method_not_allowed"),
    ],
)
def test_every_refusal_is_the_openai_json_error(server, method, path, status, code):
    got, h, body = raw(server, method, path, {"Origin": ORIGIN})
    print(got, h, body)
    assert got == status and h["Content-Type"] == "application/json", (got, h)
    err = json.loads(body)["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error", err
    assert method in err["message"] and "<html" not in body.decode().lower(), err


def test_head_is_refused_with_json_headers_and_no_body(server):
    # HTTP forbids a body in an answer to HEAD: the status and type only.
    status, h, body = raw(server, "HEAD", "/v1/models")
    assert status == 501 and h["Content-Type"] == "application/json", (status, h)
    assert body == b"", body


def _send_raw(server, data: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


def test_malformed_requests_get_the_json_error(server):
    # More headers than the standard library reads: its 431, with headers.
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(120))
    answer = _send_raw(server, b"GET /v1/models HTTP/1.1\r\n" + many + b"\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    print(answer)
    assert head.split()[1] == b"431" and b"application/json" in head, head
    assert json.loads(body)["error"]["code"] == "bad_request", body
    # No version at all (HTTP/0.9's shape): still a 400 with a status line and
    # headers, so a client reading HTTP/1.x sees an answer, not a bare body.
    answer = _send_raw(server, b"NOT A REQUEST LINE AT ALL\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    print(answer)
    assert head.split()[1] == b"400" and b"application/json" in head, head
    assert json.loads(body)["error"]["code"] == "bad_request", body


# --- vLLM's tokenizer endpoints --------------------------------------------------

TEXTS = ["Hello world", "  The capital of France is Paris.\n", "naïve café ☕"]


def test_tokenize_and_detokenize_match_the_tokenizer(server, tokenizer):
    status, info = server.request("GET", "/tokenizer_info")
    assert status == 200, info
    for field in ("eos_token", "bos_token", "pad_token", "chat_template"):
        assert info[field] == getattr(tokenizer, field), (field, info[field])
    # The Hugging Face class, as vLLM says it, not mlx-lm's wrapper around it.
    assert info["tokenizer_class"] not in ("TokenizerWrapper", ""), info
    for text in TEXTS:
        for special in (False, True):
            status, got = server.request(
                "POST", "/tokenize", {"prompt": text, "add_special_tokens": special}
            )
            want = tokenizer.encode(text, add_special_tokens=special)
            assert status == 200 and got["tokens"] == want, (text, got, want)
            assert got["count"] == len(want), got
        status, got = server.request("POST", "/detokenize", {"tokens": want})
        assert status == 200 and got["prompt"] == tokenizer.decode(want), got
    messages = [{"role": "user", "content": "Hi"}]
    status, got = server.request("POST", "/tokenize", {"messages": messages})
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert status == 200 and got["tokens"] == list(want), got


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        (
            "/tokenize",
            {"prompt": "x", "add_special_tokens": "no"},
            "add_special_tokens",
        ),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
def test_bad_tokenizer_requests_are_400(server, path, body, param):
    status, got = server.request("POST", path, body)
    assert status == 400 and got["error"]["param"] == param, got


# --- lm-evaluation-harness, with and without a tokenizer of its own ---------------

QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Rome"], 0),
    ("Two plus two equals", [" five", " four", " three"], 1),
]


def _lm_eval(tmp_path, url, tag, extra_args=""):
    """Per-document loglikelihoods of `lm_eval --model local-completions` on
    a two-question multiple-choice task (task yaml + jsonl in tmp_path)."""
    out = tmp_path / f"out-{tag}"
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        f"model=smollm2,base_url={url}/v1/completions,num_concurrent=1,"
        f"max_retries=1{extra_args}",
        "--tasks",
        "fn_tiny_mc",
        "--include_path",
        str(tmp_path / "tasks"),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    (samples,) = list(out.rglob("samples_fn_tiny_mc_*.jsonl"))
    rows = [json.loads(x) for x in samples.read_text().splitlines()]
    return r.stderr, {row["doc_id"]: row["resps"] for row in rows}


def test_lm_eval_needs_no_tokenizer_of_its_own(server, tokenizer, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (lm-eval[api])")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "mc.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
            for q, c, a in QUESTIONS
        )
    )
    (tasks / "fn_tiny_mc.yaml").write_text(
        "task: fn_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(str(folder))  # the GGUF's tokenizer as HF files
    log, remote = _lm_eval(tmp_path, server.url, "remote")
    assert "remote tokenizer" in log.lower(), log[-3000:]
    _, local = _lm_eval(
        tmp_path,
        server.url,
        "local",
        f",tokenizer={folder},tokenizer_backend=huggingface",
    )
    print(json.dumps({"remote": remote, "local": local}))
    assert len(remote) == len(QUESTIONS) and remote == local
    shutil.rmtree(folder)


# --- tools on a model whose template has none ------------------------------------


def test_tools_on_a_model_without_tool_template_are_answered_without_them(server):
    """As mlx_lm.server (#47): 200, the same reply as without tools, and a
    warning in the answer."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    status, r = server.request("POST", "/v1/chat/completions", {**body, "tools": tools})
    _, plain = server.request("POST", "/v1/chat/completions", body)
    print(r, plain)
    assert status == 200 and "does not use tools" in r["warning"], r
    assert r["choices"][0]["message"] == plain["choices"][0]["message"], (r, plain)
    assert r["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert "warning" not in plain, plain


def test_empty_allowed_origins_is_one_line(capsys):
    from flashnorm_mlx.cli import main

    rc = main(["serve", "--allowed-origins", " , ", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--allowed-origins" in err[0], (rc, err)
