"""serve's routes beside the OpenAI ones: vLLM's tokenizer endpoints, which
lm-evaluation-harness's RemoteTokenizer reads (so it needs no tokenizer of
its own), and the browser chat page with the small JSON it shows in its
header (docs/design.md section 5e).

Each route is a function of the request's Reply (reply.py); the Handler
(http.py) checks the API key and sends OpenAI's error body for a RequestError.
"""

import json
from importlib import resources
from typing import Callable, Dict, Tuple

from ..mlx_lm_compat import inner_tokenizer
from . import anthropic, responses
from .chat_body import chat_messages
from .compare import compare
from .schema import RequestError

# The page's files (package data, flashnorm_mlx/serve/web): name -> MIME type.
PAGE_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "chats.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}


def extra_routes(reply) -> Dict[str, Tuple[str, Callable[[], None]]]:
    """path -> (method, route) answering through `reply`."""
    routes = {
        "/tokenizer_info": ("GET", lambda: tokenizer_info(reply)),
        "/tokenize": ("POST", lambda: tokenize(reply)),
        "/detokenize": ("POST", lambda: detokenize(reply)),
        "/props": ("GET", lambda: props(reply)),
        "/compare": ("POST", lambda: compare(reply)),  # the page's Compare (compare.py)
        "/favicon.ico": ("GET", lambda: page_file(reply, "favicon.svg")),
        # Anthropic's and OpenAI's agent APIs.
        "/v1/messages": ("POST", lambda: anthropic.messages(reply)),
        "/v1/messages/count_tokens": ("POST", lambda: anthropic.count_tokens(reply)),
        "/v1/responses": ("POST", lambda: responses.responses(reply)),
        "": ("GET", lambda: page_file(reply, "index.html")),  # "/", its "/" stripped
    }
    for name in PAGE_FILES:
        routes[f"/{name}"] = ("GET", lambda name=name: page_file(reply, name))
    return routes


def public_paths() -> Tuple[str, ...]:
    """Paths that need no API key: /health and the page's static files (the
    page asks for the key, then sends it on every API call)."""
    return ("/health", "", "/favicon.ico", *(f"/{n}" for n in PAGE_FILES))


# --- vLLM's tokenizer endpoints ---------------------------------------------------


def tokenizer_info(reply) -> None:
    """GET /tokenizer_info: vLLM's fields that RemoteTokenizer reads (eos_token
    must be there, even null, or lm-eval falls back to the hub)."""
    s = reply.service
    tok = s.tokenizer
    reply.send_json(
        200,
        {
            "tokenizer_class": type(inner_tokenizer(tok)).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
            "model_max_length": s.settings.max_context,
        },
    )


def tokenize(reply) -> None:
    """POST /tokenize {"prompt", "add_special_tokens" (default true, as vLLM)}
    or {"messages", "add_generation_prompt"} -> {"count", "max_model_len",
    "tokens", "token_strs"}."""
    body = reply.read_json()
    s = reply.service
    add_special = _flag(body, "add_special_tokens", True)
    if "messages" in body:  # bounded as the chat route bounds them (bounds.py)
        s.fits_messages(body)
        messages = chat_messages(body)
        s.fits([m["content"] for m in messages], "messages", items=len(messages))
    elif isinstance(body.get("prompt"), str):
        s.fits([body["prompt"]], "prompt")
    with s.tokenizer_lock:
        if "messages" in body:
            # As the chat route renders them: earlier tool calls kept.
            gen = _flag(body, "add_generation_prompt", True)
            try:
                ids = s.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=gen
                )
            except Exception as e:  # no template, or the template's refusal
                raise RequestError(
                    f"the chat template refused the messages: {e}", param="messages"
                ) from None
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError(
                    "'prompt' must be a string (or send 'messages')",
                    param="prompt",
                    code="invalid_type",
                )
            ids = s.tokenizer.encode(prompt, add_special_tokens=add_special)
    ids = [int(i) for i in ids]
    reply.send_json(
        200,
        {
            "count": len(ids),
            "max_model_len": s.settings.max_context,
            "tokens": ids,
            "token_strs": None,
        },
    )


def detokenize(reply) -> None:
    """POST /detokenize {"tokens": [ids]} -> {"prompt": text}."""
    body = reply.read_json()
    s = reply.service
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise RequestError(
            "'tokens' must be a list of token ids", param="tokens", code="invalid_type"
        )
    if not all(0 <= t < s.vocab_size for t in ids):
        raise RequestError(
            f"'tokens' must be in [0, {s.vocab_size})",
            param="tokens",
            code="invalid_value",
        )
    with s.tokenizer_lock:
        text = s.tokenizer.decode(ids)
    reply.send_json(200, {"prompt": text})


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(
            f"'{name}' must be true or false, not {json.dumps(value)[:40]}",
            param=name,
            code="invalid_type",
        )
    return value


# --- the chat page ----------------------------------------------------------------


def props(reply) -> None:
    """GET /props: what the page's header names (llama-server has a /props too)."""
    s = reply.service
    reply.send_json(
        200,
        {
            "model": s.model_id,
            "mode": s.mode,
            "engine": s.engine,
            "device": s.device,
            "api_key_required": bool(s.settings.api_key),
            "max_tokens": s.settings.max_tokens,
            "temperature": s.settings.temp,
            "top_p": s.settings.top_p,
            "max_context": s.settings.max_context,
            "tool_calling": bool(getattr(s.tokenizer, "has_tool_calling", False)),
            # What the page's Compare runs against (None: no Compare).
            "compare_with": s.comparer.other if s.comparer else None,
        },
    )


def page_file(reply, name: str) -> None:
    """One of the page's static files, from the package (nothing from any
    other host: the page works offline)."""
    data = resources.files(__package__).joinpath("web", name).read_bytes()
    reply.send_bytes(200, PAGE_FILES[name], data)
