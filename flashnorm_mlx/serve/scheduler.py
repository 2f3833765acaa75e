"""`flashnorm-mlx serve`: the generation thread, continuous batching.

One thread owns the model and runs mlx-lm's `BatchGenerator`: every step
decodes one token for each request in flight in one forward pass (a
`BatchKVCache` with per-sequence offsets; prompts of different lengths are
left-padded and masked) and prefills a chunk of newly arrived prompts. Requests
join as they arrive, up to `decode_concurrency`, and leave as they finish, hit
a stop string, or their client goes. Each has its own sampler (temperature,
top-p, min-p, top-k and a random key of its own), logits processors (logit
bias, penalties), max tokens and stop strings. Finished caches go to mlx-lm's
`LRUPromptCache`, and a new request starts from the longest cached prefix of
its prompt.

Text is the exact decoding of the tokens in context (Detokenizer): the reply
is decode(prompt + reply)[len(decode(prompt)):], grown a piece per token.

The tokenizer lock is taken only to turn tokens into text, never across a
forward pass.
"""

import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from .schema import RequestError, Settings, TokenLogprob

LOG_PREFIX = "flashnorm-mlx serve:"
MODEL_KEY = "model"  # one model per server: one key in the prompt cache


def log(line: str) -> None:
    print(f"{LOG_PREFIX} {line}", file=sys.stderr, flush=True)


