"""An OpenAI-compatible HTTP server for one model (`flashnorm-mlx serve`).

Routes: POST /v1/chat/completions and /v1/completions (one JSON body, or
server-sent events ending `data: [DONE]` with "stream": true), GET /v1/models,
GET /health. Every error is a 4xx/5xx with OpenAI's body
{"error": {"message", "type", "param", "code"}}. With an API key, every route
but /health needs `Authorization: Bearer KEY`.

Four modules: `http`, the HTTP layer (the standard library's
ThreadingHTTPServer reads, checks and tokenizes each request on its own
thread); `service`, what those threads share and how a body becomes Jobs;
`schema`, what a request may hold and what logprobs look like; `scheduler`,
the generation thread, which decodes every request in flight together with
mlx-lm's BatchGenerator.

Why not mlx_lm.server itself: it loads models with `mlx_lm.load` (not our
FlashNorm builder), answers errors as {"error": "text"}, and has no API key.
"""

from .http import (
    API_KEY_ENV,
    ApiServer,
    bind_warning,
    key_matches,
    run_until_signal,
)
from .schema import Settings
from .service import Service

__all__ = [
    "API_KEY_ENV",
    "ApiServer",
    "Service",
    "Settings",
    "bind_warning",
    "key_matches",
    "run_until_signal",
]
