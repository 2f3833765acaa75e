"""The chat page's Compare (POST /compare): the last reply's prompt run again
on the server's model and on the same weights built the other way (stock for
a FlashNorm server, FlashNorm for a stock one), decode timed as chat's
/compare times it (the same prompt and token count for both, end-of-sequence
ignored, greedy; timing.py's conventions).

The other model is built on the first Compare and kept: one more copy of the
weights in memory from then on, none before (docs/serve.md). Both run on the
generation thread in slices of about SLICE_S (Worker.call), each timed alone:
a Compare never holds another client up for longer than a slice (building
the other model, once, is one slice). It is
refused (503, Retry-After) while other requests are in flight; one that
arrives during it goes first while the Compare waits (PAUSE_S at most), and
the Compare stops when its client leaves. One Compare at a time (409).
"""

import threading
import time
from typing import Callable, Iterator, List

import mlx.core as mx

from ..errors import UnsupportedModel
from ..modes import FLASHNORM, STOCK, Mode
from .log import log
from .pacing import PrefillPace
from .schema import RequestError

MAX_TOKENS = 512  # the page's default reply length (app.js) is at most this
SLICE_S = 0.25  # the longest a request that arrives waits for a Compare
CALL_S = 1.0  # slices per Worker.call: its client is checked between calls
PREFILL_CHUNK = 128  # most prompt tokens per forward pass of a Compare's prefill
PAUSE_S = 60.0  # how long a Compare waits for other requests before a 503
CALL_TIMEOUT_S = 600  # one slice; building the other model is the longest
RETRY_AFTER_S = 5


def other_mode(mode: Mode) -> Mode:
    """What a server running `mode` is compared with."""
    return FLASHNORM if mode.is_mlx_lms else STOCK


class _Clock:
    """Seconds spent inside slices: the waits between them are not counted."""

    def __init__(self):
        self.spent, self.since = 0.0, time.perf_counter()

    def now(self) -> float:
        return self.spent + time.perf_counter() - self.since

    def pause(self) -> None:
        self.spent = self.now()

    def resume(self) -> None:
        self.since = time.perf_counter()


def timed_run(model, prompt: List[int], n: int, stream) -> Iterator[None]:
    """Greedy decode of `n` tokens (end-of-sequence ignored) after `prompt`,
    a generator that yields between slices of about SLICE_S; its value
    (StopIteration) is timing.time_generation's fields: prompt time until
    the first token, decode time from the first token to the n-th, as
    mlx-lm's generate_step (pipelined: the next step queued before a token
    is read)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache, ids, clock = make_prompt_cache(model), mx.array(prompt), _Clock()

    def forward(x):
        with mx.stream(stream):
            return mx.argmax(model(x[None], cache=cache)[:, -1, :], axis=-1)

    def slice_done(pending) -> bool:
        if clock.now() - mark < SLICE_S:
            return False
        mx.eval(pending)  # no work of this run left running in the pause
        clock.pause()
        return True

    mark, i, pace = 0.0, 0, PrefillPace(SLICE_S, PREFILL_CHUNK)
    while i < len(prompt) - 1:  # chunks timed to a slice (pacing.py), as serve's
        j, start = min(i + pace.step(1), len(prompt) - 1), clock.now()
        with mx.stream(stream):
            model(ids[None, i:j], cache=cache)
            mx.eval([c.state for c in cache])
        pace.measured(j - i, clock.now() - start)
        i = j
        if slice_done([]):
            yield
            clock.resume()
            mark = clock.now()
    y = forward(ids[-1:])
    mx.eval(y)
    t_first = clock.now()
    tokens = []
    while len(tokens) < n:
        nxt = forward(y) if len(tokens) + 1 < n else None
        if nxt is not None:
            mx.async_eval(nxt)
        tokens.append(int(y.item()))
        t_last = clock.now()
        y = nxt
        if y is not None and slice_done([y]):
            yield
            clock.resume()
            mark = clock.now()
    decode_s = t_last - t_first
    return {
        "prompt_tps": len(prompt) / t_first,
        "decode_tps": (n - 1) / decode_s if decode_s > 0 else float("nan"),
        "tokens": tokens,
    }


class Comparer:
    """The server's model against the other mode on the same weights.
    build_other(the other Mode) -> that model, called once, on the generation
    thread; `settle` gives the server's mode once the model is read (serve's
    --mode defaults by family)."""

    def __init__(self, build_other: Callable[[Mode], object], mode: Mode = FLASHNORM):
        self.build_other = build_other
        self.settle(mode)
        self.model = None  # the other model, once built
        self.running = threading.Lock()  # one Compare at a time

    def settle(self, mode: Mode) -> None:
        """The server's Mode, once its model is read: rows are named by mode."""
        self._other = other_mode(mode)
        self.mode, self.other = mode.name, self._other.name

    def steps(self, worker, prompt: List[int], n: int) -> Iterator[None]:
        """On the generation thread, a slice per next(): both models' decode
        speed on `prompt`; its value (StopIteration) is the Compare's JSON."""
        built_s = 0.0
        if self.model is None:
            start = time.perf_counter()
            try:
                self.model = self.build_other(self._other)
            except UnsupportedModel as e:  # a family FlashNorm does not cover
                raise RequestError(f"nothing to compare: {e}") from None
            # Never 0 once built: 0 says "built before" to the page and the log.
            built_s = max(time.perf_counter() - start, 0.01)
            yield
        stream = getattr(worker, "stream", None) or mx.default_stream(mx.cpu)
        models = {self.mode: worker.model, self.other: self.model}
        r = {}
        for name, model in models.items():
            yield from timed_run(model, prompt[-8:], 2, stream)  # compiles, untimed
            r[name] = yield from timed_run(model, prompt, n, stream)
        return self._result(r, models, len(prompt), n, built_s)

    def run(self, worker, prompt: List[int], n: int) -> dict:
        """steps() to its end at once (tests; the server drives it by slices)."""
        gen = self.steps(worker, prompt, n)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value

    def _result(self, r, models, prompt_tokens: int, n: int, built_s: float):
        ids = {m: r[m]["tokens"] for m in models}
        agree = 0  # leading tokens the two greedy runs share
        for a, b in zip(ids[self.mode], ids[self.other]):
            if a != b:
                break
            agree += 1
        tps = {m: round(r[m]["decode_tps"], 2) for m in models}
        return {
            "object": "compare",
            "prompt_tokens": prompt_tokens,
            "tokens": n,
            "sampler": "greedy",
            "modes": [self.mode, self.other],  # the server's own first
            "results": {
                m: {
                    "decode_tokens_per_second": tps[m],
                    "prompt_tokens_per_second": round(r[m]["prompt_tps"], 2),
                    "token_ids": ids[m],
                    "model": type(models[m]).__module__,  # whose class it is
                }
                for m in models
            },
            "ratio": round(tps["flashnorm"] / tps["stock"], 3),  # FlashNorm / stock
            "agree": agree,
            "built_seconds": round(built_s, 2),
        }


