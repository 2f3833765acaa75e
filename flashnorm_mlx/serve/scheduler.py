"""`flashnorm-mlx serve`: the generation thread, continuous batching.

One thread owns the model and runs mlx-lm's `BatchGenerator`: every step
decodes one token for each request in flight in one forward pass (a
`BatchKVCache` with per-sequence offsets; prompts of different lengths are
left-padded and masked) and prefills a chunk of newly arrived prompts. Requests
join as they arrive, up to `decode_concurrency`, and leave as they finish, hit
a stop string, or their client goes. A prompt is read in chunks timed to about
--prefill-chunk-seconds each (pacing.py), so running streams wait one chunk. Each has its own sampler (temperature,
top-p, min-p, top-k and a random key of its own), logits processors (logit
bias, penalties), max tokens and stop strings. Finished caches go to mlx-lm's
`LRUPromptCache`, and a new request starts from the longest cached prefix of
its prompt within its own scope (its API key's and its cache_salt's).

Text is the exact decoding of the tokens in context (text.Detokenizer): the
reply is decode(prompt + reply)[len(decode(prompt)):], grown a piece per token.

This thread turns tokens into text with a copy of the tokenizer of its own
(`decoder`): the HTTP threads tokenize with the other one, and a long prompt
being tokenized there never holds up a step here.
"""

import copy
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import Empty, Queue
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from ..thinking import reasoning_tokens
from .log import log
from .logprobs import TokenLogprob, score_prompt, top_logprobs
from .pacing import PrefillPace
from .schema import Request, RequestError, Settings
from .text import Detokenizer, StopText

MODEL_KEY = "model"  # one model per server: one key in the prompt cache


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


