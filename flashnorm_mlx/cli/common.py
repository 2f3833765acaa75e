"""What the commands share once their flags are checked: loading a model with
them, sampling, the stage log, Ctrl-C's guard. Imports MLX (cli/flags.py is
the part that does not)."""

import sys
import threading
import time
from typing import Optional

from .. import interrupt
from ..errors import UserError
from ..loading import DTYPES, build_model, read_source
from ..parallel import distributed


def make_sampler(args, tokenizer):
    """mlx-lm's sampler for the flags, as mlx_lm.generate makes it (XTC never
    excludes a newline or end-of-sequence token)."""
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

    special = []
    if args.xtc_probability > 0:
        eos = getattr(tokenizer, "eos_token_ids", None) or ()
        special = list(tokenizer.encode("\n")) + list(eos)
    return mlx_lm_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=special,
    )


def model_kwargs(args) -> dict:
    launch = distributed.current()
    if launch is None and distributed.launch_backend():
        # N copies of the whole job (convert: N writers of one folder) help nobody.
        raise UserError(
            "started by mlx.launch with several ranks: only generate, chat and "
            "bench run tensor-parallel; run this command in one process"
        )
    return dict(
        dtype=DTYPES[args.dtype] if args.dtype else None,
        quantize=(args.q_bits, args.q_group_size) if args.quantize else None,
        quantized_way=args.quantized_way,
        **({"group": launch.group} if launch else {}),
        **({"engine": args.engine} if hasattr(args, "engine") else {}),
    )


def build(source, mode, args):
    """`build_model` with the command's flags; where a quantized source is not
    run as its file holds it (in float, or rounded again), one note on stderr
    says what the user gets instead (quant/plan.py)."""
    notes = []
    model, config = build_model(source, mode, notes=notes, **model_kwargs(args))
    for note in notes:
        say_note(note)
    return model, config


def say_note(note: str) -> None:
    if distributed.is_main_rank():  # once per launch
        print(f"flashnorm-mlx: note: {note}", file=sys.stderr)


def settle_mode(source, asked, engine=None):
    """The Mode the model read runs (models.run_mode): as asked, else flashnorm
    where FlashNorm covers its model_type; a family it does not cover runs as
    stock, said in one note, and --mode flashnorm on it is one error line."""
    from .. import engine as engines
    from .. import models

    mode = models.run_mode(source.config, asked)
    if not models.is_covered(source.config):
        say_note(models.stock_note(source.config, engines.resolve(engine)))
    return mode


def read_for_sampling(args):
    """(source, tokenizer, mode): join a multi-rank launch, read MODEL, settle
    --mode for it."""
    join_launch(args)  # mlx.launch with several ranks: tensor parallel
    return read_model(args)


def build_for_sampling(args, source, mode):
    """(model, config): build (sharded under a launch); `seed_sampling` after."""
    model, config = build(source, mode, args)
    distributed.announce()
    return model, config


def seed_sampling(args, source) -> None:
    """--seed, after every build (ours draw at random: another class, a sharded
    build's init): the generator where `mlx_lm generate --seed` has it once it
    loaded MODEL, the adapter and the draft (seeding.py), so the same seed
    samples mlx-lm's reply."""
    from ..seeding import seed_as_mlx_lm

    if args.seed is not None:
        seed_as_mlx_lm(
            args.seed,
            source,
            getattr(args, "adapter_path", None),
            getattr(args, "draft_model", None),
        )


def join_launch(args, sampling: bool = True):
    """Started by mlx.launch with several ranks: join its group (a bounded wait),
    print on rank 0 only and, for sampling, share rank 0's seed so every rank
    draws the same tokens. None in one process."""
    launch = distributed.join()
    if launch is not None:
        distributed.quiet_other_ranks()
        if sampling:
            args.seed = distributed.shared_seed(args.seed)
    return launch


class StageLog:
    """Where a long command is, on stderr when it is not a terminal (a terminal
    gets the live bar instead, or, for verify, the same lines).

    `log(what)`: a stage ended, one line. `log.step(what)`: where the work is
    within a stage, before each of its steps: a line only when none came for
    HEARTBEAT_S, so a fast run prints its stages alone. Used as a context
    manager, a thread repeats the step every HEARTBEAT_S while one runs long
    (mx.eval releases the GIL). `log.now()`: what runs, for Ctrl-C's line.
    Lines follow a stage's end, so bad input, found while reading, still
    gives one error line and nothing else."""

    HEARTBEAT_S = 10.0

    def __init__(self, command: str, enabled: Optional[bool] = None):
        self.prefix = f"flashnorm-mlx {command}:"
        if enabled is None:  # one log for a tensor-parallel launch: rank 0's
            enabled = not sys.stderr.isatty() and distributed.is_main_rank()
        self.enabled = enabled
        self.start = self.last = self.printed = time.perf_counter()
        self.current, self.step_start = "", self.start
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._ticker: Optional[threading.Thread] = None

    def __call__(self, what: str) -> None:
        with self._lock:
            now = time.perf_counter()
            self._print(
                f"{what} ({now - self.last:.1f} s; {now - self.start:.1f} s in all)"
            )
            self.last = now
            self.current = ""

    def step(self, what: str) -> None:
        with self._lock:
            now = time.perf_counter()
            self.current, self.step_start = what, now
            if now - self.printed >= self.HEARTBEAT_S:
                self._print(f"{what} ({now - self.start:.1f} s in all)")

    def now(self) -> str:
        return self.current

    def _print(self, line: str) -> None:
        self.printed = time.perf_counter()
        if self.enabled:
            print(f"{self.prefix} {line}", file=sys.stderr, flush=True)

    def _tick(self) -> None:
        while not self._done.wait(min(1.0, self.HEARTBEAT_S / 4)):
            with self._lock:
                now = time.perf_counter()
                if self.current and now - self.printed >= self.HEARTBEAT_S:
                    self._print(
                        f"{self.current}: still at it ({now - self.step_start:.0f} s "
                        f"so far; {now - self.start:.1f} s in all)"
                    )

    def __enter__(self) -> "StageLog":
        if self.enabled:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._ticker is not None:
            self._ticker.join()


def say_slow(command: str):
    """A library job's on_slow (estimate.py): its line on stderr beside the
    stage lines (above a live bar, which rich keeps below), rank 0's alone."""

    def say(line: str) -> None:
        print(f"flashnorm-mlx {command}: {line}", file=sys.stderr, flush=True)

    return say if distributed.is_main_rank() else None


def interruptible(log: StageLog):
    """Ctrl-C inside: one line saying what `log` was doing, exit 130, at once
    (`interrupt.guard`), even inside a long mx.eval."""
    return interrupt.guard(log.now, log.prefix)


def read_model(args):
    """(source, tokenizer, mode) of MODEL for the commands that tokenize:
    --tokenizer, --adapter-path and --trust-remote-code as the flags give them;
    --mode settled for it (`settle_mode`), once: the commands pass the Mode on."""
    source = read_source(
        args.model,
        tokenizer=args.tokenizer,
        adapter_path=args.adapter_path,
        trust_remote_code=args.trust_remote_code,
    )
    tokenizer = need_tokenizer(source.tokenizer, source.name)
    mode = settle_mode(source, args.mode, getattr(args, "engine", None))
    return source, tokenizer, mode


def need_tokenizer(tokenizer, model_name):
    if tokenizer is None:
        raise UserError(
            f"{model_name} has no tokenizer; pass --tokenizer PATH_OR_REPO "
            "(OpenELM checkpoints use the Llama-2 tokenizer)"
        )
    return tokenizer
