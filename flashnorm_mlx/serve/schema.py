"""`flashnorm-mlx serve`: what a request may say and what an answer looks like.

Requests are checked against one table (FIELDS) of OpenAI's fields, each with
its type, range and default; anything else is refused with OpenAI's error body
{"error": {"message", "type", "param", "code"}}. Answers' logprobs are built
here in OpenAI's two shapes: chat's `content` entries and completions'
parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
"""

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_TOP_LOGPROBS = {"chat": 20, "text": 5}  # as OpenAI
ROLES = ("system", "developer", "user", "assistant", "tool")


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
    prefill_step_size: int = 512  # prompt tokens per step of the generation thread
    prompt_cache_size: int = 10  # conversations whose KV caches are kept
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


# --- the field table -------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


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
    key: Optional[str] = None  # the Options attribute, when not `name`


FIELDS = (
    Field("model", _is_str, "a string"),
    Field("stream", _is_bool, "true or false", default=False),
    Field("stream_options", _is_dict, "an object", default={}),
    # max_tokens 0 is only for completions' echo (checked after the table).
    Field("max_tokens", _is_int, "an integer >= 1", lambda v: v >= 0),
    Field(
        "max_completion_tokens",
        _is_int,
        "an integer >= 1",
        lambda v: v >= 1,
        key="max_tokens",
    ),
    Field(
        "temperature",
        _is_number,
        "a number from 0 to 2",
        lambda v: 0 <= v <= 2,
        setting="temp",
    ),
    Field(
        "top_p",
        _is_number,
        "a number > 0 and <= 1",
        lambda v: 0 < v <= 1,
        setting="top_p",
    ),
    # mlx-lm's make_sampler (and mlx_lm.server's names); 0: off.
    Field(
        "top_k", _is_int, "an integer >= 0 (0: off)", lambda v: v >= 0, setting="top_k"
    ),
    Field(
        "min_p",
        _is_number,
        "a number from 0 to 1 (0: off)",
        lambda v: 0 <= v <= 1,
        setting="min_p",
    ),
    Field(
        "min_tokens_to_keep",
        _is_int,
        "an integer >= 1",
        lambda v: v >= 1,
        setting="min_tokens_to_keep",
    ),
    # mlx-lm's make_logits_processors (and mlx_lm.server's names and defaults).
    Field("logit_bias", _is_dict, "an object of token ids to numbers"),
    Field(
        "repetition_penalty",
        _is_number,
        "a number >= 0 (0 or 1: off)",
        lambda v: v >= 0,
    ),
    Field("presence_penalty", _is_number, "a number from -2 to 2", _penalty_ok),
    Field("frequency_penalty", _is_number, "a number from -2 to 2", _penalty_ok),
    *(
        Field(f"{p}_context_size", _is_int, "an integer >= 1", lambda v: v >= 1)
        for p in ("repetition", "presence", "frequency")
    ),
    Field("seed", _is_int, "an integer from 0 to 2**64-1", lambda v: 0 <= v < 2**64),
    Field("n", _is_int, "1 (one choice per request)", lambda v: v == 1, default=1),
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
        _is_int,
        f"an integer from 0 to {MAX_TOP_LOGPROBS['chat']}",
        lambda v: 0 <= v <= MAX_TOP_LOGPROBS["chat"],
        kinds=("chat",),
    ),
    # Completions: logprobs 0-5 (how many top tokens; null: none), echo.
    Field(
        "logprobs",
        _is_int,
        f"an integer from 0 to {MAX_TOP_LOGPROBS['text']} or null",
        lambda v: 0 <= v <= MAX_TOP_LOGPROBS["text"],
        kinds=("text",),
    ),
    Field("echo", _is_bool, "true or false", default=False, kinds=("text",)),
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
    "response_format": (
        ("chat", "text"),
        ({"type": "text"},),
        "output is not constrained to JSON or a schema",
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
        return "bool" if _is_bool(x) else "number" if _is_number(x) else type(x)

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
class Options:
    """A checked request body, before its prompt is tokenized."""

    kind: str  # "chat" or "text"
    max_tokens: Optional[int]  # None: the server's default
    temp: float
    top_p: float
    seed: Optional[int]
    stop: List[str]
    stream: bool
    include_usage: bool
    top_logprobs: Optional[int]  # None: no logprobs; else how many alternatives
    echo: bool
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    processors: Optional[dict] = None  # make_logits_processors' arguments


def read_options(kind: str, body: dict, settings: Settings) -> Options:
    """The FIELDS of a /v1/chat/completions ("chat") or /v1/completions
    ("text") body, checked; a RequestError names the first bad one."""
    _refuse_unsupported(kind, body)
    got: Dict[str, Any] = {}
    for f in FIELDS:
        if kind in f.kinds:
            value = _read(body, f, settings)
            if value is not None or (f.key or f.name) not in got:
                got[f.key or f.name] = value
    include_usage = _read(
        got["stream_options"],
        Field("include_usage", _is_bool, "true or false", default=False),
        settings,
    )
    stop = got["stop"]
    if kind == "chat":
        top = got["top_logprobs"]
        if top is not None and not got["logprobs"]:
            raise RequestError(
                "'top_logprobs' needs 'logprobs': true",
                param="top_logprobs",
                code="invalid_value",
            )
        top = (top or 0) if got["logprobs"] else None
    else:
        top = got["logprobs"]
    if got["max_tokens"] == 0 and not got.get("echo"):
        raise RequestError(
            "'max_tokens' must be an integer >= 1 (0 only with 'echo': true)",
            param="max_tokens",
            code="invalid_value",
        )
    return Options(
        kind=kind,
        max_tokens=got["max_tokens"],
        temp=float(got["temperature"]),
        top_p=float(got["top_p"]),
        seed=got["seed"],
        stop=[stop] if isinstance(stop, str) else list(stop),
        stream=got["stream"],
        include_usage=include_usage,
        top_logprobs=top,
        echo=bool(got.get("echo")),
        top_k=got["top_k"],
        min_p=float(got["min_p"]),
        min_tokens_to_keep=got["min_tokens_to_keep"],
        processors=_processors(got),
    )


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
            if not _is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
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


# --- prompts ---------------------------------------------------------------------


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


def read_messages(body: dict) -> List[dict]:
    """Chat messages as the chat template wants them ({role, content} strings)."""
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


MAX_PROMPTS = 64  # prompts in one completions request (one choice each)


def read_prompts(body: dict, encode: Callable, vocab_size: int) -> List[List[int]]:
    """A completions request's prompts as token ids: a string or a list of
    token ids, or a list of those (one choice each, as lm-evaluation-harness
    sends a batch)."""
    prompt = body.get("prompt")
    one = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)
    )
    many = prompt if isinstance(prompt, list) and not one else [prompt]
    if not many or len(many) > MAX_PROMPTS:
        raise RequestError(
            f"'prompt' must be one prompt or a list of 1 to {MAX_PROMPTS}",
            param="prompt",
            code="invalid_value" if many else "invalid_type",
        )
    return [_prompt_ids(p, encode, vocab_size) for p in many]