def _busy(s) -> bool:
    """Whether other requests are in flight (answered, queued or decoding)."""
    w = s.worker
    return s.in_flight > 0 or w.active > 0 or w.queue.qsize() > 0


def _refused(message: str, status: int = 503) -> RequestError:
    return RequestError(
        message,
        status=status,
        code="busy",
        kind="server_error",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _slices(worker, gen):
    """Slices on the generation thread for CALL_S at most, each only while
    no request waits there: None when one does (it goes first), else
    ("more",) or ("done", the result)."""
    end = time.perf_counter() + CALL_S
    while time.perf_counter() < end:
        if worker.runs or not worker.queue.empty():
            return None
        try:
            next(gen)
        except StopIteration as done:
            return ("done", done.value)
    return ("more",)


def _drive(reply, gen) -> dict:
    """gen's slices, one Worker.call each, while no other request is in
    flight and the client is there."""
    s = reply.service
    try:
        return _wait_and_run(reply, s, gen)
    finally:  # its arrays freed on the thread that made them, whatever happened
        if s.worker.alive:
            s.worker.call(lambda w: gen.close(), CALL_TIMEOUT_S)


def _wait_and_run(reply, s, gen) -> dict:
    waited = 0.0
    while True:
        if reply.gone():
            raise ConnectionAbortedError("the client left")
        got = (
            None
            if _busy(s)
            else s.worker.call(lambda w: _slices(w, gen), CALL_TIMEOUT_S)
        )
        if got is None:  # another request goes first: wait, a while at most
            if waited > PAUSE_S:
                raise _refused(
                    f"other requests kept the server busy for {PAUSE_S:.0f} s"
                )
            time.sleep(0.05)
            waited += 0.05
        elif got[0] == "done":
            return got[1]


def compare(reply) -> None:
    """POST /compare {"messages", "max_tokens": the reply's token count
    (MAX_TOKENS at most), and any other chat field} -> Comparer's JSON."""
    s = reply.service
    body = reply.read_json()
    if s.comparer is None:
        raise RequestError("this server does not compare", status=404)
    n = body.get("max_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise RequestError(
            "'max_tokens' must be the reply's token count, 2 or more",
            param="max_tokens",
            code="invalid_value",
        )
    n = min(n, MAX_TOKENS)
    requests = s.parse("chat", {**body, "max_tokens": n, "stream": False})
    prompt, c = requests[0].prompt, s.comparer
    if not c.running.acquire(blocking=False):
        raise _refused("a Compare is running; one at a time", status=409)
    try:
        if _busy(s):
            raise _refused(
                "other requests are in flight: Compare times the model alone"
            )
        log(f"compare: started, {n} tokens on a prompt of {len(prompt)}")
        try:
            out = _drive(reply, c.steps(s.worker, prompt, n))
        except ConnectionAbortedError:
            log("compare: cancelled: the client left")
            raise
    finally:
        c.running.release()
    tps = {m: out["results"][m]["decode_tokens_per_second"] for m in out["modes"]}
    log(
        f"compare: {' | '.join(f'{m} {v} tok/s' for m, v in tps.items())} "
        f"({out['ratio']}x), {n} tokens, prompt {len(prompt)}, "
        f"{out['agree']}/{n} tokens alike"
        + (
            f", {c.other} built in {out['built_seconds']} s"
            if out["built_seconds"]
            else ""
        )
    )
    reply.send_json(200, out)
