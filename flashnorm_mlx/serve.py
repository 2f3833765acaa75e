"""An OpenAI-compatible HTTP server for one model (`flashnorm-mlx serve`).

Routes: POST /v1/chat/completions and /v1/completions (one JSON body, or
server-sent events ending `data: [DONE]` with "stream": true), GET /v1/models,
GET /health. Every error is a 4xx/5xx with OpenAI's body
{"error": {"message", "type", "param", "code"}}.

Threads: the standard library's ThreadingHTTPServer reads, checks and
tokenizes each request on its own thread; one generation thread owns the model
and advances the requests in turn, one prefill chunk or one token each
(round-robin), so a long reply never starves a short one. Each request runs
mlx-lm's `stream_generate` on a prompt cache fetched from mlx-lm's
`LRUPromptCache`, so a conversation's next turn prefills only its new tokens.

Why not mlx_lm.server itself: it loads models with `mlx_lm.load` (not our
FlashNorm builder), answers errors as {"error": "text"}, and its batching
(`BatchGenerator`) needs per-sequence cache offsets and left-padded batches,
which our models' kernels are not built or tested for.
"""

import ipaddress
import json
import math
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from queue import Empty, Queue
from typing import Callable, List, Optional

import mlx.core as mx

MAX_BODY_BYTES = 16 << 20
MAX_STOP_STRINGS = 4  # as OpenAI
ROLES = ("system", "developer", "user", "assistant", "tool")
LOG_PREFIX = "flashnorm-mlx serve:"


@dataclass
class Settings:
    """Server-wide defaults and limits (the CLI flags)."""

    max_tokens: int = 512  # reply budget when a request names none
    temp: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None  # seeds the per-request seeds of unseeded requests
    prefill_step_size: int = 512  # prompt tokens per turn of the generation thread
    prompt_cache_size: int = 10  # conversations whose KV caches are kept
    decode_concurrency: int = 32  # requests generating at once; the rest wait
    max_context: Optional[int] = None  # tokens; None: the model config's, if any


