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


# A prefill still running after this long says so (and that Ctrl-C stops it),
# then says where it is before each chunk: every chunk on a terminal's one
# line, at most every PREFILL_EVERY_S in a pipe's lines.
PREFILL_NOTICE_S = 2.0
PREFILL_EVERY_S = 10.0


def prefill_words(done: int, total: int) -> str:
    return f"reading the message: {done}/{total} prompt tokens, Ctrl-C drops it"


class PlainUI:
    """Piped stdin: no prompts, no styling; replies, stats lines and notices."""

    EVERY_S = PREFILL_EVERY_S  # between a pipe's progress lines

    def __init__(self):
        self.prefill_start, self.prefill_told = 0.0, None

    def header(self, rows):
        pass

    def prefilling(self, done: int, total: int):
        """Before each prefill chunk: a long prefill says where it is."""
        now = time.perf_counter()
        if done == 0:
            self.prefill_start, self.prefill_told = now, None
        elif now - self.prefill_start >= PREFILL_NOTICE_S and (
            self.prefill_told is None or now - self.prefill_told >= self.EVERY_S
        ):
            self.prefill_told = now
            self.prefill_notice(prefill_words(done, total))

    def prefill_notice(self, message: str):
        # On stderr, like the other commands' stage lines: stdout is the chat.
        print(f"flashnorm-mlx chat: {message}", file=sys.stderr, flush=True)

    def read(self):
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\n")

    def text(self, segment: str):
        sys.stdout.write(segment)
        sys.stdout.flush()

    def thought(self, segment: str):
        # Not the reply: on stderr, so piped stdout holds the answers alone.
        sys.stderr.write(segment)
        sys.stderr.flush()

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

    EVERY_S = 0.0  # one line, rewritten before each chunk

    def __init__(self):
        from rich.console import Console

        super().__init__()
        self.console = Console(highlight=False)
        self.transient = False  # a prefill line on screen, to clear
        self.thinking = False  # a thought is on screen, its answer not yet

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
        self.clear_transient()
        if self.thinking:  # the answer starts on a line of its own
            self.console.file.write("\n")
            self.thinking = False
        self.console.file.write(segment)
        self.console.file.flush()

    def thought(self, segment: str):
        """A thinking model's thought: dim and italic, apart from the answer."""
        self.clear_transient()
        self.thinking = True
        self.console.print(
            segment, style="dim italic", markup=False, end="", soft_wrap=True
        )

    def end_reply(self, stats):
        self.clear_transient()
        self.thinking = False
        self.console.print()
        if stats is not None:
            self.console.print(stats.line(), style="dim", markup=False, soft_wrap=True)

    def notice(self, message: str):
        self.clear_transient()
        self.console.print(message, style="yellow", markup=False)

    def prefill_notice(self, message: str):
        """One line, without a newline and within the width (so that one
        carriage return reaches its start): gone once the reply starts."""
        self.clear_transient()  # the last one: this one replaces it
        line = message[: max(self.console.width - 1, 1)]
        self.console.print(line, style="dim", markup=False, end="", soft_wrap=True)
        self.transient = True

    def clear_transient(self):
        if self.transient:  # back to the line's start, erase it
            self.console.file.write("\r\x1b[2K")
            self.console.file.flush()
            self.transient = False

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


# One run each has no spread: its ratios would be noise shown as results
# (bench's rule, timing.round_ratios: under 3 rounds, within noise).
NOISE = (
    "ratios between these: within noise (one run each); flashnorm-mlx bench times "
    "interleaved rounds and gives them with their spread"
)
NONORM_NAME = "nonorm"
NONORM = (
    "  (nonorm removes the norms altogether: the speed bound, not a working "
    "model, so its text is not meant to read)"
)


