"""An OpenAI-compatible HTTP server for one model (`flashnorm-mlx serve`).

Routes: POST /v1/chat/completions and /v1/completions (one JSON body, or
server-sent events ending `data: [DONE]` with "stream": true), Anthropic's
POST /v1/messages and /v1/messages/count_tokens, OpenAI's POST /v1/responses,
GET /v1/models, GET /health; vLLM's GET /tokenizer_info, POST /tokenize and
/detokenize; the chat page at GET / and what its header shows at GET /props.
Every error is a 4xx/5xx with OpenAI's body {"error": {"message", "type",
"param", "code"}}, or Anthropic's under /v1/messages.
With an API key, every route but /health and the page's files needs
`Authorization: Bearer KEY`.

Modules: `http`, the HTTP layer (the standard library's
ThreadingHTTPServer reads, checks and tokenizes each request on its own
thread), sending `completions`' OpenAI objects; `auth`, the API key; `routes`, vLLM's tokenizer endpoints and the
browser chat page (GET /, files in `web/`); `tools`, tool calls with
mlx-lm's parsers; `structured`, response_format and strict tools as grammar
processors; `anthropic` and `responses`, the two agent APIs, through
`replies`, a chat reply as events; `split`, a request's reply cut into thought,
content and tool calls (the package's `thinking`, as mlx_lm.server cuts them); `service`, what those
threads share; `prompts`, messages
and prompts as token ids; `schema`, what a request may hold and the one
`Request` record each prompt becomes; `scheduler`, the generation thread,
which decodes every request in flight together with mlx-lm's
BatchGenerator; `text`, a reply's text token by token; `logprobs`, scored
and shaped as OpenAI's; `log`, the server's log line; `guard`, the Host,
Origin and Content-Type checks; `connections`, the connection cap and the
server's run; `bounds`, prompts refused from their size before tokenizing;
`pacing`, prefill chunks sized by time; `sequential`, requests one at a
time with a draft model or KV cache options; `compare`, the page's Compare;
`reply`, what a route answers through (never the handler itself).

Why not mlx_lm.server itself: it loads models with `mlx_lm.load` (not our
FlashNorm builder), answers errors as {"error": "text"}, and has no API key.
"""

# What the CLI (cli/serve.py) uses: this face alone, never a module below it.
from .auth import API_KEY_ENV, bind_warning, key_matches
from .compare import Comparer
from .connections import run_until_signal
from .http import ApiServer
from .log import set_level
from .scheduler import Worker
from .schema import Settings
from .sequential import Decoding, SequentialWorker
from .service import Service

__all__ = [
    "API_KEY_ENV",
    "ApiServer",
    "Comparer",
    "Decoding",
    "SequentialWorker",
    "Service",
    "Settings",
    "Worker",
    "bind_warning",
    "key_matches",
    "run_until_signal",
    "set_level",
]
