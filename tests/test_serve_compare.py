"""The chat page's Compare (serve/compare.py) in-process on a tiny random
Llama: a `--mode stock` server is compared with FlashNorm built on the same
folder, once, kept for the next Compare; both greedy runs give the tokens
mlx-lm's own generate_step gives on stock (the reference), the ratio is
FlashNorm's decode tok/s over stock's whichever mode serves. The page's
side, on the real model and a FlashNorm server: test_serve_page_chat."""

import time
from types import SimpleNamespace

import mlx.core as mx
import pytest
import tiny
from mlx_lm.generate import generate_step

from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.serve.compare import Comparer, other_mode


def test_a_stock_server_compares_with_flashnorm_built_once(tmp_path):
    path = str(tiny.make_llama(tmp_path / "m", "gqa_untied"))
    stock, _ = build_model(read_source(path, need_tokenizer=False), "stock")
    builds = []

    def build_other():
        builds.append(1)
        time.sleep(0.01)  # seconds shows 2 decimals; a warm process may take < 5 ms
        return build_model(read_source(path, need_tokenizer=False), "flashnorm")[0]

    c = Comparer(build_other, "stock")
    worker = SimpleNamespace(model=stock)  # what Worker.call hands the function
    prompt = [3, 17, 42, 9, 100, 7, 64, 5]
    first, again = c.run(worker, prompt, 6), c.run(worker, prompt, 6)
    print(first)
    assert builds == [1] and first["built_seconds"] > 0 and again["built_seconds"] == 0
    assert (
        first["modes"] == ["stock", "flashnorm"] and other_mode("flashnorm") == "stock"
    )
    res = first["results"]
    assert res["stock"]["model"].startswith("mlx_lm.models."), res
    assert res["flashnorm"]["model"].startswith("flashnorm_mlx."), res
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), stock, max_tokens=6)]
    assert res["stock"]["token_ids"] == ref, (res, ref)
    assert res["flashnorm"]["token_ids"] == ref and first["agree"] == 6, (res, ref)
    fn, st = (res[m]["decode_tokens_per_second"] for m in ("flashnorm", "stock"))
    assert first["ratio"] == pytest.approx(fn / st, abs=2e-3)
    assert first["prompt_tokens"] == 8 and first["tokens"] == 6


def _wait_line(server, text, since, limit=120):
    end = time.monotonic() + limit
    while not any(text in x for x in server.lines[since:]):
        assert time.monotonic() < end, server.log()
        time.sleep(0.02)


@pytest.mark.slow
def test_compare_is_refused_beside_a_stream_and_stops_when_its_client_leaves():
    """The embedded SmolLM2 served: a Compare beside a running stream is a
    503 with Retry-After at once (the stream untouched); alone it runs in
    slices, one at a time (409), max_tokens capped at 512, and it stops when
    its client leaves."""
    import json
    import socket

    from serve_process import Server
    from test_serve_load import Stream

    s = Server()
    msgs = [{"role": "user", "content": "Tell me about lighthouses."}]
    try:
        n0 = len(s.lines)
        body = json.dumps({"messages": msgs, "max_tokens": 10**6}).encode()
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
        sock.sendall(
            b"POST /compare HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        _wait_line(s, "compare: started, 512 tokens", n0)  # capped
        status, got = s.request("POST", "/compare", {"messages": msgs, "max_tokens": 4})
        assert status == 409, got
        sock.close()
        t = time.monotonic()
        _wait_line(s, "compare: cancelled: the client left", n0, limit=60)
        print(f"stopped {time.monotonic() - t:.2f} s after its client left")
        stream = Stream(s.port)
        assert stream.started.wait(120), s.log()
        t = time.monotonic()
        status, got = s.request(
            "POST", "/compare", {"messages": msgs, "max_tokens": 48}
        )
        print("beside a stream:", status, got, round(time.monotonic() - t, 2))
        assert status == 503 and got["error"]["code"] == "busy", got
        assert time.monotonic() - t < 5
        stream.close()
        status, _ = s.request("GET", "/health")
        assert status == 200
    finally:
        s.kill()
