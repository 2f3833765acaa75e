"""What the HTTP threads share: the model's tokenizer, settings and generation
worker; and each request body made into the Jobs the worker runs."""

import random
import threading
import time
from typing import Callable, List

from .scheduler import Job, Worker
from .schema import RequestError, Settings, read_messages, read_options, read_prompts
from .tools import read_tools, with_tool_history


class Service:
    """What the HTTP threads share: the model's tokenizer, settings and worker.

    build() -> (model, tokenizer, config) runs on the generation thread: MLX
    streams are per thread, and arrays still lazy from another thread (weights
    read with mx.load, constants a model caches) cannot be evaluated there.
    """

    def __init__(
        self,
        build: Callable,
        model_id: str,
        mode: str,
        settings: Settings,
        worker: Callable = Worker,
    ):
        self.tokenizer = None  # set by start()
        self.model_id, self.mode, self.settings = model_id, mode, settings
        self.started = int(time.time())
        # HF fast tokenizers refuse concurrent use ("Already borrowed"): HTTP
        # threads tokenize and the worker detokenizes, each under this lock.
        self.tokenizer_lock = threading.Lock()
        self._seeds = random.Random(settings.seed)
        self._seeds_lock = threading.Lock()
        # Worker: mlx-lm's BatchGenerator; sequential.SequentialWorker with a
        # draft or KV cache options (docs/design.md section 3f).
        self.worker = worker(build, settings, self.tokenizer_lock)
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
        from ..machine import device_info
        from ..models import context_length

        w = self.worker
        w.thread.start()
        w.ready.wait()
        if w.build_error is not None:
            w.thread.join()
            raise w.build_error
        self.tokenizer = w.tokenizer
        # What the chat page's header names (routes.props).
        self.engine, self.device = engine_of(w.model), device_info()["name"]
        self.vocab_size = len(self.tokenizer.get_vocab())
        if self.settings.max_context is None:
            self.settings.max_context = context_length(w.config)

    def parse(self, kind: str, body: dict) -> List[Job]:
        """The Jobs of a /v1/chat/completions ("chat") or /v1/completions
        ("text") body: one per prompt (a completions request may hold several)."""
        o = read_options(kind, body, self.settings)
        prompts, param = self._prompts(kind, body, o.stream)
        bias = (o.processors or {}).get("logit_bias", {})
        if bias and not all(0 <= t < self.vocab_size for t in bias):
            raise RequestError(
                f"'logit_bias' token ids must be in [0, {self.vocab_size})",
                param="logit_bias",
                code="invalid_value",
            )
        seed = o.seed
        if seed is None:
            with self._seeds_lock:
                seed = self._seeds.getrandbits(63)
        return [self._job(kind, o, p, param, seed) for p in prompts]

    def _prompts(self, kind: str, body: dict, stream: bool):
        """(token id lists, the field they came from) of a request body."""
        if kind == "chat":
            messages = read_messages(body)
            if not getattr(self.tokenizer, "has_chat_template", False):
                raise RequestError(
                    "this model has no chat template; use /v1/completions",
                    param="messages",
                )
            tools = read_tools(body, self.tokenizer)  # 400 where the model cannot
            extra = {"tools": tools} if tools else {}
            if tools:
                messages = with_tool_history(messages, body)
            with self.tokenizer_lock:
                try:
                    ids = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=True, **extra
                    )
                except Exception as e:  # the template's own refusals (jinja)
                    raise RequestError(
                        f"the chat template refused the messages: {e}",
                        param="messages",
                    ) from None
            prompts, param = [[int(i) for i in ids]], "messages"
        else:
            with self.tokenizer_lock:
                prompts = read_prompts(body, self.tokenizer.encode, self.vocab_size)
            param = "prompt"
            if stream and len(prompts) > 1:
                raise RequestError(
                    "a stream takes one prompt", param="prompt", code="invalid_value"
                )
        return prompts, param

    def _job(self, kind: str, o, prompt: List[int], param: str, seed: int) -> Job:
        if not prompt:
            raise RequestError("the prompt is empty", param=param, code="invalid_value")
        max_tokens, limit = o.max_tokens, self.settings.max_context
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
            max_tokens = self.settings.max_tokens
            if limit is not None:
                max_tokens = min(max_tokens, limit - len(prompt))
        return Job(
            kind=kind,
            prompt=prompt,
            max_tokens=max_tokens,
            temp=o.temp,
            top_p=o.top_p,
            seed=seed,
            stop=o.stop,
            stream=o.stream,
            include_usage=o.include_usage,
            model=self.model_id,
            top_logprobs=o.top_logprobs,
            echo=o.echo,
            top_k=o.top_k,
            min_p=o.min_p,
            min_tokens_to_keep=o.min_tokens_to_keep,
            processors=o.processors,
        )
