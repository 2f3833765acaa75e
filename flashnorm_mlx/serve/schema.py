"""`flashnorm-mlx serve`: what a request may say, and the one record it
becomes.

Requests are checked against one table (FIELDS) of OpenAI's fields, each with
its type, range and default; anything else is refused with OpenAI's error body
{"error": {"message", "type", "param", "code"}}. A body that passes becomes
one `Request` per prompt (read_requests), the record the generation thread
and the HTTP handler read as it is.
"""

import json
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from queue import Queue
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..limits import SEED_NEED, TEMP_NEED, is_int, is_number, seed_ok

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TOP_LOGPROBS = {"chat": 20, "text": 5}  # as OpenAI
MAX_N = 8  # choices per prompt, decoded in one batch (docs/serve.md)


@dataclass
class Settings:
    """Server-wide defaults and limits (the CLI flags)."""

    max_tokens: int = 512  # reply budget when a request names none
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    min_tokens_to_keep: int = 1
    seed: Optional[int] = None  # seeds the per-request seeds of unseeded requests
    prefill_step_size: int = 512  # most prompt tokens per step of the generation thread
    prefill_chunk_seconds: float = 0.5  # what a step's prompt chunk aims at (pacing.py)
    prompt_cache_size: int = 10  # conversations whose KV caches are kept
    prompt_cache_bytes: Optional[int] = None  # their most bytes; None: no limit
    decode_concurrency: int = 32  # requests decoded together; the rest wait
    max_context: Optional[int] = None  # tokens; None: the model config's, if any
    api_key: Optional[str] = None  # every route but /health needs it when set


