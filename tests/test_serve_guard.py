"""`flashnorm-mlx serve` against clients that confuse it and pages that reach
in (#48 items 3-5): a body left unread never becomes the next request, Host
and Origin checks (DNS rebinding, CORS) by default and opened by flags, JSON
only on the API, deep JSON a 400, a connection cap, a client that leaves is
one log line, and prompt caches kept apart per API key and per cache_salt.
Runs on the embedded SmolLM2, bound to 127.0.0.1."""

import json
import socket
import struct
import threading
import time

import openai
import pytest
from serve_process import Server

HELLO = [{"role": "user", "content": "Say hello to the guard."}]


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.kill()


def exchange(port, data: bytes, timeout=30.0) -> bytes:
    """Everything the server sends back for `data` until it closes (or
    `timeout` passes with nothing more)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        got = b""
        try:
            while True:
                part = s.recv(1 << 16)
                if not part:
                    break
                got += part
        except socket.timeout:
            pass
    return got


def http(port, method, path, headers=None, body=b"") -> tuple:
    """(status, headers lowercased, parsed body) of one request on its own
    connection, with exactly the headers given (Host included)."""
    headers = {"Host": f"127.0.0.1:{port}", "Connection": "close", **(headers or {})}
    if body:
        headers["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items() if v is not None
    )
    raw = exchange(port, head.encode() + b"\r\n" + body)
    top, _, rest = raw.partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    try:
        parsed = json.loads(rest)
    except ValueError:
        parsed = rest
    return status, hdrs, parsed


def chat_body(**extra) -> bytes:
    return json.dumps({"messages": HELLO, "max_tokens": 1, **extra}).encode()


# --- a body left unread ------------------------------------------------------------


def test_openai_client_after_a_404_still_works(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="default", input="a body left unread")
    print(e.value)
    models = client.models.list()  # the same client, its pooled connection
    assert [m.id for m in models.data], models


@pytest.mark.parametrize(
    "path, headers",
    [
        ("/v1/embeddings", {}),  # 404
        ("/health", {}),  # 405: a GET route
        ("/v1/chat/completions", {"Content-Type": "text/plain"}),  # 415
    ],
)
def test_a_body_holding_a_request_gets_one_response(server, path, headers):
    inner = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()
    )
    head += f"Content-Length: {len(inner)}\r\n\r\n"
    raw = exchange(server.port, head.encode() + inner)
    print(raw.decode(errors="replace"))
    assert raw.count(b"HTTP/1.1 ") == 1, raw
    assert b"Connection: close" in raw, raw


# --- Host, Origin, Content-Type ---------------------------------------------------


def test_only_loopback_host_names_are_served(server):
    p = server.port
    for host in (f"localhost:{p}", f"127.0.0.1:{p}", f"[::1]:{p}", "localhost"):
        status, _, body = http(p, "GET", "/v1/models", {"Host": host})
        assert status == 200, (host, status, body)
    for host in ("evil.example", f"evil.example:{p}", f"localhost.evil.example:{p}"):
        for method, path in (("GET", "/v1/models"), ("GET", "/"), ("OPTIONS", "/")):
            status, _, body = http(p, method, path, {"Host": host})
            assert status == 403, (host, path, status, body)
        assert body["error"]["code"] == "host_not_allowed", body


def test_foreign_origins_get_no_grant_and_no_answer(server):
    p = server.port
    evil = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    status, h, _ = http(p, "OPTIONS", "/v1/chat/completions", evil)
    assert status == 204 and "access-control-allow-origin" not in h, h
    status, h, body = http(
        p, "POST", "/v1/chat/completions", {"Origin": "https://evil.example"}, b"{}"
    )
    assert status == 403 and body["error"]["code"] == "origin_not_allowed", body
    assert "access-control-allow-origin" not in h, h
    for origin in ("http://localhost:3000", f"http://127.0.0.1:{p}", "http://[::1]"):
        status, h, _ = http(p, "OPTIONS", "/v1/models", {"Origin": origin})
        assert h.get("access-control-allow-origin") == origin, (origin, h)
        status, h, _ = http(p, "GET", "/v1/models", {"Origin": origin})
        assert status == 200, (origin, status)


def test_api_bodies_must_be_json(server):
    p = server.port
    for kind in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ):
        for path in ("/v1/chat/completions", "/tokenize"):
            status, h, body = http(p, "POST", path, {"Content-Type": kind}, chat_body())
            assert status == 415, (kind, path, status, body)
            assert h.get("connection") == "close", h
    for kind in ("application/json", "application/json; charset=utf-8", None):
        status, _, body = http(
            p, "POST", "/v1/chat/completions", {"Content-Type": kind}, chat_body()
        )
        assert status == 200, (kind, status, body)


def test_deep_json_is_a_400(server):
    for body in (
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    ):
        status, _, got = http(server.port, "POST", "/v1/chat/completions", body=body)
        assert status == 400 and got["error"]["code"] == "invalid_json", (status, got)
    status, _, got = http(server.port, "GET", "/health")
    assert status == 200, got


def test_opening_flags_serve_other_hosts_and_any_origin():
    s = Server("--allowed-hosts", "evil.example", "--allowed-origins", "*")
    try:
        p = s.port
        status, _, body = http(p, "GET", "/v1/models", {"Host": "evil.example"})
        assert status == 200, body
        status, h, _ = http(
            p, "OPTIONS", "/v1/models", {"Origin": "https://evil.example"}
        )
        assert h.get("access-control-allow-origin") == "*", h
        status, _, body = http(
            p,
            "POST",
            "/v1/chat/completions",
            {"Origin": "https://evil.example", "Host": "evil.example:1"},
            chat_body(),
        )
        assert status == 200, body
        status, _, body = http(p, "GET", "/v1/models", {"Host": "other.example"})
        assert status == 403, body
    finally:
        s.kill()


# --- clients that leave -----------------------------------------------------------


def _reset(sock):
    """Close with a reset (SO_LINGER 0), as a client that crashed."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _leave_early(port, i):
    """One client that leaves before its answer: a bad request, a request
    cut off mid-body, or a stream dropped after its first bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        if i % 8 == 0:
            body = json.dumps(
                {"messages": HELLO, "max_tokens": 50, "stream": True}
            ).encode()
        elif i % 2:
            body = b'{"messages": oops'
        else:
            body = b""
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Length: {len(body) if body else 1000}\r\n\r\n"
        )
        s.sendall(head.encode() + (body or b'{"messages": ['))
        if i % 8 == 0:
            s.recv(1)  # the stream has started
        _reset(s)


def test_clients_leaving_early_make_one_line_each_at_most(server):
    before = len(server.lines)
    threads = [
        threading.Thread(target=_leave_early, args=(server.port, i)) for i in range(64)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # A request of our own as the mark that the server got past them all.
    r = server.client().chat.completions.create(
        model="default", messages=HELLO, max_tokens=1, temperature=0
    )
    rid = r.id.split("-", 1)[1][:8]
    deadline = time.monotonic() + 60
    while not any(rid in x for x in server.lines[before:]):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    new = [x for x in server.lines[before:] if rid not in x]
    print("\n".join(new))
    assert len(new) <= 64 and not any("Traceback" in x for x in new), len(new)


# --- API keys: prompt caches apart, a connection cap ---------------------------------


@pytest.fixture(scope="module")
def keyed():
    s = Server(
        "--api-key", "key-a,key-b", "--max-connections", "4", "--request-timeout", "2"
    )
    yield s
    s.kill()


# A short system message: the default one would be ~14 more tokens to prefill,
# three times uncached.
PIN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The PIN is 4417. Repeat it back."},
]


def _cached(s, key, **extra) -> int:
    with s.client(key=key) as client:  # its keep-alive connection closed after
        r = client.chat.completions.create(
            model="default",
            messages=PIN,
            max_tokens=1,
            temperature=0,
            **({"extra_body": extra} if extra else {}),
        )
    return r.usage.prompt_tokens_details.cached_tokens


def test_api_keys_and_cache_salts_share_no_cached_prefixes(keyed):
    first = _cached(keyed, "key-a")
    other_key = _cached(keyed, "key-b")
    same_key = _cached(keyed, "key-a")
    salted = _cached(keyed, "key-a", cache_salt="mine")
    salted_again = _cached(keyed, "key-a", cache_salt="mine")
    print(first, other_key, same_key, salted, salted_again)
    assert other_key == 0 and salted == 0, (other_key, salted)
    assert same_key > 0 and salted_again > 0, (same_key, salted_again)
    with keyed.client(key="key-c") as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    status, _, body = http(keyed.port, "POST", "/compare", body=chat_body())
    assert status == 401, (status, body)  # the page's Compare needs the key too


def test_connections_past_the_cap_get_a_503(keyed):
    idle = [
        socket.create_connection(("127.0.0.1", keyed.port), timeout=30)
        for _ in range(4)
    ]
    try:
        status, h, body = http(keyed.port, "GET", "/health")
        print(status, h, body)
        assert status == 503 and body["error"]["code"] == "too_many_connections"
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 30  # their threads notice the close
    while http(keyed.port, "GET", "/health")[0] != 200:
        assert time.monotonic() < deadline, keyed.log()
        time.sleep(0.1)


# --- the pieces alone ---------------------------------------------------------------


def test_host_and_origin_rules():
    from flashnorm_mlx.serve.guard import host_allowed, is_json, origin_allowed

    for host in ("localhost", "localhost:80", "127.0.0.1:8080", "[::1]:1", "127.0.0.2"):
        assert host_allowed(host, True, ()), host
    for host in ("evil.example", "10.0.0.1:80", "localhost:x", "[::1]:80:80"):
        assert not host_allowed(host, True, ()), host
    assert host_allowed("Evil.Example:9", True, ("evil.example",))
    assert host_allowed("anything", True, ("*",))
    # Bound elsewhere: IP literals (no rebinding without a name), still no names.
    assert host_allowed("192.168.1.5:8080", False, ())
    assert not host_allowed("evil.example", False, ())
    assert origin_allowed(None, "h", ())
    assert origin_allowed("http://localhost:3000", "h", ())
    assert origin_allowed("http://192.168.1.5:8080", "192.168.1.5:8080", ())  # the page
    assert not origin_allowed("https://evil.example", "127.0.0.1:80", ())
    assert not origin_allowed("null", "127.0.0.1:80", ())
    assert origin_allowed("https://evil.example", "x", ("https://evil.example",))
    assert is_json("application/json; charset=utf-8") and is_json(None)
    assert is_json("application/vnd.api+json") and not is_json("text/plain")


def test_bytes_per_token_bounds_the_real_tokenizer():
    """ceil(bytes / L) never exceeds the token count, and comes close for the
    text of the longest token repeated (an L too small by one fails here)."""
    from flashnorm_mlx.loading import read_source
    from flashnorm_mlx.loading.source import default_model_path
    from flashnorm_mlx.serve.bounds import bytes_per_token

    tok = read_source(str(default_model_path())).tokenizer
    per = bytes_per_token(tok)
    vocab = len(tok.get_vocab())
    longest = max(
        (tok.decode([i]) for i in range(vocab)), key=lambda t: len(t.encode())
    )
    rng = __import__("random").Random(48)
    texts = [
        longest * 50,
        "lorem ipsum " * 500,
        " " * 5000,
        "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(3000)),
        "🙂👍🏽" * 400,
        "<|im_start|>" * 100,
    ]
    for text in texts:
        n, size = len(tok.encode(text)), len(text.encode())
        print(per, n, size, -(-size // per))
        assert -(-size // per) <= n, (text[:40], n, size, per)
    n = len(tok.encode(longest * 50))
    assert -(-len((longest * 50).encode()) // (per - 2)) > n, (per, n)


def test_prefill_pace_sizes_chunks_by_time():
    from flashnorm_mlx.serve.pacing import FIRST_CHUNK, PrefillPace

    pace = PrefillPace(seconds=0.5, most=512)
    steps = []
    for _ in range(8):  # 0.05 s a token: 10 tokens fit in 0.5 s
        steps.append(pace.step(1))
        pace.measured(steps[-1], 0.05 * steps[-1])
    print(steps)
    assert steps[0] == FIRST_CHUNK and steps[-1] == 10, steps
    assert all(b <= 2 * a for a, b in zip(steps, steps[1:])), steps
    assert pace.step(2) == 5  # two prompts read together share the time
    assert pace.step(1, decoding=False) == 512  # nobody waits: all at once
    assert PrefillPace(seconds=100, most=64).step(1) <= 64
    slow = PrefillPace(seconds=0.5, most=512)
    slow.measured(4, 10.0)  # a step's cost over the budget: still 4 a step
    assert slow.step(1) == FIRST_CHUNK and slow.step(8) == 1
    # A forward pass costs 1 s whatever it reads, a token 0.1 s more: chunks
    # of 5 (0.5 s of tokens beyond the pass), not 4 (1.4 s / 4 a token).
    busy = PrefillPace(seconds=0.5, most=512)
    for _ in range(6):
        n = busy.step(1)
        busy.measured(n, 1.0 + 0.1 * n, fixed=1.0)
    assert busy.step(1) == 5, busy.last


# --- round 2 (#58): framing, slow sockets, one address ----------------------------


def test_each_request_shape_gets_one_response_with_a_status_line(server):
    p = server.port
    inner = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    shapes = {
        "one word": b"HELLO\r\n\r\n",
        "HTTP/0.9": b"GET /\r\n\r\n",
        "two Hosts": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n",
        "lengths 0 and N": b"POST /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Length: 0\r\nContent-Length: %d\r\n\r\n" % len(inner) + inner,
        "length and chunked": b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(inner)
        + inner,
        "OPTIONS with a body": b"OPTIONS /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Length: %d\r\n\r\n" % len(inner) + inner,
    }
    for name, data in shapes.items():
        raw = exchange(p, data)
        print(name, raw[:120])
        assert raw.count(b"HTTP/1.1 ") == 1, (name, raw)
        want = b"HTTP/1.1 204 " if name.startswith("OPTIONS") else b"HTTP/1.1 400 "
        assert raw.startswith(want) and b"Connection: close" in raw, (name, raw)


def test_the_page_forbids_framing_sniffing_and_foreign_scripts(server):
    status, h, _ = http(server.port, "GET", "/")
    print(h)
    assert status == 200 and h["x-frame-options"] == "DENY", h
    assert h["x-content-type-options"] == "nosniff", h
    csp = h["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp


def _from(address, port) -> socket.socket:
    s = socket.socket()
    s.settimeout(30)
    s.bind((address, 0))
    s.connect(("127.0.0.1", port))
    return s


def _health_from(address, port) -> int:
    with _from(address, port) as s:
        s.sendall(
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        return int(s.recv(64).split()[1])


def test_130_slow_sockets_from_one_address_leave_others_served(server):
    """Real defaults: 32 connections per address (the rest get a 503), so a
    client on another loopback address (127.0.0.2) is served at once."""
    socks = [_from("127.0.0.1", server.port) for _ in range(130)]
    try:
        for s in socks:
            s.sendall(b"G")  # a request begun, one byte of it
        assert _health_from("127.0.0.2", server.port) == 200
        assert _health_from("127.0.0.1", server.port) == 503
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 30  # their threads notice the close
    while _health_from("127.0.0.1", server.port) != 200:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)


def test_a_trickling_request_is_closed_at_its_deadline(keyed):
    """--request-timeout 2: a byte a second keeps every read alive, not the
    request; the connection closes within the deadline (and a slot frees)."""
    s = _from("127.0.0.1", keyed.port)
    start = time.monotonic()
    closed = None
    try:
        for ch in b"GET /health HTTP/1.1\r\n" * 2:
            s.sendall(bytes([ch]))
            s.settimeout(0.5)
            try:
                if s.recv(1) == b"":
                    closed = time.monotonic() - start
                    break
            except socket.timeout:
                pass
            except OSError:
                closed = time.monotonic() - start
                break
            assert time.monotonic() - start < 20
    finally:
        s.close()
    print(f"closed after {closed} s")
    assert closed is not None and closed < 4, closed


APIS = {  # path, body fields, where the answer says how many tokens were cached
    "chat": ("/v1/chat/completions", "messages", "max_tokens"),
    "messages": ("/v1/messages", "messages", "max_tokens"),
    "responses": ("/v1/responses", "input", "max_output_tokens"),
}


def _cached_via(server, api, messages, salt=None) -> int:
    path, field, most = APIS[api]
    body = {"model": "default", field: messages, most: 1, "temperature": 0}
    status, got = server.request(
        "POST", path, {**body, **({"cache_salt": salt} if salt else {})}
    )
    assert status == 200, (api, got)
    usage = got["usage"]
    if api == "chat":
        return usage["prompt_tokens_details"]["cached_tokens"]
    if api == "messages":
        return usage.get("cache_read_input_tokens") or 0
    return usage["input_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_a_salted_secret_is_found_by_no_unsalted_client_on_any_route(server):
    """Every ordered pair of the three APIs: a secret sent salted through one
    is guessed unsalted through the other, then found salted (the control).
    Unsalted, only the template's default system prompt may be cached (from
    the pair before): none of the secret's own ~10 tokens."""
    for i, (a, b) in enumerate((a, b) for a in APIS for b in APIS if a != b):
        secret = [{"role": "user", "content": f"{4417 + 97 * i} is the vault code."}]
        _cached_via(server, a, secret, salt=f"s{i}")
        guessed = _cached_via(server, b, secret)
        found = _cached_via(server, b, secret, salt=f"s{i}")
        print(a, "->", b, "unsalted", guessed, "salted", found)
        assert guessed <= found - 8, (a, b, guessed, found)