class CompareRows:
    """/compare: bench's rows (loading/rows.py), mlx-lm then the four
    modes on the chat's engine, built on the same source and settings (once,
    on first use; the chat's own model, of Mode `mode`, is its row), each
    regenerating the last reply: its decode speed and its text. The prompt is
    prefilled once, by the chat's model, and each row decodes from a copy of
    that cache (a decode step's cost is the cache's length, not its values;
    where a row's cache kinds differ it prefills its own). say(line): where the
    rows left would take over a minute, once per /compare, after the first one
    (estimate.py)."""

    def __init__(self, source, mode, model, kwargs: dict, sampler=None, say=None):
        from .. import engine as engines

        self.source, self.sampler, self.say = source, sampler, say
        self.engine = engines.resolve(kwargs.get("engine"))
        self.kwargs = {k: v for k, v in kwargs.items() if k != "engine"}
        self.mode, self.models = mode.name, {mode.name: model}  # by row

    def __call__(self, session) -> str:
        from .. import estimate
        from ..loading import build_model
        from ..loading.rows import BY_NAME, NAMES, absent

        n = len(session.last_reply_ids)
        if n < 2:
            return "(/compare needs a reply of 2 or more tokens first)"
        missing = absent(self.source.config)  # a family FlashNorm does not cover
        names = [v for v in NAMES if v not in missing]
        prompt = session.last_prompt_ids
        base = self._prefill(prompt)
        r = {}
        for i, v in enumerate(names):  # each built (once) and timed in turn
            start = time.perf_counter()
            if v not in self.models:
                row = BY_NAME[v]
                engine = row.engine or self.engine
                self.models[v], _ = build_model(
                    self.source, row.mode, engine=engine, **self.kwargs
                )
            r[v] = self._regenerate(self.models[v], prompt, n, base)
            if i == 0:
                piece, seconds = f"{v}'s turn", time.perf_counter() - start
                line = estimate.projection(piece, seconds, len(names) - 1, "/compare")
                estimate.tell(self.say, line)
        cells = [f"{v} {r[v]['decode_tps']:.1f}" for v in names]
        why = f"; {next(iter(missing.values()))}" if missing else ""
        speeds = (
            f"decode tok/s, last reply regenerated ({n} tokens, end-of-sequence "
            f"ignored, same {len(prompt)}-token prompt and "
            f"weights; mlx-lm eager, the rest on the {self.engine} engine): "
            + " | ".join(cells)
            + why
        )
        lines = [speeds, NOISE, *texts(r, session.tokenizer)]
        return "\n".join(lines + ([NONORM] if NONORM_NAME in r else []))

    def _prefill(self, prompt):
        """The chat model's cache after prompt[:-1] (each row then feeds
        the last token, its first decode), or None for a one-token prompt."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        if len(prompt) < 2:
            return None
        model = self.models[self.mode]
        cache = make_prompt_cache(model)
        for _ in generate_step(
            mx.array(prompt[:-1]), model, max_tokens=0, prompt_cache=cache
        ):
            pass
        return cache

    def _regenerate(self, model, prompt, n: int, base) -> dict:
        """time_generation of n tokens after `prompt`, from a copy of `base`
        where the model's cache kinds are base's, after a 2-token warm-up."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from ..timing import compare_decode_speed, time_generation

        kinds = [type(c) for c in make_prompt_cache(model)]
        if base is None or kinds != [type(c) for c in base]:
            return compare_decode_speed({"v": model}, prompt, n, self.sampler)["v"]
        last = mx.array(prompt[-1:])
        time_generation(model, last, 2, self.sampler, prompt_cache=copy_cache(base))
        return time_generation(
            model, last, n, self.sampler, prompt_cache=copy_cache(base)
        )


def copy_cache(cache: list) -> list:
    """A cache whose updates leave `cache` as it is: an mx.array's item
    assignment changes that Python object, so each held array is a new one."""
    import copy

    import mlx.core as mx

    def fresh(v):
        if isinstance(v, mx.array):
            return mx.array(v)
        if isinstance(v, (tuple, list)) and v and isinstance(v[0], mx.array):
            return type(v)(mx.array(a) for a in v)
        return v

    out = []
    for c in cache:
        c2 = copy.copy(c)
        for k, v in vars(c).items():
            setattr(c2, k, fresh(v))
        out.append(c2)
    return out


# One text line per distinct reply, this long at most.
TEXT_CHARS = 72


def texts(results: dict, tokenizer) -> list:
    """'  mlx-lm, stock, ...: "text"' lines, the rows with the same text
    on one line (greedy on the same weights: all but nonorm, which is not the
    same function)."""
    groups: dict = {}
    for v, r in results.items():
        groups.setdefault(tokenizer.decode(r["tokens"]), []).append(v)
    lines = []
    for text, names in groups.items():
        flat = " ".join(text.split()) or repr(text)[1:-1]  # whitespace: shown
        if len(flat) > TEXT_CHARS:
            flat = flat[: TEXT_CHARS - 3] + "..."
        lines.append(f"  {', '.join(names)}: \"{flat}\"")
    return lines


CHAT_COMMANDS = ("/help", "/reset", "/compare", "/quit", "/exit")


def unknown_command(command: str) -> str:
    """The line for a mistyped /command: the closest one, where one is close."""
    import difflib

    close = difflib.get_close_matches(command, CHAT_COMMANDS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown command {command}{hint}; /help lists the commands"


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
                ui.notice("(regenerating the last reply with each row ...)")
                try:
                    ui.notice(compare(session))
                except KeyboardInterrupt:
                    ui.notice("(comparison interrupted)")
            else:
                ui.notice(unknown_command(command))
            continue
        try:
            with distributed.watch("generating a reply"):  # no-op in one process
                stats = session.send(
                    line,
                    on_text=distributed.kicking(ui.text),
                    on_prefill=distributed.kicking(prefilling),
                    on_thought=distributed.kicking(ui.thought),
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
    from ..decode_options import KVOptions, check_kv_options
    from ..jobs.conversation import ChatSession
    from ..models import context_length
    from .common import (
        build_for_sampling,
        make_sampler,
        model_kwargs,
        read_for_sampling,
        seed_sampling,
    )
    from .decoding import draft_model

    saved = None
    source, tokenizer, mode = read_for_sampling(args)  # --mode settled, once
    if args.prompt_cache_file is not None:  # a bad file: one line before the build
        saved = prompt_cache.read(
            args.prompt_cache_file, args.model, mode, args.adapter_path
        )
    model, config = build_for_sampling(args, source, mode)
    kv = KVOptions.from_args(args)
    check_kv_options(kv, model, config, source.name)
    draft = draft_model(args, tokenizer, source.name, mode)
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
        ids = prompt_cache.fit(args.prompt_cache_file, *saved, model, mode)
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
            ("mode", mode.name),
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
    compare = CompareRows(source, mode, model, model_kwargs(args), sampler, ui.notice)
    return run_chat(session, ui, args.max_tokens, compare)
