"""What the HTTP threads share: the model's tokenizer, settings and generation
worker; and each request body made into the Requests the worker runs."""

import random
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

from ..thinking import starts_in_thought
from .auth import current_scope
from .bounds import REQUEST_CONTEXTS, Budget, bytes_per_token, check_fits
from .chat_body import Chat, read_chat
from .log import log
from .prompts import read_prompts
from .scheduler import Worker
from .schema import Request, RequestError, Settings, read_requests
from .structured import constrain


class Service:
    """What the HTTP threads share: the model's tokenizer, settings and worker.

    build() -> (model, tokenizer, config, its modes.Mode) runs on the
    generation thread: MLX
    streams are per thread, and arrays still lazy from another thread (weights
    read with mx.load, constants a model caches) cannot be evaluated there.
    """

    def __init__(
        self,
        build: Callable,
        model_id: str,
        settings: Settings,
        worker: Callable = Worker,
        comparer=None,
    ):
        self.tokenizer = self.mode = None  # set by start(): what the build settled
        self.model_id, self.settings = model_id, settings
        self.started = int(time.time())
        # HF fast tokenizers refuse concurrent use ("Already borrowed"): HTTP
        # threads tokenize under this lock; the worker decodes with a copy of
        # its own, under a lock of its own, so a long tokenization here never
        # holds up a generation step.
        self.tokenizer_lock = threading.Lock()
        self._seeds = random.Random(settings.seed)
        self._seeds_lock = threading.Lock()
        # Worker: mlx-lm's BatchGenerator; sequential.SequentialWorker with a
        # draft or KV cache options (docs/design.md section 3f).
        self.worker = worker(build, settings, threading.Lock())
        self.comparer = comparer  # the page's Compare (compare.Comparer) or None
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
        from ..engine import engine_of
        from ..grammar import Grammars
        from ..machine import device_info
        from ..models import context_length

        w = self.worker
        w.thread.start()
        w.ready.wait()
        if w.build_error is not None:
            w.thread.join()
            raise w.build_error
        self.tokenizer, self.mode = w.tokenizer, w.mode.name
        if self.comparer is not None:  # rows named by the server's mode
            self.comparer.settle(w.mode)
        # What the chat page's header names (routes.props).
        self.engine, self.device = engine_of(w.model), device_info()["name"]
        self.vocab_size = len(self.tokenizer.get_vocab())
        self.bytes_per_token = bytes_per_token(self.tokenizer)  # bounds.py
        self.grammars = Grammars(self.tokenizer, self.tokenizer_lock)
        if self.settings.max_context is None:
            self.settings.max_context = context_length(w.config)

    @contextmanager
    def submitted(
        self, kind: str, body: dict, key_scope: Optional[str] = None
    ) -> Iterator[List[Request]]:
        """The body's Requests (parse), handed to the worker while the caller
        answers them; on leaving, those not finished are cancelled (their
        client left) and the body no longer counts as in flight. key_scope:
        the API key's (auth.key_scope), the prompt cache's scope; None: the
        one this HTTP thread's key check found."""
        requests = self.parse(kind, body, key_scope or current_scope())
        self.track(+1)
        try:
            for request in requests:
                self.worker.submit(request)
            yield requests
        finally:
            for request in requests:  # a no-op for those finished
                request.cancelled.set()
            self.track(-1)

    def parse(
        self, kind: str, body: dict, key_scope: Optional[str] = None
    ) -> List[Request]:
        """The Requests of a /v1/chat/completions ("chat") or /v1/completions
        ("text") body: a chat's fields read once (chat_body.py), its prompts as
        token ids, then one Request per prompt (a completions request may
        hold several), made by schema.py."""
        chat = self.read_chat(body) if kind == "chat" else None
        prompts, param = self._prompts(body, chat)
        model = body.get("model")  # echoed, as mlx_lm.server does
        requests = read_requests(
            kind,
            body,
            prompts,
            param,
            self.settings,
            model=model if isinstance(model, str) and model else self.model_id,
            vocab_size=self.vocab_size,
            draw_seed=self._draw_seed,
            key_scope=key_scope,
        )
        # response_format (both routes); a chat's strict or forced tools.
        constrain(self, requests, body.get("response_format"), chat)
        if chat is not None and chat.warning:
            log(f"warning: {chat.warning}", "WARNING")
        for r in requests:
            if chat is not None:
                r.warning, r.tools = chat.warning, chat.tools
                r.parallel_tool_calls = chat.parallel
                r.thought = starts_in_thought(self.tokenizer, r.prompt)
        return requests

    def read_chat(self, body: dict) -> Chat:
        """A chat body's fields (chat_body.read_chat), its messages counted first."""
        self.fits_messages(body)  # before 500,000 of them are copied
        return read_chat(body, self.tokenizer)

    def chat_prompt(self, body: dict) -> List[int]:
        """The token ids a chat body's messages render to (its tools and
        template arguments too), as parse() would run them."""
        return self._render(self.read_chat(body))

    def fits(self, texts: List[str], param: str, each: int = 0, items=0) -> None:
        """400 before tokenizing for texts that cannot fit the context
        (bounds.py); each=1: every text is a prompt of its own, and all
        together REQUEST_CONTEXTS contexts at most; items: tokens besides
        the texts (a chat's messages, one each at least)."""
        limit, per = self.settings.max_context, self.bytes_per_token
        for text in texts if each else ():
            check_fits([text], per, limit, param)
        whole = limit * REQUEST_CONTEXTS if each and limit else limit
        check_fits(texts, per, whole, param, items)

    def fits_messages(self, body: dict, field: str = "messages") -> None:
        """A chat body's messages, counted before they are read: a token each."""
        messages = body.get(field)
        if isinstance(messages, list):
            self.fits([], field, items=len(messages))

    def encoder(self, param: str) -> Callable[[str], List[int]]:
        """tokenizer.encode under the lock one text at a time (other requests'
        texts go between), each counted against the request's Budget."""
        budget = Budget(self.settings.max_context, param)

        def encode(text: str, **kwargs) -> List[int]:
            with self.tokenizer_lock:
                ids = self.tokenizer.encode(text, **kwargs)
            budget.take(len(ids))
            return ids

        return encode

    def _draw_seed(self) -> int:
        """A seed for a request that names none (--seed seeds these draws)."""
        with self._seeds_lock:
            return self._seeds.getrandbits(63)

    def _prompts(self, body: dict, chat: Optional[Chat]):
        """(token id lists, the field they came from) of a request body: a
        chat's one rendered prompt, or a completions request's prompts."""
        if chat is not None:
            return [self._render(chat)], "messages"
        prompt = body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if isinstance(texts, list):
            self.fits([p for p in texts if isinstance(p, str)], "prompt", 1)
        prompts = read_prompts(body, self.encoder("prompt"), self.vocab_size)
        return prompts, "prompt"

    def _render(self, chat: Chat) -> List[int]:
        """The chat template's token ids for a chat's messages, tools and
        template arguments (mlx_lm.server's, over --chat-template-args)."""
        messages, tools = chat.messages, chat.tools
        extra = {**chat.template_kwargs, **({"tools": tools} if tools else {})}
        extra["add_generation_prompt"] = True
        self.fits([m["content"] for m in messages], "messages", items=len(messages))
        with self.tokenizer_lock:
            try:
                ids = self.tokenizer.apply_chat_template(messages, **extra)
            except Exception as e:  # the template's own refusals (jinja)
                raise RequestError(
                    f"the chat template refused the messages: {e}",
                    param="messages",
                ) from None
        return [int(i) for i in ids]
