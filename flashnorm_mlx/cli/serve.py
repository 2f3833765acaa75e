"""`flashnorm-mlx serve [MODEL]`: an OpenAI-compatible HTTP server (serve/)."""

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from .. import interrupt
from ..limits import LOG_LEVELS, byte_size
from .flags import API_KEY_ENV, Parser, UserError, add_model_args, run_main
from .mlx_lm_flags import (
    add_adapter_args,
    add_draft_args,
    add_kv_cache_args,
    add_sampling_args,
    add_serve_template_args,
    add_trust_remote_code_arg,
)

# mlx-lm's sampler flags (mlx_lm_flags.SAMPLER_FLAGS) that serve's Settings holds a
# default for, as request defaults (tests/test_cli.py checks it against Settings).
SETTINGS_SAMPLER = ("top_p", "top_k", "min_p", "min_tokens_to_keep")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx serve",
        description="Serve a model over an OpenAI-compatible HTTP API: "
        "/v1/chat/completions, /v1/completions, /v1/models, /health, vLLM's "
        "/tokenize and /detokenize; and a chat page in the browser at /.",
    )
    add_model_args(p)
    add_adapter_args(p)
    add_serve_template_args(p)
    _add_listen_args(p)
    # Request defaults, for requests that do not set them.
    # The sampler defaults a request may override: those Settings holds.
    add_sampling_args(p, max_tokens=512, sampler=_sampler_defaults())
    _add_generation_args(p)
    _add_guard_args(p)
    add_trust_remote_code_arg(p)
    add_draft_args(p)
    add_kv_cache_args(p)
    return p


def _add_listen_args(p) -> None:
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (0.0.0.0: every interface, with a warning)",
    )
    p.add_argument(
        "--port", type=int, default=8080, help="port to listen on (0: any free one)"
    )


def _add_generation_args(p) -> None:
    """The generation thread's: context, prefill, prompt cache, batch, log."""
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="longest prompt + reply in tokens (default: the model's, from its "
        "config); longer requests get a 400",
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=512,
        help="most prompt tokens per step; while streams decode, steps are "
        "shorter (--prefill-chunk-seconds)",
    )
    p.add_argument(
        "--prefill-chunk-seconds",
        type=float,
        default=0.5,
        help="seconds a prompt's prefill chunk aims at: running streams wait "
        "about this long between tokens while a new prompt is read",
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="conversations whose KV caches are kept for their next turn",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=_size,
        default=None,
        help="most bytes of KV caches kept, e.g. 4GB or 500M (default: no limit "
        "but --prompt-cache-size)",
    )
    p.add_argument(
        "--decode-concurrency",
        type=int,
        default=32,
        help="requests decoded together in one batch; more wait in a queue",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        default="INFO",
        choices=LOG_LEVELS,
        help="least important log lines printed: DEBUG adds a line as each request "
        "starts, WARNING and up keep only errors",
    )


def _add_guard_args(p) -> None:
    """Who may call, from where, and how many connections they may hold."""
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health; "
        "several keys comma-separated, each with a prompt cache of its own "
        f"(default: ${API_KEY_ENV} if set, else no key; the variable keeps the "
        "key out of ps)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_names,
        default=None,
        help="web page origins allowed to call the API from a browser (CORS), "
        "comma-separated, e.g. https://app.example (default: loopback origins "
        "only, such as http://localhost:3000; '*': any, as mlx_lm.server's default)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=_names,
        default=None,
        help="Host names served besides localhost, 127.0.0.1 and [::1], "
        "comma-separated ('*': any); others get a 403 (DNS rebinding)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=128,
        help="connections open at once; more get a 503",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=32,
        help="connections open at once from one address, so that one client "
        "cannot take every slot; more get a 503",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=10.0,
        help="seconds a request's headers and body may take to arrive, in all "
        "(a client sending a byte at a time is closed)",
    )


