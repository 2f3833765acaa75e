"""The HTTP layer: routes, the API key, JSON bodies and server-sent events.

The standard library's ThreadingHTTPServer reads, checks and tokenizes each
request on its own thread, then hands Requests to the generation worker
(scheduler.py) and streams or collects what it sends back. Checks: guard.py;
the connection cap: connections.py; why not uvicorn+starlette: docs/serve.md.
"""

import ipaddress
import json
import socket
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional

from . import anthropic, completions
from .auth import key_scope
from .connections import REQUEST_S, CappedServer, ReadsRequests
from .guard import PAGE_HEADERS, has_body, is_json, origin_allowed, refusal
from .log import log
from .logprobs import choice_logprobs
from .reply import ClientGone, Reply
from .routes import extra_routes, public_paths
from .schema import Request, RequestError
from .service import Service
from .split import reply_split

MAX_BODY_BYTES = 16 << 20


# --- HTTP ----------------------------------------------------------------------


class Handler(ReadsRequests, BaseHTTPRequestHandler):
    """One connection's requests, each read by ReadsRequests (connections.py).
    The other modules' routes use `service` and the public methods (one line
    each below); the _names are this class's own."""

    protocol_version = "HTTP/1.1"  # keep-alive for JSON; streams close at the end
    server_version = "flashnorm-mlx"
    timeout = 15  # seconds a connection may sit idle (or stall a body)
    # TCP_NODELAY, as uvicorn sets: headers and body are two writes, and Nagle
    # may hold the second until the client's delayed ACK (up to 40 ms).
    disable_nagle_algorithm = True

    def log_message(self, format, *args):
        pass  # the generation thread logs one line per answered request

    def do_GET(self):
        self._dispatch()

    def do_POST(self):
        self._dispatch()

    do_PUT = do_DELETE = do_PATCH = do_POST

    def do_OPTIONS(self):
        """A CORS preflight: no key needed (browsers send none), no body."""
        refused = refusal(self.headers, self.server, preflight=True)
        if refused:  # a foreign Host; a foreign Origin just gets no grant
            self.close_connection = True
            return self.send_json(refused.status, refused.body())
        self.close_connection |= has_body(self.headers)  # left unread: closed
        self.send_response(204)
        self._cors_headers()
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (an unknown method, a bad request
        line) in OpenAI's JSON body, not its HTML page (docs/design.md section 5e)."""
        self.close_connection = True
        err = RequestError(
            f"{message or self.responses.get(code, ('error',))[0]}"
            + (
                f" ({self.command} {getattr(self, 'path', '')})" if self.command else ""
            ),
            status=code,
            code="method_not_allowed" if code == 501 else "bad_request",
        )
        path = getattr(self, "path", "").split("?", 1)[0].rstrip("/")
        if self.command == "HEAD":  # HTTP allows no body: the headers only
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self._cors_headers()
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()
            return
        self.send_json(
            code, anthropic.error_body(err) if anthropic.owns(path) else err.body()
        )

    def _cors_headers(self) -> None:
        """mlx_lm.server's CORS headers, for an Origin in --allowed-origins
        ("*": any). Authorization is named: a "*" there does not cover it."""
        allowed = self.server.allowed_origins
        headers = getattr(self, "headers", None)  # None: a bad request line
        origin = headers.get("Origin") if headers else None
        if "*" in allowed:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin and origin_allowed(origin, headers.get("Host"), allowed):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        else:
            return
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header(
            "Access-Control-Allow-Headers", "Authorization, Content-Type, *"
        )

    @property
    def service(self) -> Service:
        return self.server.service

    def _dispatch(self):
        self._sent = False
        path = self.path.split("?", 1)[0].rstrip("/")
        # A body left unread would be read as the next request: until a route
        # reads it (read_json), every reply closes the connection.
        self._keep_open = not self.close_connection
        self.close_connection |= has_body(self.headers)
        try:
            refused = refusal(self.headers, self.server)  # Host, Origin: guard.py
            if refused:
                raise refused
            self._check_key(path)
            self.reply = Reply(
                self.service,
                self.wfile,
                self.connection,
                self.read_json,
                self.send_json,
                self.send_bytes,
                self.start_events,
            )
            routes = {
                "/health": ("GET", self._health),
                "/v1/models": ("GET", self._models),
                f"/v1/models/{self.service.model_id}": ("GET", self._model),
                "/v1/chat/completions": ("POST", lambda: self.complete("chat")),
                "/v1/completions": ("POST", lambda: self.complete("text")),
                # mlx_lm.server's path without /v1
                "/chat/completions": ("POST", lambda: self.complete("chat")),
                **extra_routes(self.reply),  # tokenizers, agent APIs, the page
            }
            if path not in routes:
                raise RequestError(
                    f"Invalid URL ({self.command} {self.path})",
                    status=404,
                    code="not_found",
                )
            method, handle = routes[path]
            if self.command != method:
                self.close_connection = True  # a body, if any, is left unread
                raise RequestError(
                    f"{path} takes {method}, not {self.command}",
                    status=405,
                    code="method_not_allowed",
                )
            handle()
        except RequestError as e:  # Anthropic's routes answer in its own shape
            body = anthropic.error_body(e) if anthropic.owns(path) else e.body()
            try:
                self.send_json(e.status, body, e.headers)
            except OSError as gone:  # the client left before its answer
                self.close_connection = True
                log(f"{self.command} {path}: client left ({gone})")
        except (ClientGone, OSError):  # the client left, reset or stalled
            self.close_connection = True
        except Exception as e:  # a bug answering one request: log it, answer 500
            log(f"internal error: {e}\n{traceback.format_exc()}", "ERROR")
            self.close_connection = True
            if not self._sent:
                err = RequestError(
                    f"internal error: {e}", status=500, kind="server_error"
                )
                try:
                    self.send_json(500, err.body())
                except OSError:  # the client left too: the log has the error
                    pass

    def _check_key(self, path: str) -> None:
        """With an API key, every route but /health and the page's files needs
        it (401 otherwise)."""
        key = self.service.settings.api_key
        given = self.headers.get("x-api-key")  # Anthropic's SDKs send this
        given = f"Bearer {given}" if given else self.headers.get("Authorization")
        # The prompt cache's scope (auth.key_scope), for this thread's requests.
        self.key_scope = key_scope(given, key)
        if key and path not in public_paths():
            if self.key_scope is None:
                self.close_connection = True  # a body, if any, is left unread
                raise RequestError(
                    "invalid or missing API key: send 'Authorization: Bearer KEY'",
                    status=401,
                    code="invalid_api_key",
                )

    def send_json(self, status: int, obj: dict, headers=None) -> None:
        """`obj` as the JSON reply, with the CORS headers and `headers`."""
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self._cors_headers()
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True
        self.wfile.write(data)

    def send_bytes(self, status: int, content_type: str, data: bytes) -> None:
        """`data` as the reply (the chat page's files)."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache")
        for name, value in PAGE_HEADERS.items():  # CSP, no framing (guard.py)
            self.send_header(name, value)
        self.end_headers()
        self._sent = True
        self.wfile.write(data)

    def start_events(self) -> None:
        """The headers of a server-sent event stream (which ends the connection)."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self._cors_headers()
        self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True

    def _health(self):
        w = self.service.worker
        self.send_json(
            200 if w.alive else 503,
            {
                "status": "ok" if w.alive else "stopping",
                "model": self.service.model_id,
                "mode": self.service.mode,
                "active": w.active,
                "queued": w.queue.qsize(),
            },
        )

    def _model_card(self) -> dict:
        s = self.service
        return {
            "id": s.model_id,
            "object": "model",
            "created": s.started,
            "owned_by": f"flashnorm-mlx ({s.mode})",
        }

    def _models(self):
        self.send_json(200, {"object": "list", "data": [self._model_card()]})

    def _model(self):
        self.send_json(200, self._model_card())

    def read_json(self) -> dict:
        """The request's body, a JSON object (411, 413, 415 or 400 otherwise)."""
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise RequestError(
                "a Content-Length header is required",
                status=411,
                code="length_required",
            )
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(
                f"the request body is larger than {MAX_BODY_BYTES} bytes",
                status=413,
                code="body_too_large",
            )
        kind = self.headers.get("Content-Type")
        if not is_json(kind):  # a page's form or text/plain POST (guard.py)
            raise RequestError(
                f"the body must be JSON (Content-Type: application/json), not {kind}",
                status=415,
                code="unsupported_media_type",
            )
        raw = self.rfile.read(int(length))  # within the request's deadline
        if len(raw) < int(length):
            raise ClientGone()
        self.close_connection = not self._keep_open  # the body is read
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"invalid JSON in the body: {e}", code="invalid_json")
        except RecursionError:  # nesting deeper than Python's stack
            raise RequestError(
                "invalid JSON in the body: nested too deeply", code="invalid_json"
            )
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object", code="invalid_json")
        return body

    def complete(self, kind: str):
        """An OpenAI chat ("chat") or text ("text") completion, streamed or not."""
        body = self.read_json()
        with self.service.submitted(kind, body, self.key_scope) as requests:
            # split.py: a chat reply's thought and tool calls cut out of its
            # text, one ReplySplit per choice (None: nothing to cut).
            self._splits = [reply_split(self.service, r, r.stream) for r in requests]
            self._requests = requests
            try:
                if requests[0].stream:
                    self._stream(requests)
                else:
                    self._answer(requests)
            except (ClientGone, OSError):  # a Stop in the page, a client that left
                log(f"{kind} {requests[0].id[:8]}: cancelled: the client left")
                raise

    def _answer(self, requests: List[Request]):
        results = []
        for request in requests:
            what, value = self.reply.next_event(request)
            while what not in ("done", "error"):
                what, value = self.reply.next_event(request)
            if what == "error":
                raise value
            results.append(value)
        choices = []
        for i, (request, r) in enumerate(zip(requests, results)):
            choice = {
                "index": i,
                "finish_reason": r["finish_reason"],
                "logprobs": choice_logprobs(request, r["logprobs"]),
            }
            if request.kind == "chat":
                choice["message"] = completions.message(self._splits[i], r, choice)
            else:
                choice["text"] = r["text"]
            choices.append(choice)
        self.send_json(
            200,
            {
                **completions.head(requests[0], self.service.mode, chunk=False),
                "choices": choices,
                "usage": completions.total_usage(
                    [r["usage"] for r in results], requests[0].choices
                ),
                # Several prompts: the last one's, with the largest batch of any.
                "timings": {
                    **results[-1]["timings"],
                    "batch_max": max(r["timings"]["batch_max"] for r in results),
                },
            },
        )

    def _event(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _stream(self, requests: List[Request]):
        """Server-sent chunks: each choice's in turn (n > 1: the choices
        decode together; a client keys them by index), then usage once."""
        # Errors found before the first event still get a plain JSON error.
        event = self.reply.next_event(requests[0])
        if event[0] == "error":
            raise event[1]
        self.start_events()  # the stream's end is the connection's end
        results = []
        for i in range(len(requests)):
            result = self._stream_choice(i, requests[0], event)
            if result is None:  # an error, sent
                break
            results.append(result)
            event = (
                self.reply.next_event(requests[i + 1])
                if i + 1 < len(requests)
                else None
            )
        if len(results) == len(requests) and requests[0].include_usage:
            # OpenAI's shape: usage once, last, every choice counted.
            usage = completions.total_usage(
                [r["usage"] for r in results], len(requests)
            )
            last = {"choices": [], "usage": usage, "timings": results[-1]["timings"]}
            self._event(
                {**completions.head(requests[0], self.service.mode, True), **last}
            )
        self._event("[DONE]")

    def _stream_choice(self, i: int, head: Request, event) -> Optional[dict]:
        """Choice i's chunks from its first event on; its result (None: it
        failed, and the error was sent). `head`: the request whose id and
        model every chunk of the stream carries."""
        what, value = event
        request, split = head, self._splits[i]
        self._event(
            completions.chunk(request, self.service.mode, "", role=True, index=i)
        )
        while what == "text":
            piece, entries = value
            lp = choice_logprobs(
                request, entries if request.top_logprobs is not None else None
            )
            thought, calls = "", None
            if split:
                thought, piece, calls = split.feed(piece)
            self._event(
                completions.chunk(
                    request,
                    self.service.mode,
                    piece,
                    logprobs=lp,
                    calls=calls,
                    thought=thought,
                    index=i,
                )
            )
            what, value = self.reply.next_event(self._requests[i])
        if what == "error":
            self._event(value.body())
            return None
        finish = value["finish_reason"]
        if split:  # what the reply's end completes
            thought, rest, calls = split.feed("", final=True)
            if thought or rest or calls:
                chunk = completions.chunk(
                    request,
                    self.service.mode,
                    rest,
                    calls=calls,
                    thought=thought,
                    index=i,
                )
                self._event(chunk)
            finish = split.finish_reason(finish)
        last = completions.chunk(
            request, self.service.mode, None, finish=finish, index=i
        )
        last.update(timings=value["timings"])
        self._event(last)
        return value


class ApiServer(CappedServer, ThreadingHTTPServer):
    """ThreadingHTTPServer bound to (host, port), IPv6 when the host is one;
    at most max_connections open at once (connections.py)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 resets bursts)

    def __init__(
        self,
        host: str,
        port: int,
        allowed_origins=(),
        allowed_hosts=(),
        max_connections: int = 128,
        max_per_client: int = 32,
        request_timeout: float = REQUEST_S,
    ):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), Handler)
        self.service: Optional[Service] = None
        self.allowed_origins = tuple(allowed_origins)  # CORS; "*": any (guard.py)
        self.allowed_hosts = tuple(allowed_hosts)
        self.loopback = ipaddress.ip_address(self.server_address[0]).is_loopback
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.request_timeout = request_timeout  # headers and body (connections.py)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def attach(self, service: Service) -> None:
        """Start `service` (builds the model) and answer requests with it."""
        service.start()
        self.service = service