@dataclass
class _Run:
    """A request in the generation thread and where it stands."""

    request: Request
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
        self.model = self.tokenizer = self.config = self.mode = None
        self.build_error = None
        self.ready = threading.Event()
        self.lock = tokenizer_lock
        self.pace = PrefillPace(
            settings.prefill_chunk_seconds, settings.prefill_step_size
        )
        self.queue: Queue = Queue()
        self.calls: Queue = Queue()  # (fn, Future): call() on this thread
        self.active = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(
            target=self._main, name="generation", daemon=True
        )

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopping.is_set()

    def submit(self, request: Request) -> None:
        if not self.alive:
            raise RequestError(
                "the server is shutting down", status=503, kind="server_error"
            )
        self.queue.put(request)

    def call(self, fn: Callable, timeout: float):
        """fn(self) on the generation thread between two batch steps (the
        model's thread: MLX streams are per thread); its result, or its error.
        Requests in flight wait meanwhile (the page's Compare, serve/compare.py)."""
        if not self.alive:
            raise RequestError(
                "the server is shutting down", status=503, kind="server_error"
            )
        done: Future = Future()
        self.calls.put((fn, done))
        return done.result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the current step; waiting requests get a 503 error."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # the generation thread -----------------------------------------------------

    def _main(self):
        try:
            self.model, self.tokenizer, self.config, self.mode = self.build()
            self.decoder = copy.deepcopy(self.tokenizer)  # this thread's alone
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
        limit = self.settings.prompt_cache_bytes
        self.pool = LRUPromptCache(
            self.settings.prompt_cache_size, **({"max_bytes": limit} if limit else {})
        )
        # End of sequence by token id; stop strings are matched on text (StopText).
        self.eos = make_stop_sequences(self.decoder)
        self.gen = self._new_generator()
        self.runs: Dict[int, _Run] = {}
        while not self.stopping.is_set():
            try:
                self._run_calls()
                self._admit()
                self._leave(
                    [u for u, r in self.runs.items() if r.request.cancelled.is_set()]
                )
                if self.runs:
                    self._step()
            except Exception as e:  # nothing may stop the generation thread
                log(f"internal error: {e}\n{traceback.format_exc()}", "ERROR")
                # The batch may be half-updated: fail its requests, start afresh.
                for run in self.runs.values():
                    self._fail(run.request, f"internal error: {e}")
                self.runs = {}
                self.gen.close()
                self.gen = self._new_generator()
            self.active = len(self.runs)
        self.gen.close()
        bye = "the server is shutting down"
        for run in self.runs.values():
            self._fail(run.request, bye, 503)
        while not self.queue.empty():
            self._fail(self.queue.get_nowait(), bye, 503)
        while not self.calls.empty():
            self.calls.get_nowait()[1].set_exception(
                RequestError(bye, status=503, kind="server_error")
            )

    def _run_calls(self) -> None:
        """The call()s waiting, each to its end (its error goes to its caller)."""
        while not self.calls.empty():
            fn, done = self.calls.get_nowait()
            try:
                done.set_result(fn(self))
            except Exception as e:
                done.set_exception(e)

    def _admit(self) -> None:
        """Move waiting requests into the batch (block briefly when idle)."""
        while len(self.runs) < self.settings.decode_concurrency:
            try:
                request = (
                    self.queue.get(timeout=0.1)
                    if not self.runs
                    else self.queue.get_nowait()
                )
            except Empty:
                return
            if request.cancelled.is_set():
                continue
            try:
                self._start(request)
            except Exception as e:  # this request fails; the others go on
                log(f"internal error: {e}\n{traceback.format_exc()}", "ERROR")
                self._fail(request, f"internal error: {e}")

    def _start(self, request: Request) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        log(
            f"{request.kind} {request.id[:8]}: started, prompt {len(request.prompt)} "
            f"tokens, max_tokens {request.max_tokens}",
            "DEBUG",
        )
        run = _Run(request, 0, StopText(request.stop))
        if request.top_logprobs is not None:
            run.entries = []
        if request.echo:
            # Scores for every prompt token: a pass of its own, no cache reused.
            with mx.stream(self.stream):
                rows, cache = score_prompt(
                    self.model,
                    request.prompt,
                    request.top_logprobs or 0,
                    self.settings.prefill_step_size,
                )
            rest, run.cached = request.prompt[-1:], 0
            last = len(request.prompt) - 1
            with self.lock:  # the prompt's text, token by token as the reply's
                run.detokenizer = Detokenizer(self.decoder.decode)
                pieces = [
                    self._add(
                        run, t, score, final=request.max_tokens == 0 and i == last
                    )[0]
                    for i, (t, score) in enumerate(
                        zip(request.prompt, [(None, [])] + rows)
                    )
                ]
            run.echo_text = "".join(pieces)
            if request.stream:  # the prompt's text is the stream's start
                request.events.put(("text", (run.echo_text, list(run.entries or []))))
            if request.max_tokens == 0:  # nothing to generate: answered now
                run.batch_max, run.finish_reason = 1, "length"
                run.first = run.last = time.perf_counter()
                self._keep(cache, request.prompt[:-1], request)
                self._finish(run)
                return
            fed = request.prompt[:-1]
        else:
            with self.lock:  # the reply's text follows the prompt's
                run.detokenizer = Detokenizer(self.decoder.decode, request.prompt)
            cache, rest = self.pool.fetch_nearest_cache(
                (MODEL_KEY, request.cache_scope), request.prompt
            )
            if cache is not None and not rest:
                # The whole prompt is cached: feed its last token again for logits.
                rest = request.prompt[-1:] if trim_prompt_cache(cache, 1) == 1 else None
            if cache is None or rest is None:
                cache, rest = None, list(request.prompt)
            run.cached = len(request.prompt) - len(rest)
            request.cached = run.cached  # before its first event (anthropic.py)
            fed = request.prompt[: run.cached]
        (run.uid,) = self.gen.insert(
            [list(rest)],
            max_tokens=[request.max_tokens + request.overrun],
            caches=[cache] if cache is not None else None,
            all_tokens=[list(fed)],
            samplers=[
                make_seeded_sampler(
                    request.temp,
                    request.top_p,
                    request.seed,
                    request.top_k,
                    request.min_p,
                    request.min_tokens_to_keep,
                )
            ],
            logits_processors=[self._processors(request)],
            stop_sequences=[self.eos],
        )
        self.runs[run.uid] = run

    def _step(self) -> None:
        """One BatchGenerator step: a token for every sequence decoding, a
        prefill chunk for those still reading their prompts."""
        stats = getattr(self.gen, "stats", None)  # the BatchGenerator's
        if stats is None:
            _, responses = self.gen.next()
        else:
            prompting = sum(r.first is None for r in self.runs.values())
            decoding = len(self.runs) > prompting
            self.gen.prefill_step_size = self.pace.step(min(prompting, 8), decoding)
            with stats() as did:
                _, responses = self.gen.next()
            self.pace.measured(did.prompt_tokens, did.prompt_time, did.decode_time)
        now = time.perf_counter()
        n = len(responses)
        runs = [self.runs[r.uid] for r in responses]
        scored = [
            (run, r) for run, r in zip(runs, responses) if run.entries is not None
        ]
        rows = top_logprobs(
            [r.logprobs for _, r in scored],
            [r.token for _, r in scored],
            [run.request.top_logprobs for run, _ in scored],
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
                cut = not (r.finish_reason or stopped) and self._spent(run)
                if r.finish_reason or stopped or cut:
                    # cut: the budget spent (with its overrun, where closing
                    # took one: the grammar masks end of sequence till then).
                    run.finish_reason = "stop" if stopped else r.finish_reason
                    run.finish_reason = run.finish_reason or "length"
                    piece += run.stops.flush()
                    if r.finish_reason:  # the BatchGenerator let it go already
                        done.append((run, r.prompt_cache, r.all_tokens))
                    else:
                        leaving.append(run)
                if run.request.stream and (piece or new):
                    run.request.events.put(("text", (piece, new)))
        if leaving:
            caches = self.gen.remove(
                [r.uid for r in leaving], return_prompt_caches=True
            )
            done += [(run, *caches.get(run.uid, (None, None))) for run in leaving]
        for run, _, _ in done:
            del self.runs[run.uid]
        self.active = len(self.runs)  # counted out before their answers go out
        for run, cache, tokens in done:
            self._keep(cache, tokens, run.request)
            self._finish(run)

    @staticmethod
    def _spent(run: _Run) -> bool:
        """Whether run's budget is spent: max_tokens made, and a grammar
        (if any) content to end there; else it runs on into its overrun."""
        request = run.request
        if len(run.ids) < request.max_tokens:
            return False
        return request.constraint is None or request.constraint.settled()

    def _leave(self, uids: List[int]) -> None:
        """Requests whose clients left: out of the batch at once, caches kept."""
        if not uids:
            return
        caches = self.gen.remove(uids, return_prompt_caches=True)
        for uid in uids:
            request = self.runs.pop(uid).request
            self._keep(*caches.get(uid, (None, None)), request)

    def _keep(self, cache, tokens, request: Request) -> None:
        """Into the prompt cache, in the request's scope, if it holds exactly
        `tokens`."""
        if cache and tokens and int(getattr(cache[0], "offset", -1)) == len(tokens):
            key = (MODEL_KEY, request.cache_scope)
            self.pool.insert_cache(key, list(tokens), cache)

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
    def _processors(request: Request) -> list:
        """mlx-lm's logits processors for the request's logit bias and penalties."""
        from mlx_lm.sample_utils import make_logits_processors

        out = make_logits_processors(**request.processors) if request.processors else []
        # The grammar's mask last: after logit bias, so a bias cannot unmask.
        return out + ([request.constraint] if request.constraint else [])

    def _finish(self, run: _Run) -> None:
        request = run.request
        n = len(run.ids)
        prompt_s = run.first - run.started
        gen_s = run.last - run.first
        result = {
            "text": run.echo_text + run.stops.text,
            "finish_reason": run.finish_reason,
            "stop_sequence": run.stops.hit,
            "logprobs": run.entries,
            "usage": {
                "prompt_tokens": len(request.prompt),
                "completion_tokens": n,
                "total_tokens": len(request.prompt) + n,
                "prompt_tokens_details": {"cached_tokens": run.cached},
                "completion_tokens_details": {
                    "reasoning_tokens": reasoning_tokens(
                        self.decoder, run.ids, request.thought
                    )
                },
            },
            # Per response, as this client saw it (other requests' work included).
            "timings": {
                "queued_seconds": round(run.started - request.submitted, 4),
                "prompt_seconds": round(prompt_s, 4),
                "prompt_tokens_per_second": _rate(
                    len(request.prompt) - run.cached, prompt_s
                ),
                "generation_seconds": round(gen_s, 4),
                "generation_tokens_per_second": _rate(n - 1, gen_s),
                "batch_max": run.batch_max,
            },
        }
        request.events.put(("done", result))
        t = result["timings"]
        log(
            f"{request.kind} {request.id[:8]}: prompt {len(request.prompt)} tokens "
            f"({run.cached} cached), {t['prompt_tokens_per_second']} tok/s | "
            f"{n} tokens, {t['generation_tokens_per_second']} tok/s | "
            f"batch {run.batch_max} | {run.finish_reason}"
        )

    def _fail(self, request: Request, message: str, status: int = 500) -> None:
        request.events.put(
            ("error", RequestError(message, status=status, kind="server_error"))
        )


def _rate(tokens: int, seconds: float) -> Optional[float]:
    """tokens/sec rounded, or None where there is nothing to time."""
    return round(tokens / seconds, 2) if tokens > 0 and seconds > 0 else None