def _prompt_ids(prompt, encode: Callable, vocab_size: int) -> List[int]:
    if isinstance(prompt, str):
        return list(encode(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise RequestError(
                f"'prompt' token ids must be in [0, {vocab_size})",
                param="prompt",
                code="invalid_value",
            )
        return list(prompt)
    raise RequestError(
        "'prompt' must be a string or a list of token ids, or a list of those",
        param="prompt",
        code="invalid_type" if prompt is not None else "missing_required",
    )


# --- logprobs in OpenAI's shapes -------------------------------------------------


@dataclass
class TokenLogprob:
    """One token as text, its logprob (None: an echoed prompt's first token,
    which nothing predicts), its top alternatives, best first, and where its
    text starts in the answer's (characters)."""

    token: str
    logprob: Optional[float]
    top: List[Tuple[str, float]]
    offset: int = 0


def chat_logprobs(entries: List[TokenLogprob]) -> dict:
    """choices[i].logprobs of a chat completion (or of one chunk of a stream)."""

    def one(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def text_logprobs(entries: List[TokenLogprob]) -> dict:
    """choices[i].logprobs of a text completion: parallel lists, one item per
    token. The top dict holds the chosen token too, as OpenAI's (up to
    logprobs + 1 keys); text_offset indexes the choice's whole text (a
    stream's chunks joined)."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.logprob is None else _top_dict(e.top + [(e.token, e.logprob)])
            for e in entries
        ],
        "text_offset": [e.offset for e in entries],
    }


def _top_dict(pairs: List[Tuple[str, float]]) -> Dict[str, float]:
    """{text: logprob}; tokens that decode to the same text keep the best."""
    out: Dict[str, float] = {}
    for text, lp in pairs:
        out[text] = max(lp, out.get(text, lp))
    return out
