"""`flashnorm-mlx chat [MODEL]`: chat in the terminal, one stats line per reply.

With a terminal on stdin it draws a rich header and prompts; with piped stdin
it reads one message per line and prints only replies, stats lines and notices.
"""

import argparse
import sys
import time

from ..errors import ChatError, ContextOverflow
from .flags import VARIANT_NAMES, Parser, UserError, add_model_args, run_main
from .mlx_lm_flags import add_generation_args, add_sampling_args

HELP = """\
/help   show this help
/reset  forget the conversation (the system prompt stays) and clear the KV cache
/compare  regenerate the last reply on the same weights and prompt with
        {variants}: decode tok/s side by side
/quit   leave (also /exit, or Ctrl-D)
Ctrl-C drops a message still being read, or stops a reply; the partial reply
        stays in the conversation.""".format(variants=", ".join(VARIANT_NAMES))


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx chat",
        description="Chat with a model; the KV cache is kept across turns. "
        "Reads one message per line from stdin when it is not a terminal.",
    )
    add_model_args(p)
    p.add_argument(
        "--system-prompt",
        default=None,
        help="System prompt to be used for the chat template",
    )
    add_sampling_args(p, max_tokens=256)
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="context length in tokens (default: the model's, from its config); "
        "the oldest turns are dropped to fit a reply of --max-tokens",
    )
    add_generation_args(p)
    return p


# A prefill still running after this long says so, once (and that Ctrl-C stops it).
PREFILL_NOTICE_S = 2.0


class PlainUI:
    """Piped stdin: no prompts, no styling; replies, stats lines and notices."""

    def __init__(self):
        self.prefill_start, self.prefill_told = 0.0, False

    def header(self, rows):
        pass

    def prefilling(self, done: int, total: int):
        """Before each prefill chunk: a long prefill gets one line."""
        now = time.perf_counter()
        if done == 0:
            self.prefill_start, self.prefill_told = now, False
        elif not self.prefill_told and now - self.prefill_start >= PREFILL_NOTICE_S:
            self.prefill_told = True
            self.prefill_notice(
                f"reading the message ({done}/{total} prompt tokens; Ctrl-C drops it)"
            )

    def prefill_notice(self, message: str):
        # On stderr, like the other commands' stage lines: stdout is the chat.
        print(f"flashnorm-mlx chat: {message}", file=sys.stderr, flush=True)

    def read(self):
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\n")

    def text(self, segment: str):
        sys.stdout.write(segment)
        sys.stdout.flush()

    def end_reply(self, stats):
        print()
        if stats is not None:
            print(stats.line(), flush=True)

    def notice(self, message: str):
        print(message, flush=True)

    def help(self):
        print(HELP, flush=True)

    def bye(self):
        pass


class RichUI(PlainUI):
    """A terminal on stdin: header panel, styled prompt, dim stats lines."""

    def __init__(self):
        from rich.console import Console

        super().__init__()
        self.console = Console(highlight=False)

    def header(self, rows):
        from rich.markup import escape
        from rich.panel import Panel
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        for key, value in rows:
            table.add_row(f"[dim]{key}[/dim]", escape(str(value)))
        self.console.print(Panel(table, title="flashnorm-mlx chat", expand=False))
        self.help()

    def read(self):
        try:
            return self.console.input("[bold green]>> [/bold green]")
        except EOFError:
            self.console.print()
            return None

    def text(self, segment: str):
        # Raw writes: reply text is neither markup nor to be re-wrapped.
        self.console.file.write(segment)
        self.console.file.flush()

    def end_reply(self, stats):
        self.console.print()
        if stats is not None:
            self.console.print(stats.line(), style="dim", markup=False, soft_wrap=True)

    def notice(self, message: str):
        self.console.print(message, style="yellow", markup=False)

    def prefill_notice(self, message: str):
        self.console.print(f"({message})", style="dim", markup=False)

    def help(self):
        self.console.print(HELP, style="dim", markup=False)

    def bye(self):
        self.console.print("bye", style="dim")


def turn_notices(stats, requested_max_tokens: int, limit) -> list:
    notes = []
    if stats.dropped_messages:
        notes.append(
            f"(context: dropped the {stats.dropped_messages} oldest messages "
            f"to fit {limit} tokens)"
        )
    if stats.max_tokens < requested_max_tokens:
        notes.append(f"(context: reply limited to {stats.max_tokens} tokens)")
    return notes