def _names(text: str) -> list:
    return [o.strip() for o in text.split(",") if o.strip()]


def _sampler_defaults() -> tuple:
    """mlx-lm's sampler flags that the server's Settings has a default for."""
    return SETTINGS_SAMPLER


def _size(text: str) -> int:
    try:
        return byte_size(text)
    except ValueError as e:  # argparse's one line, naming the flag
        raise argparse.ArgumentTypeError(str(e)) from None


@run_main
def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)  # the flag rules (flags.VALUE_RULES) checked
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        parser.error(f"the API key (--api-key or ${API_KEY_ENV}) must not be empty")
    # MLX and mlx-lm (seconds) once the flags are good.
    from ..serve import ApiServer, bind_warning, run_until_signal, set_level

    set_level(args.log_level)
    # Bind first: a port in use is one line before a long model load.
    try:
        server = ApiServer(
            args.host,
            args.port,
            args.allowed_origins or (),
            args.allowed_hosts or (),
            args.max_connections,
            args.max_connections_per_client,
            args.request_timeout,
        )
    except (OSError, OverflowError) as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    warning = bind_warning(args.host, api_key)
    if warning:
        print(f"flashnorm-mlx serve: {warning}", file=sys.stderr, flush=True)
    try:
        _attach(server, args, api_key)
    except KeyboardInterrupt:
        # The generation thread may still be building on MLX: a normal exit
        # under it aborts ("terminate called without an active exception").
        server.server_close()
        interrupt.exit_now("flashnorm-mlx serve")
    except BaseException:
        server.server_close()
        raise
    run_until_signal(server)
    return 0


def _attach(server, args, api_key) -> None:
    """The model built on the generation thread and served by `server`."""
    from ..chat_template import set_template
    from ..decode_options import KVOptions
    from ..loading.source import default_model_path
    from ..serve import Comparer, Decoding, Service, Settings
    from .common import build, read_model

    decoding = Decoding(
        KVOptions.from_args(args), args.draft_model, args.num_draft_tokens
    )
    if decoding.sequential:
        print(f"flashnorm-mlx serve: {decoding.why()}", file=sys.stderr, flush=True)

    def load():  # the Mode read_model settles travels with the model
        source, tokenizer, mode = read_model(args)
        set_template(  # mlx-lm's template flags, for every chat request
            tokenizer,
            chat_template=args.chat_template,
            use_default=args.use_default_chat_template,
            template_args=args.chat_template_args,
        )
        model, config = build(source, mode, args)
        serve_with_draft(decoding, args, model, tokenizer, config, source.name, mode)
        return model, tokenizer, config, mode

    def load_other(mode):  # the page's Compare: the other mode, on its first use
        source, _, _ = read_model(args)
        return build(source, mode, args)[0]

    # Every Settings field is a flag of the same name (the key: flag or env).
    held = (f.name for f in dataclasses.fields(Settings) if f.name != "api_key")
    settings = Settings(**{name: getattr(args, name) for name in held}, api_key=api_key)
    # A local folder by its name: answers never show where it sits on disk.
    model_id = args.model or default_model_path().stem
    if args.model and Path(args.model).exists():
        model_id = Path(args.model).resolve().name
    comparer = Comparer(load_other)
    service = Service(load, model_id, settings, decoding.worker(), comparer)
    server.attach(service)  # builds: load() settles --mode for the model
    print(
        f"flashnorm-mlx serve: {model_id} ({service.mode}) on "
        f"{server.url}/v1{' (API key required)' if api_key else ''}, chat page "
        f"{server.url}/ (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )


def serve_with_draft(decoding, args, model, tokenizer, config, name: str, mode) -> None:
    """serve, on the generation thread after the model's build: check the KV
    options against it and build the draft like it."""
    from ..decode_options import check_kv_options
    from .decoding import draft_model

    check_kv_options(decoding.kv, model, config, name)
    decoding.draft_model = draft_model(args, tokenizer, name, mode)