class RequestError(Exception):
    """A request the server refuses: sent as an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.kind = status, kind

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bind_warning(host: str) -> Optional[str]:
    """A warning line when `host` is reachable from other machines, else None."""
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: assume it is reachable
        pass
    return (
        f"warning: serving on {host}, reachable from other machines; the API has "
        "no authentication (the default, --host 127.0.0.1, is this machine only)"
    )


# --- requests ------------------------------------------------------------------


@dataclass
class Job:
    """One checked, tokenized request, and the queue its answers go to."""

    kind: str  # "chat" or "text"
    prompt: List[int]
    max_tokens: int
    temp: float
    top_p: float
    seed: int
    stop: List[str]
    stream: bool
    include_usage: bool
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    submitted: float = field(default_factory=time.perf_counter)
    events: Queue = field(default_factory=Queue)  # ("text"|"done"|"error", value)
    cancelled: threading.Event = field(default_factory=threading.Event)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _field(body: dict, name: str, typed, need: str, ok=None, default=None):
    """body[name] when present and not null, of the type `typed` accepts and
    the range `ok` accepts; else default."""
    value = body.get(name)
    if value is None:
        return default
    if not typed(value) or (ok is not None and not ok(value)):
        raise RequestError(
            f"'{name}' must be {need}, not {json.dumps(value)[:80]}",
            param=name,
            code="invalid_value" if typed(value) else "invalid_type",
        )
    return value


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_stop(v) -> bool:
    return _is_str(v) or (isinstance(v, list) and all(_is_str(x) for x in v))


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


def _messages(body: dict) -> List[dict]:
    messages = body.get("messages")
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


def _prompt_ids(body: dict, tokenizer, vocab_size: int) -> List[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise RequestError(
                f"'prompt' token ids must be in [0, {vocab_size})",
                param="prompt",
                code="invalid_value",
            )
        return list(prompt)
    raise RequestError(
        "'prompt' must be a string (or one string in a list, or a list of token ids)",
        param="prompt",
        code="invalid_type" if prompt is not None else "missing_required",
    )


class Service:
    """What the HTTP threads share: the model's tokenizer, settings and worker.

    build() -> (model, tokenizer, config) runs on the generation thread: MLX
    streams are per thread, and arrays still lazy from another thread (weights
    read with mx.load, constants a model caches) cannot be evaluated there.
    """

    def __init__(self, build: Callable, model_id: str, mode: str, settings: Settings):
        self.tokenizer = None  # set by start()
        self.model_id, self.mode, self.settings = model_id, mode, settings
        self.started = int(time.time())
        # HF fast tokenizers refuse concurrent use ("Already borrowed"):
        # HTTP threads tokenize and the worker detokenizes under this lock.
        self.tokenizer_lock = threading.Lock()
        self._seeds = random.Random(settings.seed)
        self._seeds_lock = threading.Lock()
        self.worker = Worker(build, settings, self.tokenizer_lock)
        self.in_flight = 0  # completion requests being answered
        self.idle = threading.Condition()

    def track(self, delta: int) -> None:
        with self.idle:
            self.in_flight += delta
            self.idle.notify_all()

    def wait_idle(self, timeout: float) -> None:
        """Let answers in flight (errors, after a stop) reach their clients."""
        with self.idle:
            self.idle.wait_for(lambda: self.in_flight == 0, timeout)

    def start(self) -> None:
        """Build the model on the generation thread; its errors raise here."""
        from .chat import context_length

        w = self.worker
        w.thread.start()
        w.ready.wait()
        if w.build_error is not None:
            w.thread.join()
            raise w.build_error
        self.tokenizer = w.tokenizer
        if self.settings.max_context is None:
            self.settings.max_context = context_length(w.config)

    def parse(self, kind: str, body: dict) -> Job:
        """A Job for a /v1/chat/completions ("chat") or /v1/completions ("text") body."""
        s = self.settings
        _field(body, "model", _is_str, "a string")
        stream = _field(body, "stream", _is_bool, "true or false", default=False)
        options = _field(
            body, "stream_options", lambda v: isinstance(v, dict), "an object"
        )
        include_usage = _field(
            options or {}, "include_usage", _is_bool, "true or false", default=False
        )
        name = (
            "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        )
        max_tokens = _field(body, name, _is_int, "an integer >= 1", lambda v: v >= 1)
        temp = _field(
            body,
            "temperature",
            _is_number,
            "a number from 0 to 2",
            lambda v: 0 <= v <= 2,
            s.temp,
        )
        top_p = _field(
            body,
            "top_p",
            _is_number,
            "a number > 0 and <= 1",
            lambda v: 0 < v <= 1,
            s.top_p,
        )
        seed = _field(
            body,
            "seed",
            _is_int,
            "an integer from 0 to 2**64-1",
            lambda v: 0 <= v < 2**64,
        )
        _field(body, "n", _is_int, "1 (one choice per request)", lambda v: v == 1)
        stop = _field(
            body,
            "stop",
            _is_stop,
            f"a non-empty string or a list of up to {MAX_STOP_STRINGS} of them",
            lambda v: (
                (len(v) <= MAX_STOP_STRINGS and all(v))
                if isinstance(v, list)
                else bool(v)
            ),
            [],
        )
        stop = [stop] if isinstance(stop, str) else list(stop)

        if kind == "chat":
            messages = _messages(body)
            param = "messages"
            if not getattr(self.tokenizer, "has_chat_template", False):
                raise RequestError(
                    "this model has no chat template; use /v1/completions",
                    param="messages",
                )
            with self.tokenizer_lock:
                try:
                    ids = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=True
                    )
                except Exception as e:  # the template's own refusals (jinja)
                    raise RequestError(
                        f"the chat template refused the messages: {e}",
                        param="messages",
                    ) from None
            prompt = [int(i) for i in ids]
        else:
            param = "prompt"
            with self.tokenizer_lock:
                prompt = _prompt_ids(body, self.tokenizer, self._vocab_size())
        if not prompt:
            raise RequestError("the prompt is empty", param=param, code="invalid_value")

        limit = s.max_context
        if limit is not None:
            asked = max_tokens if max_tokens is not None else 1
            if len(prompt) + asked > limit:
                raise RequestError(
                    f"this model's maximum context length is {limit} tokens; the "
                    f"request needs {len(prompt)} for the prompt and {asked} for the "
                    "reply",
                    param=param,
                    code="context_length_exceeded",
                )
        if max_tokens is None:
            max_tokens = s.max_tokens
            if limit is not None:
                max_tokens = min(max_tokens, limit - len(prompt))
        if seed is None:
            with self._seeds_lock:
                seed = self._seeds.getrandbits(63)
        return Job(
            kind=kind,
            prompt=prompt,
            max_tokens=max_tokens,
            temp=float(temp),
            top_p=float(top_p),
            seed=seed,
            stop=stop,
            stream=bool(stream),
            include_usage=include_usage,
            model=self.model_id,
        )

    def _vocab_size(self) -> int:
        return len(self.tokenizer.get_vocab())


# --- generation ----------------------------------------------------------------


def make_seeded_sampler(temp: float, top_p: float, seed: int):
    """mlx-lm's sampling (top-p, then temperature) with a key of the request's
    own: interleaved requests never share the global random state, so a seed
    gives the same tokens whatever else the server is doing."""
    from mlx_lm.sample_utils import apply_top_p, make_sampler

    if temp == 0:
        return make_sampler(0.0)
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


class StopText:
    """Cuts generated text at the first stop string, holding back any tail
    that could still grow into one, so a stream never sends a stop string."""

    def __init__(self, stops: List[str]):
        self.stops = stops
        self.text = ""
        self.sent = 0

    def add(self, piece: str):
        """(new text safe to send, whether a stop string was hit)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self.text, self.sent = self.text[self.sent : end], self.text[:end], end
            return out, True
        # The longest tail of the text that is the start of some stop string.
        longest = max(map(len, self.stops), default=0)
        tail = self.text[max(self.sent, len(self.text) - longest + 1) :]
        hold = next(
            (
                len(tail) - i
                for i in range(len(tail))
                if any(s.startswith(tail[i:]) for s in self.stops)
            ),
            0,
        )
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