class Comparer:
    """/compare: bench's rows (loading/variants.py), mlx-lm then the four norm
    handlings on the chat's engine, built on the same source and settings (once,
    on first use; the chat's own model is its row), timed on the last reply's
    prompt. say(line): where the variants left would take over a minute, once
    per /compare, after the first one (estimate.py)."""

    def __init__(self, source, mode: str, model, kwargs: dict, sampler=None, say=None):
        from .. import engine as engines

        self.source, self.sampler, self.say = source, sampler, say
        self.engine = engines.resolve(kwargs.get("engine"))
        self.kwargs = {k: v for k, v in kwargs.items() if k != "engine"}
        self.models = {mode: model}

    def __call__(self, session) -> str:
        from .. import estimate
        from ..loading import build_model
        from ..loading.variants import BY_NAME, NAMES
        from ..timing import compare_decode_speed

        n = len(session.last_reply_ids)
        if n < 2:
            return "(/compare needs a reply of 2 or more tokens first)"
        r = {}
        for i, v in enumerate(NAMES):  # each built (once) and timed in turn
            start = time.perf_counter()
            if v not in self.models:
                row = BY_NAME[v]
                engine = row.engine or self.engine
                self.models[v], _ = build_model(
                    self.source, row.norms, engine=engine, **self.kwargs
                )
            prompt = session.last_prompt_ids
            r.update(compare_decode_speed({v: self.models[v]}, prompt, n, self.sampler))
            if i == 0:
                piece, seconds = f"{v}'s turn", time.perf_counter() - start
                line = estimate.projection(piece, seconds, len(NAMES) - 1, "/compare")
                estimate.tell(self.say, line)
        stock = r["stock"]["decode_tps"]
        cells = [
            f"{v} {r[v]['decode_tps']:.1f}"
            + (f" ({r[v]['decode_tps'] / stock:.2f}x)" if v != "stock" else "")
            for v in NAMES
        ]
        return (
            f"decode tok/s, last reply regenerated ({n} tokens, end-of-sequence "
            f"ignored, same {len(session.last_prompt_ids)}-token prompt and "
            f"weights; mlx-lm eager, the rest on the {self.engine} engine, x stock "
            f"on it): " + " | ".join(cells)
        )


def run_chat(session, ui, max_tokens: int, compare=None) -> int:
    """The read-reply loop over a ChatSession; returns the exit status.
    compare(session) -> the line /compare prints (None: /compare is not offered)."""
    from ..parallel import distributed

    prefilling = ui.prefilling  # its notice on stderr: rank 0's alone
    if not distributed.is_main_rank():
        prefilling = lambda done, total: None  # noqa: E731
    while True:
        try:
            line = ui.read()
        except KeyboardInterrupt:
            ui.notice("\n(type /quit or press Ctrl-D to leave)")
            continue
        if line is None:  # end of input
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command = line.split()[0].lower()
            if command in ("/quit", "/exit"):
                break
            if command == "/reset":
                session.reset()
                ui.notice("(conversation reset)")
            elif command == "/help":
                ui.help()
            elif command == "/compare" and compare is not None:
                ui.notice("(regenerating the last reply with each variant ...)")
                try:
                    ui.notice(compare(session))
                except KeyboardInterrupt:
                    ui.notice("(comparison interrupted)")
            else:
                ui.notice(f"unknown command {command}; /help lists the commands")
            continue
        try:
            with distributed.watch("generating a reply"):  # no-op in one process
                stats = session.send(
                    line,
                    on_text=distributed.kicking(ui.text),
                    on_prefill=distributed.kicking(prefilling),
                )
        except ContextOverflow as e:
            ui.notice(str(e))
            continue
        except KeyboardInterrupt:  # before the reply started
            ui.end_reply(None)
            ui.notice("(interrupted)")
            continue
        ui.end_reply(stats)
        for note in turn_notices(stats, max_tokens, session.max_context):
            ui.notice(note)
    ui.bye()
    return 0


@run_main
def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.prompt_cache_file is not None and args.draft_model:
        # The file holds the model's layers only; the draft would start empty.
        parser.error("--prompt-cache-file and --draft-model cannot be used together")
    # MLX and mlx-lm (seconds) once the flags are good.
    from .. import engine as engines
    from .. import prompt_cache
    from ..chat import ChatSession
    from ..decoding import KVOptions, check_kv_options
    from ..models import context_length
    from .common import load_for_sampling, make_sampler, model_kwargs, seed_sampling
    from .decoding import draft_model

    saved = None
    if args.prompt_cache_file is not None:  # a bad file: one line before the build
        saved = prompt_cache.read(
            args.prompt_cache_file, args.model, args.mode, args.adapter_path
        )
    source, tokenizer, model, config = load_for_sampling(args)
    kv = KVOptions.from_args(args)
    check_kv_options(kv, model, config, source.name)
    draft = draft_model(args, tokenizer, source.name)
    seed_sampling(args, source)  # after every build, as mlx-lm draws
    limit = args.max_context or context_length(config)
    try:
        session = ChatSession(
            model,
            tokenizer,
            system_prompt=args.system_prompt,
            max_tokens=args.max_tokens,
            sampler=make_sampler(args, tokenizer),
            max_context=limit,
            draft_model=draft,
            num_draft_tokens=args.num_draft_tokens,
            kv=kv,
            prefill_step_size=args.prefill_step_size,
        )
    except ChatError as e:
        raise UserError(f"{source.name}: {e}") from None
    if saved is not None:
        ids = prompt_cache.fit(args.prompt_cache_file, *saved, model)
        if ids is None:
            raise UserError(
                f"{args.prompt_cache_file} has no token ids (mlx-lm's cache_prompt "
                "made it): chat needs one from `flashnorm-mlx cache-prompt`"
            )
        session.seed_cache(saved[0], ids)
    ui = RichUI() if sys.stdin.isatty() else PlainUI()
    ui.header(
        [
            ("model", source.name),
            ("mode", args.mode),
            ("engine", engines.engine_of(model)),
            ("context", f"{limit} tokens" if limit else "unlimited"),
            ("max tokens", args.max_tokens),
            ("system", args.system_prompt or "(template default)"),
            *(
                [("draft", f"{args.draft_model} ({args.num_draft_tokens} tokens)")]
                if draft
                else []
            ),
        ]
    )
    sampler = session.sampler
    compare = Comparer(source, args.mode, model, model_kwargs(args), sampler, ui.notice)
    return run_chat(session, ui, args.max_tokens, compare)