@dataclass
class Job:
    """One checked, tokenized request, and the queue its answers go to.

    Events: ("text", (piece, [TokenLogprob])), ("done", result dict) or
    ("error", RequestError)."""

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
    top_logprobs: Optional[int] = None  # None: no logprobs
    echo: bool = False  # completions: the prompt comes back, scored
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    min_tokens_to_keep: int = 1  # by min-p
    processors: Optional[dict] = None  # make_logits_processors' arguments
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    submitted: float = field(default_factory=time.perf_counter)
    events: Queue = field(default_factory=Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


def make_seeded_sampler(
    temp: float,
    top_p: float,
    seed: int,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
):
    """mlx-lm's make_sampler (top-p, min-p, top-k, in its order, then
    temperature) with a key of the request's own: requests in one batch never
    share random state, so a seed gives the same tokens whatever else the
    server is doing. Called on its own row, (1, vocab) logprobs."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

    if temp == 0:
        return make_sampler(0.0)
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p, min_tokens_to_keep)
        if 0 < top_k < logprobs.shape[-1]:  # top_k >= the vocabulary: all kept
            logprobs = apply_top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


REPLACEMENT = "\ufffd"  # what decode makes of a character cut between tokens


class Detokenizer:
    """Text grown a token at a time, always the exact decoding in context:
    the pieces of tokens added after `context` join to
    decode(context + tokens)[len(decode(context)):] (and the context's trailing
    partial character, if it ends in one).

    Each piece is a window re-decoded, decode(ids[prefix:] + [t]) less the
    window's text before (decode(ids[prefix:read])), so spaces a tokenizer
    drops at the start of a text (mlx-lm's streaming detokenizers drop the
    first token's leading space) are kept. A piece that ends in U+FFFD, a
    character whose bytes are not all in yet, is held back and comes whole
    with the token that completes it (as TGI and vLLM do); past HOLD_MAX
    tokens it is let go (bytes that never make a character)."""

    HOLD_MAX = 16
    CONTEXT = 4  # tokens of context kept before the text not yet sent

    def __init__(self, decode: Callable, context: List[int] = ()):
        self.decode = decode
        self.ids = list(context)
        read = len(self.ids)
        # A context cut inside a character: its last bytes wait for the reply's.
        while read > max(0, len(self.ids) - 3) and self._text(
            read - self.CONTEXT, read
        ).endswith(REPLACEMENT):
            read -= 1
        self.prefix, self.read = max(0, read - self.CONTEXT), read
        self.prefix_text = self._text(self.prefix, read)
        self.emitted = 0  # characters given out by add and flush

    def _text(self, start: int, end: int, extra: List[int] = ()) -> str:
        return self.decode(self.ids[max(0, start) : end] + list(extra))

    def piece(self, token: int, final: bool = False) -> str:
        """The text `token` would add now (held back: ""); nothing changes."""
        text = self._text(self.prefix, len(self.ids), [token])
        held = len(self.ids) + 1 - self.prefix
        if len(text) > len(self.prefix_text) and (
            final or not text.endswith(REPLACEMENT) or held > self.HOLD_MAX
        ):
            return text[len(self.prefix_text) :]
        return ""

    def add(self, token: int, final: bool = False) -> str:
        """Add `token`; the text it adds (final: nothing held back)."""
        piece = self.piece(token, final)
        self.ids.append(token)
        if piece:
            self.prefix, self.read = self.read, len(self.ids)
            self.prefix_text = self._text(self.prefix, self.read)
            self.emitted += len(piece)
        return piece

    def flush(self) -> str:
        """The text still held back (a last partial character, as U+FFFD)."""
        text = self._text(self.prefix, len(self.ids))
        if len(self.ids) == self.read or len(text) <= len(self.prefix_text):
            return ""
        piece = text[len(self.prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self._text(self.prefix, self.read)
        self.emitted += len(piece)
        return piece


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


def top_logprobs(rows: List[mx.array], tokens: List[int], ks: List[int]):
    """[(logprob of token, [(id, logprob)] of the k best, best first)] for
    each (vocab,) log-softmax row: one evaluation for them all."""
    chosen = [row[t] for row, t in zip(rows, tokens)]
    ids = [
        mx.argpartition(-row, kth=k - 1)[:k] if k else None for row, k in zip(rows, ks)
    ]
    vals = [row[i] if i is not None else None for row, i in zip(rows, ids)]
    mx.eval(chosen, [x for x in ids + vals if x is not None])
    out = []
    for c, i, v in zip(chosen, ids, vals):
        top = (
            sorted(zip(i.tolist(), v.tolist()), key=lambda p: -p[1])
            if i is not None
            else []
        )
        out.append((c.item(), top))
    return out


def score_prompt(model, prompt: List[int], k: int, chunk: int):
    """Log-softmax scores of prompt[1:] given what precedes each, from one
    cached pass over prompt[:-1] in chunks: ([(logprob, top k)] per token, the
    cache, which then holds prompt[:-1])."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = []
    feed = prompt[:-1]
    for i in range(0, len(feed), chunk):
        logits = model(mx.array(feed[i : i + chunk])[None], cache=cache)[0]
        logits = logits.astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        n = lp.shape[0]
        rows += top_logprobs(list(lp), prompt[i + 1 : i + 1 + n], [k] * n)
    return rows, cache


@dataclass
class _Run:
    """A job in the generation thread and where it stands."""

    job: Job
    cached: int  # prompt tokens reused from the prompt cache
    stops: StopText
    detokenizer: Optional[Detokenizer] = None
    uid: Optional[int] = None  # in the BatchGenerator
    ids: List[int] = field(default_factory=list)
    entries: Optional[List[TokenLogprob]] = None  # with logprobs: one per token
    echo_text: str = ""
    batch_max: int = 0  # most sequences decoded in one step with this one
    finish_reason: Optional[str] = None
    started: float = field(default_factory=time.perf_counter)
    first: Optional[float] = None  # time of the first generated token
    last: Optional[float] = None


class Worker:
    """The generation thread: owns the model and its BatchGenerator."""

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
        self.model = self.pool = self.gen = None  # freed on the thread that made them
        # MLX wants a thread's streams destroyed before it ends, or the process
        # may abort at exit ("terminate called without an active exception").
        mx.synchronize()
        mx.clear_streams()
        self.ready.set()  # after a failed build: once this thread is done with MLX

    def _new_generator(self):
        from mlx_lm.generate import BatchGenerator

        s = self.settings
        return BatchGenerator(
            self.model,
            max_tokens=s.max_tokens,
            completion_batch_size=s.decode_concurrency,
            prefill_batch_size=min(8, s.decode_concurrency),
            prefill_step_size=s.prefill_step_size,
            stream=self.stream,
        )

    def _run(self):
        from mlx_lm.generate import make_stop_sequences
        from mlx_lm.models.cache import LRUPromptCache

        # All generation on this thread's default stream, as mlx_lm.server does.
        self.stream = mx.default_stream(mx.default_device())
        self.pool = LRUPromptCache(self.settings.prompt_cache_size)
        # End of sequence by token id; stop strings are matched on text (StopText).
        self.eos = make_stop_sequences(self.tokenizer)
        self.gen = self._new_generator()
        self.runs: Dict[int, _Run] = {}
        while not self.stopping.is_set():
            try:
                self._admit()
                self._leave(
                    [u for u, r in self.runs.items() if r.job.cancelled.is_set()]
                )
                if self.runs:
                    self._step()
            except Exception as e:  # nothing may stop the generation thread
                log(f"internal error: {e}\n{traceback.format_exc()}")
                # The batch may be half-updated: fail its requests, start afresh.
                for run in self.runs.values():
                    self._fail(run.job, f"internal error: {e}")
                self.runs = {}
                self.gen.close()
                self.gen = self._new_generator()
            self.active = len(self.runs)
        self.gen.close()
        bye = "the server is shutting down"
        for run in self.runs.values():
            self._fail(run.job, bye, 503)
        while not self.queue.empty():
            self._fail(self.queue.get_nowait(), bye, 503)

    def _admit(self) -> None:
        """Move waiting jobs into the batch (block briefly when idle)."""
        while len(self.runs) < self.settings.decode_concurrency:
            try:
                job = (
                    self.queue.get(timeout=0.1)
                    if not self.runs
                    else self.queue.get_nowait()
                )
            except Empty:
                return
            if job.cancelled.is_set():
                continue
            try:
                self._start(job)
            except Exception as e:  # this request fails; the others go on
                log(f"internal error: {e}\n{traceback.format_exc()}")
                self._fail(job, f"internal error: {e}")

    def _start(self, job: Job) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        run = _Run(job, 0, StopText(job.stop))
        if job.top_logprobs is not None:
            run.entries = []
        if job.echo:
            # Scores for every prompt token: a pass of its own, no cache reused.
            with mx.stream(self.stream):
                rows, cache = score_prompt(
                    self.model,
                    job.prompt,
                    job.top_logprobs or 0,
                    self.settings.prefill_step_size,
                )
            rest, run.cached = job.prompt[-1:], 0
            last = len(job.prompt) - 1
            with self.lock:  # the prompt's text, token by token as the reply's
                run.detokenizer = Detokenizer(self.tokenizer.decode)
                pieces = [
                    self._add(run, t, score, final=job.max_tokens == 0 and i == last)[0]
                    for i, (t, score) in enumerate(zip(job.prompt, [(None, [])] + rows))
                ]
            run.echo_text = "".join(pieces)
            if job.stream:  # the prompt's text is the stream's start
                job.events.put(("text", (run.echo_text, list(run.entries or []))))
            if job.max_tokens == 0:  # nothing to generate: answered now
                run.batch_max, run.finish_reason = 1, "length"
                run.first = run.last = time.perf_counter()
                self._keep(cache, job.prompt[:-1])
                self._finish(run)
                return
            fed = job.prompt[:-1]
        else:
            with self.lock:  # the reply's text follows the prompt's
                run.detokenizer = Detokenizer(self.tokenizer.decode, job.prompt)
            cache, rest = self.pool.fetch_nearest_cache(MODEL_KEY, job.prompt)
            if cache is not None and not rest:
                # The whole prompt is cached: feed its last token again for logits.
                rest = job.prompt[-1:] if trim_prompt_cache(cache, 1) == 1 else None
            if cache is None or rest is None:
                cache, rest = None, list(job.prompt)
            run.cached = len(job.prompt) - len(rest)
            fed = job.prompt[: run.cached]
        (run.uid,) = self.gen.insert(
            [list(rest)],
            max_tokens=[job.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[list(fed)],
            samplers=[
                make_seeded_sampler(
                    job.temp,
                    job.top_p,
                    job.seed,
                    job.top_k,
                    job.min_p,
                    job.min_tokens_to_keep,
                )
            ],
            logits_processors=[self._processors(job)],
            stop_sequences=[self.eos],
        )
        self.runs[run.uid] = run

    def _step(self) -> None:
        """One BatchGenerator step: a token for every sequence decoding, a
        prefill chunk for those still reading their prompts."""
        _, responses = self.gen.next()
        now = time.perf_counter()
        n = len(responses)
        runs = [self.runs[r.uid] for r in responses]
        scored = [
            (run, r) for run, r in zip(runs, responses) if run.entries is not None
        ]
        rows = top_logprobs(
            [r.logprobs for _, r in scored],
            [r.token for _, r in scored],
            [run.job.top_logprobs for run, _ in scored],
        )
        scores = {run.uid: row for (run, _), row in zip(scored, rows)}
        leaving, done = [], []
        with self.lock:  # text only: the forward pass above ran without it
            for run, r in zip(runs, responses):
                run.ids.append(r.token)
                run.first, run.last = run.first or now, now
                run.batch_max = max(run.batch_max, n)
                eos = r.finish_reason == "stop"  # "stop" here: end of sequence
                text, new = self._add(
                    run,
                    r.token,
                    scores.get(run.uid),
                    final=r.finish_reason is not None,
                    add=not eos,
                )
                if eos:  # no text of its own; what was held back comes out
                    text = run.detokenizer.flush()
                piece, stopped = run.stops.add(text)
                if r.finish_reason or stopped:
                    run.finish_reason = "stop" if stopped else r.finish_reason
                    piece += run.stops.flush()
                    if r.finish_reason:  # the BatchGenerator let it go already
                        done.append((run, r.prompt_cache, r.all_tokens))
                    else:
                        leaving.append(run)
                if run.job.stream and (piece or new):
                    run.job.events.put(("text", (piece, new)))
        if leaving:
            caches = self.gen.remove(
                [r.uid for r in leaving], return_prompt_caches=True
            )
            done += [(run, *caches.get(run.uid, (None, None))) for run in leaving]
        for run, _, _ in done:
            del self.runs[run.uid]
        self.active = len(self.runs)  # counted out before their answers go out
        for run, cache, tokens in done:
            self._keep(cache, tokens)
            self._finish(run)

    def _leave(self, uids: List[int]) -> None:
        """Requests whose clients left: out of the batch at once, caches kept."""
        if not uids:
            return
        caches = self.gen.remove(uids, return_prompt_caches=True)
        for uid in uids:
            del self.runs[uid]
            self._keep(*caches.get(uid, (None, None)))

    def _keep(self, cache, tokens) -> None:
        """Into the prompt cache, if it holds exactly `tokens`."""
        if cache and tokens and int(getattr(cache[0], "offset", -1)) == len(tokens):
            self.pool.insert_cache(MODEL_KEY, list(tokens), cache)

    @staticmethod
    def _add(run: _Run, token: int, score, final=False, add=True):
        """(the text `token` adds to run's, [its TokenLogprob] when run has
        logprobs, from score = (logprob, top k)). A token's text in logprobs
        is the text it adds in context, its alternatives' the text each would
        have added, so text_offset indexes the answer's text. add=False: an
        end-of-sequence token, which adds none. Lock held by the caller."""
        d = run.detokenizer
        entries = []
        if run.entries is not None:
            lp, top = score
            at = d.emitted
            alts = [(i, d.piece(i, final), v) for i, v in top if i != token]
        text = d.add(token, final) if add else d.piece(token, final)
        if run.entries is not None:
            alts += [(token, text, v) for i, v in top if i == token]
            top_text = [(t, v) for _, t, v in sorted(alts, key=lambda a: -a[2])]
            entries = [TokenLogprob(text, lp, top_text, at)]
            run.entries += entries
        return (text if add else ""), entries

    @staticmethod
    def _processors(job: Job) -> list:
        """mlx-lm's logits processors for the job's logit bias and penalties."""
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(**job.processors) if job.processors else []

    def _finish(self, run: _Run) -> None:
        job = run.job
        n = len(run.ids)
        prompt_s = run.first - run.started
        gen_s = run.last - run.first
        result = {
            "text": run.echo_text + run.stops.text,
            "finish_reason": run.finish_reason,
            "logprobs": run.entries,
            "usage": {
                "prompt_tokens": len(job.prompt),
                "completion_tokens": n,
                "total_tokens": len(job.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": run.cached},
            },
            # Per response, as this client saw it (other requests' work included).
            "timings": {
                "queued_seconds": round(run.started - job.submitted, 4),
                "prompt_seconds": round(prompt_s, 4),
                "prompt_tokens_per_second": _rate(
                    len(job.prompt) - run.cached, prompt_s
                ),
                "generation_seconds": round(gen_s, 4),
                "generation_tokens_per_second": _rate(n - 1, gen_s),
                "batch_max": run.batch_max,
            },
        }
        job.events.put(("done", result))
        t = result["timings"]
        log(
            f"{job.kind} {job.id[:8]}: prompt {len(job.prompt)} tokens "
            f"({run.cached} cached), {t['prompt_tokens_per_second']} tok/s | "
            f"{n} tokens, {t['generation_tokens_per_second']} tok/s | "
            f"batch {run.batch_max} | {run.finish_reason}"
        )

    def _fail(self, job: Job, message: str, status: int = 500) -> None:
        job.events.put(
            ("error", RequestError(message, status=status, kind="server_error"))
        )


def _rate(tokens: int, seconds: float) -> Optional[float]:
    """tokens/sec rounded, or None where there is nothing to time."""
    return round(tokens / seconds, 2) if tokens > 0 and seconds > 0 else None