@dataclass
class _Run:
    """A job in the generation thread: its cache and where it stands."""

    job: Job
    cache: list
    rest: List[int]  # prompt tokens not yet fed
    cached: int  # prompt tokens reused from the prompt cache
    fed: List[int]  # prompt tokens the cache holds
    stops: StopText
    gen: object = None  # stream_generate, once the prompt fits in one chunk
    ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    started: float = field(default_factory=time.perf_counter)
    first: Optional[float] = None  # time of the first generated token
    last: Optional[float] = None


class Worker:
    """The generation thread: owns the model, advances requests round-robin."""

    def __init__(self, build: Callable, settings: Settings, tokenizer_lock):
        self.build, self.settings = build, settings
        self.model = self.tokenizer = self.config = self.build_error = None
        self.ready = threading.Event()
        self.lock = tokenizer_lock
        self.queue: Queue = Queue()
        self.active = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=self._main, name="generation", daemon=True
        )

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping.is_set()

    def submit(self, job: Job) -> None:
        if not self.alive:
            raise RequestError(
                "the server is shutting down", status=503, kind="server_error"
            )
        self.queue.put(job)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the current step; waiting requests get a 503 error."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # the generation thread -----------------------------------------------------

    def _main(self):
        try:
            self.model, self.tokenizer, self.config = self.build()
        except BaseException as e:  # handed to Service.start on the main thread
            self.build_error = e
        if self.build_error is None:
            self.ready.set()
            self._run()
        self.model = self.pool = None  # freed on the thread that made them
        # MLX wants a thread's streams destroyed before it ends, or the process
        # may abort at exit ("terminate called without an active exception").
        mx.synchronize()
        mx.clear_streams()
        self.ready.set()  # after a failed build: once this thread is done with MLX

    def _run(self):
        from mlx_lm.models.cache import LRUPromptCache

        # All generation on this thread's default stream, as mlx_lm.server does.
        self.stream = mx.default_stream(mx.default_device())
        self.pool = LRUPromptCache(self.settings.prompt_cache_size)
        runs: deque = deque()
        while not self.stopping.is_set():
            try:
                self._admit(runs)
                if runs:
                    self._turn(runs)
            except Exception as e:  # nothing may stop the generation thread
                _log(f"internal error: {e}\n{traceback.format_exc()}")
            self.active = len(runs)
        bye = "the server is shutting down"
        for run in runs:
            self._fail(run.job, bye, 503)
        while not self.queue.empty():
            self._fail(self.queue.get_nowait(), bye, 503)

    def _turn(self, runs: deque) -> None:
        """One step of the request at the head of the rotation."""
        run = runs.popleft()
        try:
            done = self._step(run)
            if not done:
                runs.append(run)
            self.active = len(runs)  # counted out before its answer goes out
            if done:
                self._finish(run)
        except Exception as e:  # this request fails; the others go on
            _log(f"internal error: {e}\n{traceback.format_exc()}")
            self._fail(run.job, f"internal error: {e}")
            if run.gen is not None:
                run.gen.close()

    model_key = "model"  # one model per server: one key in the prompt cache

    def _admit(self, runs: deque) -> None:
        """Move waiting jobs into the rotation (block briefly when idle)."""
        while len(runs) < self.settings.decode_concurrency:
            try:
                job = (
                    self.queue.get(timeout=0.1) if not runs else self.queue.get_nowait()
                )
            except Empty:
                return
            if job.cancelled.is_set():
                continue
            try:
                runs.append(self._start(job))
            except Exception as e:
                _log(f"internal error: {e}\n{traceback.format_exc()}")
                self._fail(job, f"internal error: {e}")

    def _start(self, job: Job) -> _Run:
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        cache, rest = self.pool.fetch_nearest_cache(self.model_key, job.prompt)
        if cache is not None and not rest:
            # The whole prompt is cached: feed its last token again for logits.
            rest = job.prompt[-1:] if trim_prompt_cache(cache, 1) == 1 else None
        if cache is None or rest is None:
            cache, rest = make_prompt_cache(self.model), list(job.prompt)
        cached = len(job.prompt) - len(rest)
        return _Run(job, cache, rest, cached, job.prompt[:cached], StopText(job.stop))

    def _step(self, run: _Run) -> bool:
        """One prefill chunk or one token of `run`; True when it is finished."""
        from mlx_lm import stream_generate

        job, chunk = run.job, self.settings.prefill_step_size
        if job.cancelled.is_set():
            run.finish_reason = "cancelled"
            return True
        if run.gen is None and len(run.rest) > chunk:
            # Prefill in chunks here, so other requests get turns in between.
            with mx.stream(self.stream):
                self.model(mx.array(run.rest[:chunk])[None], cache=run.cache)
                mx.eval([c.state for c in run.cache])
            run.fed += run.rest[:chunk]
            run.rest = run.rest[chunk:]
            return False
        with self.lock:
            if run.gen is None:
                run.gen = stream_generate(
                    self.model,
                    self.tokenizer,
                    mx.array(run.rest),
                    max_tokens=job.max_tokens,
                    sampler=make_seeded_sampler(job.temp, job.top_p, job.seed),
                    prompt_cache=run.cache,
                    prefill_step_size=chunk,
                    stream=self.stream,
                )
                run.fed, run.rest = run.fed + run.rest, []
            r = next(run.gen)
        run.last = time.perf_counter()
        run.first = run.first or run.last
        # Every token stream_generate yields has been fed to the cache.
        run.ids.append(r.token)
        piece, stopped = run.stops.add(r.text)
        if r.finish_reason or stopped:
            run.finish_reason = "stop" if stopped else r.finish_reason
            piece += run.stops.flush()
        if piece and job.stream:
            job.events.put(("text", piece))
        return run.finish_reason is not None

    def _finish(self, run: _Run) -> None:
        if run.gen is not None:
            run.gen.close()
        key = run.fed + run.ids
        # Keep the cache for the next turn only if it holds exactly `key`.
        if run.cache and int(getattr(run.cache[0], "offset", -1)) == len(key):
            self.pool.insert_cache(self.model_key, key, run.cache)
        if run.finish_reason == "cancelled":
            return
        job = run.job
        n = len(run.ids)
        prompt_s = run.first - run.started
        gen_s = run.last - run.first
        result = {
            "text": run.stops.text,
            "finish_reason": run.finish_reason,
            "usage": {
                "prompt_tokens": len(job.prompt),
                "completion_tokens": n,
                "total_tokens": len(job.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": run.cached},
            },
            # Per response, as this client saw it (other requests' turns included).
            "timings": {
                "queued_seconds": round(run.started - job.submitted, 4),
                "prompt_seconds": round(prompt_s, 4),
                "prompt_tokens_per_second": _rate(
                    len(job.prompt) - run.cached, prompt_s
                ),
                "generation_seconds": round(gen_s, 4),
                "generation_tokens_per_second": _rate(n - 1, gen_s),
            },
        }
        job.events.put(("done", result))
        t = result["timings"]
        _log(
            f"{job.kind} {job.id[:8]}: prompt {len(job.prompt)} tokens "
            f"({run.cached} cached), {t['prompt_tokens_per_second']} tok/s | "
            f"{n} tokens, {t['generation_tokens_per_second']} tok/s | "
            f"{run.finish_reason}"
        )

    def _fail(self, job: Job, message: str, status: int = 500) -> None:
        job.events.put(
            ("error", RequestError(message, status=status, kind="server_error"))
        )


def _rate(tokens: int, seconds: float) -> Optional[float]:
    """tokens/sec rounded, or None where there is nothing to time."""
    return round(tokens / seconds, 2) if tokens > 0 and seconds > 0 else None


def _log(line: str) -> None:
    print(f"{LOG_PREFIX} {line}", file=sys.stderr, flush=True)


# --- HTTP ----------------------------------------------------------------------


class _ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for JSON; streams close at the end
    server_version = "flashnorm-mlx"
    timeout = 300  # idle keep-alive connections are let go

    def log_message(self, format, *args):
        pass  # the generation thread logs one line per answered request

    def do_GET(self):
        self._dispatch()

    def do_POST(self):
        self._dispatch()

    do_PUT = do_DELETE = do_PATCH = do_POST

    @property
    def service(self) -> Service:
        return self.server.service

    def _dispatch(self):
        self._sent = False
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            routes = {
                "/health": ("GET", self._health),
                "/v1/models": ("GET", self._models),
                f"/v1/models/{self.service.model_id}": ("GET", self._model),
                "/v1/chat/completions": ("POST", lambda: self._complete("chat")),
                "/v1/completions": ("POST", lambda: self._complete("text")),
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
        except RequestError as e:
            self._send_json(e.status, e.body())
        except (_ClientGone, OSError):  # the client left, reset or stalled
            self.close_connection = True
        except Exception as e:  # a bug answering one request: log it, answer 500
            _log(f"internal error: {e}\n{traceback.format_exc()}")
            if not self._sent:
                err = RequestError(
                    f"internal error: {e}", status=500, kind="server_error"
                )
                self._send_json(500, err.body())
            self.close_connection = True

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True
        self.wfile.write(data)

    def _health(self):
        w = self.service.worker
        self._send_json(
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
        self._send_json(200, {"object": "list", "data": [self._model_card()]})

    def _model(self):
        self._send_json(200, self._model_card())

    def _read_json(self) -> dict:
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
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"invalid JSON in the body: {e}", code="invalid_json")
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object", code="invalid_json")
        return body

    def _complete(self, kind: str):
        body = self._read_json()
        job = self.service.parse(kind, body)
        self.service.worker.submit(job)
        self.service.track(+1)
        try:
            if job.stream:
                self._stream(job)
            else:
                self._answer(job)
        finally:
            job.cancelled.set()  # a no-op when finished; stops it when the client left
            self.service.track(-1)

    def _next_event(self, job: Job):
        """The job's next event; notices a dead worker or a client that left."""
        while True:
            try:
                return job.events.get(timeout=0.5)
            except Empty:
                if not self.service.worker.thread.is_alive():
                    return (
                        "error",
                        RequestError(
                            "the server is shutting down",
                            status=503,
                            kind="server_error",
                        ),
                    )
                if self._client_gone():
                    raise _ClientGone()

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _answer(self, job: Job):
        while True:
            what, value = self._next_event(job)
            if what == "error":
                raise value
            if what == "done":
                break
        r = value
        choice = {"index": 0, "finish_reason": r["finish_reason"], "logprobs": None}
        if job.kind == "chat":
            choice["message"] = {"role": "assistant", "content": r["text"]}
        else:
            choice["text"] = r["text"]
        self._send_json(
            200,
            {
                **self._head(job, chunk=False),
                "choices": [choice],
                "usage": r["usage"],
                "timings": r["timings"],
            },
        )

    def _head(self, job: Job, chunk: bool) -> dict:
        if job.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
            prefix = "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return {
            "id": prefix + job.id,
            "object": obj,
            "created": job.created,
            "model": job.model,
            "system_fingerprint": f"flashnorm-mlx-{self.service.mode}",
        }

    def _chunk(self, job: Job, text: Optional[str], finish=None, role=False) -> dict:
        if job.kind == "chat":
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(finish_reason=finish, logprobs=None)
        return {**self._head(job, chunk=True), "choices": [choice]}

    def _event(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _stream(self, job: Job):
        # Errors found before the first event still get a plain JSON error.
        what, value = self._next_event(job)
        if what == "error":
            raise value
        self.close_connection = True  # the stream's end is the connection's end
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True
        self._event(self._chunk(job, "", role=True))
        while True:
            if what == "text":
                self._event(self._chunk(job, value))
            elif what == "error":
                self._event(value.body())
                break
            else:  # done
                last = self._chunk(job, None, finish=value["finish_reason"])
                last.update(usage=value["usage"], timings=value["timings"])
                self._event(last)
                if job.include_usage:
                    self._event(
                        {
                            **self._head(job, True),
                            "choices": [],
                            "usage": value["usage"],
                        }
                    )
                break
            what, value = self._next_event(job)
        self._event("[DONE]")


class ApiServer(ThreadingHTTPServer):
    """ThreadingHTTPServer bound to (host, port), IPv6 when the host is one."""

    daemon_threads = True

    def __init__(self, host: str, port: int):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), Handler)
        self.service: Optional[Service] = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def attach(self, service: Service) -> None:
        """Start `service` (builds the model) and answer requests with it."""
        service.start()
        self.service = service


def run_until_signal(server: ApiServer) -> None:
    """Serve until SIGINT (Ctrl-C) or SIGTERM, then stop cleanly: requests in
    flight get an error, the generation thread ends, the socket closes."""
    stopping = threading.Event()

    def stop(signum, frame):
        if not stopping.is_set():
            stopping.set()
            _log(f"{signal.Signals(signum).name}: stopping")
            # shutdown() waits for serve_forever, which runs on this thread.
            threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.service.worker.close()
        server.service.wait_idle(5.0)
        server.server_close()
        mx.clear_streams()  # this thread's too (mlx_lm's generation stream)
        for s, handler in previous.items():
            signal.signal(s, handler)
        _log("stopped")
