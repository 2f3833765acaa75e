"""Flags and error handling shared by the commands (names follow mlx-lm)."""

import argparse
import functools
import math
import sys
import threading
import time
from typing import Optional

from .. import interrupt, quant
from ..errors import FlashNormError, UserError  # noqa: F401 (commands raise it)
from ..loading import DTYPES, RUN_MODES, build_model, read_source
from ..parallel import distributed


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, unless its help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.required:  # e.g. convert's -o: there is no default to show
            return text + " (required)"
        if action.nargs == 0:  # an on/off flag
            return text + (" (default: on)" if action.default else " (default: off)")
        if action.default is None:
            return text + " (default: none)"
        return text + " (default: %(default)s)"


# Values no command can run with, by flag destination: (ok, what is needed).
# bench's own (-p, -g, -n, --variants) are `bench.validate`'s, which library
# callers get too.
VALUE_RULES = {
    "temp": (lambda v: math.isfinite(v) and v >= 0, "a number >= 0 (0: greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "max_tokens": (lambda v: v >= 1, "at least 1"),
    "seed": (lambda v: v is None or 0 <= v < 2**32, "from 0 to 2**32-1"),
    "horizon": (lambda v: v >= 1, "at least 1"),
    "prefill_step_size": (lambda v: v >= 1, "at least 1"),
    "seq_len": (lambda v: v >= 2, "at least 2"),
    "num_seqs": (lambda v: v >= 0, "at least 0 (0: all of the text)"),
    "batch_size": (lambda v: v >= 1, "at least 1"),
    "max_context": (lambda v: v is None or v >= 2, "at least 2"),
    "calib_seqs": (lambda v: v >= 1, "at least 1"),
    "calib_len": (lambda v: v >= 2, "at least 2"),
    "top_k": (lambda v: v >= 0, "at least 0 (0: off)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
    "min_tokens_to_keep": (lambda v: v >= 1, "at least 1"),
    "xtc_probability": (lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
    "xtc_threshold": (lambda v: 0 <= v <= 0.5, "in [0, 0.5]"),
}
Q_DEFAULTS = {"q_bits": 4, "q_group_size": 64}


class Parser(argparse.ArgumentParser):
    """argparse with every default in --help, errors on one line, and the
    values no command can run with (VALUE_RULES) refused before any work."""

    def __init__(self, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(**kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        args = super().parse_args(args, namespace)
        if hasattr(args, "model_flag"):  # MODEL, or --model as mlx-lm spells it
            if args.model is not None and args.model_flag is not None:
                self.error(
                    f"MODEL given twice ({args.model!r} and --model "
                    f"{args.model_flag!r}): give one"
                )
            if args.model_flag is not None:
                args.model = args.model_flag
            del args.model_flag
        flags = {
            a.dest: "/".join(a.option_strings)
            for a in self._actions
            if a.option_strings
        }
        for dest, (ok, need) in VALUE_RULES.items():
            value = getattr(args, dest, None)
            if dest in flags and value is not None and not ok(value):
                self.error(f"{flags[dest]} must be {need}, not {value}")
        if hasattr(args, "quantize"):
            given = [flags[d] for d in Q_DEFAULTS if getattr(args, d) is not None]
            if given and not args.quantize:
                self.error(f"{'/'.join(given)} only apply with -q/--quantize")
            for dest, default in Q_DEFAULTS.items():
                if getattr(args, dest) is None:
                    setattr(args, dest, default)
        return args


# How a quantized source runs (quant.QUANTIZED_WAYS), one line of help each.
QUANTIZED_FLAGS = {
    "stored": (
        "--as-stored",
        "quantized source: run its quantized weights as stored, stock's exact "
        "function and bytes per token; FlashNorm applies the norm gains in its "
        "kernels, since folding them into quantized weights would mean "
        "quantizing again (default; a short 'note:' line on stderr says so)",
    ),
    "dequantize": (
        "--dequantize",
        "quantized source: dequantize, fold and run in float: the same function, "
        "2-4x the bytes per token (default: off)",
    ),
    "requantize": (
        "--requantize",
        "quantized source: dequantize, fold in float32, quantize again with the "
        "source's bits and group size (stock alike): a slightly different function "
        "(default: off)",
    ),
}


def add_model_args(
    parser: argparse.ArgumentParser, mode: bool = True, engine: bool = True
) -> None:
    """MODEL, --tokenizer, --mode, --dtype, the quantization flags and --engine
    (not for commands that run no decode step)."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model folder, Hugging Face repo id or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--model",
        dest="model_flag",
        metavar="MODEL",
        default=None,
        help="MODEL as a flag, as mlx-lm's commands take it (MODEL or --model, "
        "not both; default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder or repo id, for checkpoints that ship none (OpenELM) "
        "(default: the model's own)",
    )
    if mode:
        parser.add_argument(
            "--mode",
            choices=RUN_MODES,
            default="flashnorm",
            help="flashnorm (ours, default) or stock (mlx-lm's own model class "
            "on the same weights)",
        )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="compute dtype (default: float32 on MLX's CPU backend, whose float16 "
        "kernels are slow; the checkpoint's own dtype on Metal and CUDA)",
    )
    parser.add_argument(
        "-q",
        "--quantize",
        action="store_true",
        help="quantize a float model after folding (a quantized one is "
        "dequantized first)",
    )
    # None: not given, so -q's defaults apply and their use without -q shows.
    parser.add_argument(
        "--q-bits",
        type=int,
        default=None,
        choices=(2, 3, 4, 5, 6, 8),
        help="bits per weight with -q (default: 4)",
    )
    parser.add_argument(
        "--q-group-size",
        type=int,
        default=None,
        choices=(32, 64, 128),
        help="weights per quantization group with -q (default: 64)",
    )
    group = parser.add_mutually_exclusive_group()
    for way, (flag, text) in QUANTIZED_FLAGS.items():
        group.add_argument(
            flag, dest="quantized_way", action="store_const", const=way, help=text
        )
    parser.set_defaults(quantized_way="stored")
    if engine:
        add_engine_arg(parser)


def add_engine_arg(parser: argparse.ArgumentParser, default_text: str = "") -> None:
    """--engine, and --compile/--no-compile as its aliases for one release."""
    from ..engine import ENGINES

    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="what runs the decode steps, the same for every --mode: eager (each "
        "step's graph built op by op, as mlx-lm runs it) or compiled (one "
        "mx.compile'd step per shape, a length-aware attention: same tokens, "
        "less host time per step) "
        + (
            default_text
            or "(default: compiled where Metal or CUDA runs the model, where the "
            "host sets the pace; eager on the CPU, where the matmuls do and a "
            "first run would spend seconds compiling kernels)"
        ),
    )
    parser.add_argument(
        "--compile",
        dest="engine",
        action="store_const",
        const="compiled",
        help="the same as --engine compiled (an alias kept for one release; the "
        "default is --engine's)",
    )
    parser.add_argument(
        "--no-compile",
        dest="engine",
        action="store_const",
        const="eager",
        help="the same as --engine eager (an alias kept for one release; the "
        "default is --engine's)",
    )


# mlx-lm's sampler flags (mlx_lm.generate; make_sampler's arguments), default
# off: flag destination -> (type, default, help).
SAMPLER_FLAGS = {
    "top_p": (float, 1.0, "nucleus sampling threshold (1: off)"),
    "top_k": (int, 0, "sample from the k most likely tokens only (0: off)"),
    "min_p": (
        float,
        0.0,
        "drop tokens less likely than min-p times the most likely one (0: off)",
    ),
    "min_tokens_to_keep": (int, 1, "tokens that --min-p never drops"),
    "xtc_probability": (
        float,
        0.0,
        "XTC sampling: chance per token of excluding the top choices (0: off)",
    ),
    "xtc_threshold": (
        float,
        0.1,
        "XTC sampling: tokens at least this likely count as top choices",
    ),
}


def add_sampling_args(
    parser: argparse.ArgumentParser, max_tokens: int, sampler=tuple(SAMPLER_FLAGS)
) -> None:
    """-m/--max-tokens, --temp, the `sampler` flags of SAMPLER_FLAGS, --seed,
    as mlx-lm names them."""
    parser.add_argument(
        "-m", "--max-tokens", type=int, default=max_tokens, help="most tokens per reply"
    )
    parser.add_argument(
        "--temp", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    for dest in sampler:
        kind, default, text = SAMPLER_FLAGS[dest]
        flag = "--" + dest.replace("_", "-")
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="random seed for sampling (default: none, a different draw each run)",
    )


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


def build(source, mode: str, args):
    """`build_model` with the command's flags; a note on how the weights were
    taken (e.g. a folded 4-bit checkpoint run in float) goes to stderr."""
    notes = []
    model, config = build_model(source, mode, notes=notes, **model_kwargs(args))
    for note in notes if distributed.is_main_rank() else []:  # once per launch
        if mode != "flashnorm":  # stock applies its norm gains as always
            note = note.replace(quant.STORED_GAINS, "")
        print(f"flashnorm-mlx: note: {note}", file=sys.stderr)
    return model, config


def load_for_sampling(args):
    """(source, tokenizer, model, config) for chat and generate: join a multi-rank
    launch, read MODEL, build it (sharded under a launch), then seed sampling."""
    import mlx.core as mx

    join_launch(args)  # mlx.launch with several ranks: tensor parallel
    source = read_source(args.model, tokenizer=args.tokenizer)
    tokenizer = need_tokenizer(source.tokenizer, source.name)
    model, config = build(source, args.mode, args)
    distributed.announce()
    if args.seed is not None:  # after the build: a sharded build draws random
        mx.random.seed(args.seed)  # init weights, so the seed governs sampling alone
    return source, tokenizer, model, config


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


def interruptible(log: StageLog):
    """Ctrl-C inside: one line saying what `log` was doing, exit 130, at once
    (`interrupt.guard`), even inside a long mx.eval."""
    return interrupt.guard(log.now, log.prefix)


def run_main(fn):
    """Turn user errors into one line on stderr and exit status 1, no traceback."""

    @functools.wraps(fn)
    def wrapper(argv=None):
        try:
            return fn(argv)
        except FlashNormError as e:
            distributed.report_error(e)  # a launch: one line, not one per rank
            return 1
        except RuntimeError as e:  # a collective failed: a peer exited
            if not distributed.is_collective_error(e):
                raise
            rank, why = distributed.rank_prefix(), distributed.lost_peer_message(e)
            print(f"flashnorm-mlx: error: {rank}{why}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            interrupt.hand_over()  # a guard's watcher is printing its line
            lead = "\n" if sys.stderr.isatty() else ""  # after the terminal's ^C
            command = fn.__module__.rsplit(".", 1)[-1]
            print(
                f"{lead}flashnorm-mlx {command}: interrupted (Ctrl-C)", file=sys.stderr
            )
            return 130
        except SystemExit as e:  # argparse: --help (0) or a bad flag (2), printed
            return e.code if isinstance(e.code, int) else 0 if e.code is None else 1

    return wrapper


def need_tokenizer(tokenizer, model_name):
    if tokenizer is None:
        raise UserError(
            f"{model_name} has no tokenizer; pass --tokenizer PATH_OR_REPO "
            "(OpenELM checkpoints use the Llama-2 tokenizer)"
        )
    return tokenizer