class RequestError(Exception):
    """A request the server refuses: sent as an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.kind = status, kind
        self.headers = headers or {}  # sent with the error (Retry-After)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


# --- the field table -------------------------------------------------------------


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_dict(v) -> bool:
    return isinstance(v, dict)


def _is_stop(v) -> bool:
    return _is_str(v) or (isinstance(v, list) and all(_is_str(x) for x in v))


def _stop_ok(v) -> bool:
    return (len(v) <= MAX_STOP_STRINGS and all(v)) if isinstance(v, list) else bool(v)


def _penalty_ok(v) -> bool:
    return -2 <= v <= 2  # as OpenAI


@dataclass(frozen=True)
class Field:
    """One request field: its check, what it must be (said in the error), the
    range it must lie in, its default (a value, or the Settings attribute
    named by `setting`) and the routes ("chat", "text") that read it."""

    name: str
    typed: Callable[[Any], bool]
    need: str
    ok: Optional[Callable[[Any], bool]] = None
    default: Any = None
    setting: Optional[str] = None
    kinds: Tuple[str, ...] = ("chat", "text")
    key: Optional[str] = None  # the Request attribute, when not `name`


FIELDS = (
    Field("model", _is_str, "a string"),
    Field("stream", _is_bool, "true or false", default=False),
    Field("stream_options", _is_dict, "an object", default={}),
    # max_tokens 0 is only for completions' echo (checked after the table).
    Field("max_tokens", is_int, "an integer >= 1", lambda v: v >= 0),
    Field(
        "max_completion_tokens",
        is_int,
        "an integer >= 1",
        lambda v: v >= 1,
        key="max_tokens",
    ),
    Field("temperature", is_number, TEMP_NEED, lambda v: v >= 0, setting="temp"),
    Field(
        "top_p",
        is_number,
        "a number > 0 and <= 1",
        lambda v: 0 < v <= 1,
        setting="top_p",
    ),
    # mlx-lm's make_sampler (and mlx_lm.server's names); 0: off.
    Field(
        "top_k", is_int, "an integer >= 0 (0: off)", lambda v: v >= 0, setting="top_k"
    ),
    Field(
        "min_p",
        is_number,
        "a number from 0 to 1 (0: off)",
        lambda v: 0 <= v <= 1,
        setting="min_p",
    ),
    Field(
        "min_tokens_to_keep",
        is_int,
        "an integer >= 1",
        lambda v: v >= 1,
        setting="min_tokens_to_keep",
    ),
    # mlx-lm's make_logits_processors (and mlx_lm.server's names and defaults).
    Field("logit_bias", _is_dict, "an object of token ids to numbers"),
    Field(
        "repetition_penalty",
        is_number,
        "a number >= 0 (0 or 1: off)",
        lambda v: v >= 0,
    ),
    Field("presence_penalty", is_number, "a number from -2 to 2", _penalty_ok),
    Field("frequency_penalty", is_number, "a number from -2 to 2", _penalty_ok),
    *(
        Field(f"{p}_context_size", is_int, "an integer >= 1", lambda v: v >= 1)
        for p in ("repetition", "presence", "frequency")
    ),
    Field("seed", is_int, SEED_NEED, seed_ok),
    Field(
        "n",
        is_int,
        f"an integer from 1 to {MAX_N}",
        lambda v: 1 <= v <= MAX_N,
        default=1,
    ),
    Field(
        "stop",
        _is_stop,
        f"a non-empty string or a list of up to {MAX_STOP_STRINGS} of them",
        _stop_ok,
        default=[],
    ),
    # Chat: logprobs true/false, top_logprobs 0-20.
    Field("logprobs", _is_bool, "true or false", default=False, kinds=("chat",)),
    Field(
        "top_logprobs",
        is_int,
        f"an integer from 0 to {MAX_TOP_LOGPROBS['chat']}",
        lambda v: 0 <= v <= MAX_TOP_LOGPROBS["chat"],
        kinds=("chat",),
    ),
    # Completions: logprobs 0-5 (how many top tokens; null: none), echo; true
    # and false as mlx_lm.server takes them (true: the chosen token's only).
    Field(
        "logprobs",
        lambda v: is_int(v) or _is_bool(v),
        f"an integer from 0 to {MAX_TOP_LOGPROBS['text']}, true, false or null",
        lambda v: _is_bool(v) or 0 <= v <= MAX_TOP_LOGPROBS["text"],
        kinds=("text",),
    ),
    Field("echo", _is_bool, "true or false", default=False, kinds=("text",)),
    # vLLM's: requests share cached prompt prefixes only under the same salt.
    Field("cache_salt", _is_str, "a string"),
)


# Fields that change what is sampled and that this server does not do: refused
# (400) unless absent, null or the value that changes nothing, never ignored.
# name: (routes, the neutral values, why not).
REFUSED = {
    "best_of": (("text",), (1,), "one completion per prompt is generated"),
    "suffix": (("text",), ("",), "text after the completion is not supported"),
    "xtc_probability": (
        ("chat", "text"),
        (0,),
        "XTC sampling draws from a random state shared by every request",
    ),
    "min_tokens": (("chat", "text"), (0,), "end of sequence is never masked"),
    "ignore_eos": (("chat", "text"), (False,), "end of sequence always ends"),
    "typical_p": (("chat", "text"), (1,), "typical sampling is not supported"),
    **{
        name: (("chat", "text"), (None,), "constrained decoding is not supported")
        for name in (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "grammar",
            "json_schema",
        )
    },
}


def _refuse_unsupported(kind: str, body: dict) -> None:
    for name, (kinds, neutral, why) in REFUSED.items():
        value = body.get(name)
        if kind in kinds and value is not None and not _same(value, neutral):
            said = " or ".join(json.dumps(v) for v in neutral if v is not None)
            raise RequestError(
                f"'{name}' is not supported: {why}"
                + (f" (leave it out, or send {said})" if said else " (leave it out)"),
                param=name,
                code="unsupported_parameter",
            )


def _same(value, neutral) -> bool:
    """value is one of `neutral`, and of its kind (true is not 1, nor 0 false)."""

    def kind(x):
        return "bool" if _is_bool(x) else "number" if is_number(x) else type(x)

    return any(kind(value) == kind(v) and value == v for v in neutral)


def _read(body: dict, f: Field, settings: Settings):
    """body[f.name] when present and not null, checked; else f's default."""
    value = body.get(f.name)
    if value is None:
        return getattr(settings, f.setting) if f.setting else f.default
    if not f.typed(value) or (f.ok is not None and not f.ok(value)):
        raise RequestError(
            f"'{f.name}' must be {f.need}, not {json.dumps(value)[:80]}",
            param=f.name,
            code="invalid_value" if f.typed(value) else "invalid_type",
        )
    return value


@dataclass
class Request:
    """One prompt's request, checked: made once from the JSON body
    (read_requests), then read as it is by the generation thread (scheduler)
    and by the HTTP handler that answers it.

    Events on `events`: ("text", (piece, [TokenLogprob])), ("done", result
    dict) or ("error", RequestError)."""

    kind: str  # "chat" or "text"
    prompt: List[int]
    max_tokens: int
    seed: int
    model: str
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    min_tokens_to_keep: int = 1  # by min-p
    stop: List[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    top_logprobs: Optional[int] = None  # None: no logprobs; else how many
    echo: bool = False  # completions: the prompt comes back, scored
    processors: Optional[dict] = None  # make_logits_processors' arguments
    cache_scope: tuple = ()  # (API key scope, cache_salt): who shares cached prefixes
    constraint: Optional[Callable] = None  # structured.GrammarProcessor, its own
    overrun: int = 0  # tokens past max_tokens a constrained reply may take to close
    warning: Optional[str] = None  # said in the answer's "warning" field
    thought: bool = False  # the reply begins inside a thought (split.py)
    tools: Optional[List[dict]] = None  # a chat's tools, read once (chat_body.Chat)
    parallel_tool_calls: Optional[bool] = None  # a chat's, from the same Chat
    choices: int = 1  # n: choices of this prompt (usage counts its prompt once)
    cached: int = 0  # prompt tokens read from the prompt cache (set at its start)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    submitted: float = field(default_factory=time.perf_counter)
    events: Queue = field(default_factory=Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


def read_requests(
    kind: str,
    body: dict,
    prompts: List[List[int]],
    param: str,
    settings: Settings,
    model: str,
    vocab_size: int,
    draw_seed: Callable[[], int],
    key_scope: Optional[str] = None,
) -> List[Request]:
    """The Requests of a /v1/chat/completions ("chat") or /v1/completions
    ("text") body, one per prompt (token ids, from body[param]): its FIELDS
    checked, then what needs the prompts and the model (logit bias token ids,
    the context length); a RequestError names the first bad one. An unseeded
    body draws one seed (draw_seed) for all its prompts."""
    _refuse_unsupported(kind, body)
    got = _fields(kind, body, settings)
    include_usage = _read(
        got["stream_options"],
        Field("include_usage", _is_bool, "true or false", default=False),
        settings,
    )
    stop = got["stop"]
    top = _top_logprobs(kind, got)
    if got["max_tokens"] == 0 and not got.get("echo"):
        raise RequestError(
            "'max_tokens' must be an integer >= 1 (0 only with 'echo': true)",
            param="max_tokens",
            code="invalid_value",
        )
    processors = _processors(got)
    _check_prompts(got, prompts, processors, vocab_size)
    n = got["n"]
    seed = got["seed"] if got["seed"] is not None else draw_seed()
    return [
        Request(
            kind=kind,
            prompt=prompt,
            max_tokens=_max_tokens(got["max_tokens"], prompt, param, settings),
            seed=choice_seed(seed, i),
            model=model,
            temp=float(got["temperature"]),
            top_p=float(got["top_p"]),
            top_k=got["top_k"],
            min_p=float(got["min_p"]),
            min_tokens_to_keep=got["min_tokens_to_keep"],
            stop=[stop] if isinstance(stop, str) else list(stop),
            stream=got["stream"],
            include_usage=include_usage,
            top_logprobs=top,
            echo=bool(got.get("echo")),
            processors=processors,
            cache_scope=(key_scope, got["cache_salt"]),
            choices=n,
        )
        for prompt in prompts
        for i in range(n)  # a prompt's n choices, next to each other
    ]


def _fields(kind: str, body: dict, settings: Settings) -> Dict[str, Any]:
    """{key: value} of every FIELDS entry `kind` reads, each checked alone."""
    got: Dict[str, Any] = {}
    for f in FIELDS:
        if kind in f.kinds:
            value = _read(body, f, settings)
            if value is not None or (f.key or f.name) not in got:
                got[f.key or f.name] = value
    return got


def _top_logprobs(kind: str, got: dict) -> Optional[int]:
    """How many top logprobs a token carries (None: no logprobs): chat's
    logprobs/top_logprobs pair, or text's logprobs count (true as 0)."""
    if kind == "chat":
        top = got["top_logprobs"]
        if top is not None and not got["logprobs"]:
            raise RequestError(
                "'top_logprobs' needs 'logprobs': true",
                param="top_logprobs",
                code="invalid_value",
            )
        return (top or 0) if got["logprobs"] else None
    top = got["logprobs"]
    return (0 if top else None) if _is_bool(top) else top


def _check_prompts(got: dict, prompts, processors, vocab_size: int) -> None:
    """What the fields ask of the prompts and the vocabulary: a stream takes
    one prompt, and logit_bias names token ids the model has."""
    if got["stream"] and len(prompts) > 1:
        raise RequestError(
            "a stream takes one prompt", param="prompt", code="invalid_value"
        )
    bias = (processors or {}).get("logit_bias", {})
    if bias and not all(0 <= t < vocab_size for t in bias):
        raise RequestError(
            f"'logit_bias' token ids must be in [0, {vocab_size})",
            param="logit_bias",
            code="invalid_value",
        )


def choice_seed(seed: int, i: int) -> int:
    """Choice i's own seed stream: the body's seed for the first (n=1 as
    before), one drawn from (seed, i) for the others, the same every time."""
    return seed if i == 0 else random.Random(f"{seed}:{i}").getrandbits(63)


def _max_tokens(asked: Optional[int], prompt: List[int], param, settings) -> int:
    """The reply budget of one prompt: what the body asked (None: the
    server's default, cut to the context left), refused past the context."""
    if not prompt:
        raise RequestError("the prompt is empty", param=param, code="invalid_value")
    limit, need = settings.max_context, asked if asked is not None else 1
    if limit is not None and len(prompt) + need > limit:
        raise RequestError(
            f"this model's maximum context length is {limit} tokens; the "
            f"request needs {len(prompt)} for the prompt and {need} for the "
            "reply",
            param=param,
            code="context_length_exceeded",
        )
    if asked is not None:
        return asked
    default = settings.max_tokens
    return default if limit is None else min(default, limit - len(prompt))


MAX_LOGIT_BIAS = 100  # as OpenAI: -100 bans a token, 100 all but forces it


def _processors(got: dict) -> Optional[dict]:
    """make_logits_processors' arguments, None when nothing is asked for.
    logit_bias's keys are token ids (checked against the vocabulary later)."""
    out: Dict[str, Any] = {}
    bias = got["logit_bias"]
    if bias:
        out["logit_bias"] = {}
        for k, v in bias.items():
            if not (isinstance(k, str) and k.strip().isdigit()):
                raise RequestError(
                    f"'logit_bias' keys must be token ids, not {json.dumps(k)[:40]}",
                    param="logit_bias",
                    code="invalid_value",
                )
            if not is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise RequestError(
                    f"'logit_bias' values must be numbers from -{MAX_LOGIT_BIAS} to "
                    f"{MAX_LOGIT_BIAS}, not {json.dumps(v)[:40]}",
                    param="logit_bias",
                    code="invalid_value",
                )
            out["logit_bias"][int(k)] = float(v)
    for p in ("repetition", "presence", "frequency"):
        penalty = got[f"{p}_penalty"]
        if penalty and not (p == "repetition" and penalty == 1):
            out[f"{p}_penalty"] = float(penalty)
            size = got[f"{p}_context_size"]
            if size is not None:
                out[f"{p}_context_size"] = size
    return out or None
