"""The commands' flags and exit handling: all a command needs until its flags
are checked, so none of it imports MLX or mlx-lm (seconds to import): a bad flag
is one line and exit 2 at once. common.py holds the rest, which imports them.
"""

import argparse
import functools
import sys

from .. import interrupt
from ..errors import FlashNormError, UserError  # noqa: F401 (commands raise it)
from ..limits import GROUP_SIZES, SEED_NEED, TEMP_NEED, WEIGHT_BITS, seed_ok, temp_ok
from ..modes import RUN_MODES  # MLX-free: the modes a user runs
from .mlx_lm_flags import KV_KEEP

# The names the flags offer, copied from the library modules that define them,
# which import MLX (tests/test_cli.py checks each against its source).
DTYPE_NAMES = ("float16", "bfloat16", "float32")  # loading.DTYPES
ENGINES = ("eager", "compiled")  # engine.ENGINES
# loading.rows.NAMES: bench's and /compare's rows, the reference first
VARIANT_NAMES = ("mlx-lm", "stock", "stock_fused", "nonorm", "flashnorm")
Q_METHODS = ("auto", "gptq", "rtn")  # quant.gptq.METHODS
DEFAULT_Q_METHOD = "auto"  # quant.gptq.DEFAULT_METHOD
CALIB_SEQS, CALIB_LEN = 16, 128  # quant.gptq.Calibration's num_seqs, seq_len
API_KEY_ENV = "FLASHNORM_MLX_API_KEY"  # serve.API_KEY_ENV


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, unless its help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.required:  # e.g. convert's -o: there is no default to show
            return text + " (required)"
        if action.nargs == 0:  # an on/off flag; one of several ways: on if the default
            on = action.default
            # store_const (a const that is a value, not store_true's True): on
            # where the default is that value; argparse names no public class.
            if action.const is not None and not isinstance(action.const, bool):
                on = action.default == action.const
            return text + (" (default: on)" if on else " (default: off)")
        if action.default is None:
            return text + " (default: none)"
        return text + " (default: %(default)s)"


# Values no command can run with, by flag destination: (ok, what is needed).
# bench's own (-p, -g, -n, --variants) are `bench.validate`'s, which library
# callers get too.
VALUE_RULES = {
    "temp": (temp_ok, TEMP_NEED),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "max_tokens": (lambda v: v >= 1, "at least 1"),
    "seed": (seed_ok, SEED_NEED),
    "horizon": (lambda v: v >= 1, "at least 1"),
    "prefill_step_size": (lambda v: v >= 1, "at least 1"),
    "seq_len": (lambda v: v is None or v >= 2, "at least 2"),
    "num_seqs": (lambda v: v is None or v >= 0, "at least 0 (0: all of the text)"),
    "batch_size": (lambda v: v >= 1, "at least 1"),
    "max_context": (lambda v: v is None or v >= 2, "at least 2"),
    "calib_seqs": (lambda v: v >= 1, "at least 1"),
    "calib_len": (lambda v: v >= 2, "at least 2"),
    "top_k": (lambda v: v >= 0, "at least 0 (0: off)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
    "min_tokens_to_keep": (lambda v: v >= 1, "at least 1"),
    "xtc_probability": (lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
    "xtc_threshold": (lambda v: 0 <= v <= 0.5, "in [0, 0.5]"),
    "num_draft_tokens": (lambda v: v >= 1, "at least 1"),
    # A rotating cache keeps the first KV_KEEP tokens: its window must hold more.
    "max_kv_size": (lambda v: v is None or v > KV_KEEP, "more than 4 (tokens kept)"),
    "quantized_kv_start": (lambda v: v >= 0, "at least 0"),
    # serve's own.
    "port": (lambda v: 0 <= v <= 65535, "from 0 to 65535"),
    "prompt_cache_size": (lambda v: v >= 1, "at least 1"),
    "decode_concurrency": (lambda v: v >= 1, "at least 1"),
    "max_connections": (lambda v: v >= 1, "at least 1"),
    "max_connections_per_client": (lambda v: v >= 1, "at least 1"),
    "prefill_chunk_seconds": (lambda v: v > 0, "more than 0"),
    "request_timeout": (lambda v: v > 0, "more than 0"),
    # Given, but only commas and spaces.
    "allowed_origins": (lambda v: len(v) > 0, "one name or more (or *)"),
    "allowed_hosts": (lambda v: len(v) > 0, "one name or more (or *)"),
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
        if getattr(args, "draft_model", None) and getattr(args, "max_kv_size", None):
            # docs/design.md section 3f: a draft rewinds the cache after each
            # step, which a rotating cache past its window cannot.
            self.error(
                "--draft-model and --max-kv-size do not go together: speculative "
                "decoding rewinds the KV cache, which a rotating cache cannot"
            )
        if getattr(args, "kv_bits", None) and getattr(args, "max_kv_size", None):
            # mlx-lm quantizes plain caches only (RotatingKVCache.to_quantized).
            self.error(
                "--kv-bits and --max-kv-size do not go together: mlx-lm cannot "
                "quantize a rotating KV cache"
            )
        return args


# How a quantized source runs (quant.QUANTIZED_WAYS): convert's help explains
# each way; the other commands say it in a few words and point there.
QUANTIZED_FLAGS = {
    "stored": (
        "--as-stored",
        "quantized source: run its quantized weights as stored, stock's exact "
        "function and bytes per token; FlashNorm applies the norm gains in its "
        "kernels, since folding them into quantized weights would mean "
        "quantizing again (default)",
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


QUANTIZED_SHORT = {
    "stored": "run its quantized weights as the file holds them (default)",
    "dequantize": "run them in float: the same results, more memory",
    "requantize": "fold, then round them again alike: close results, not identical",
}
QUANTIZED_POINTER = (
    "how a quantized checkpoint runs; `flashnorm-mlx convert --help` and the "
    "README explain each way"
)


def add_model_args(
    parser: argparse.ArgumentParser,
    mode: bool = True,
    engine: bool = True,
    explain_quantized: bool = False,
) -> None:
    """MODEL, --tokenizer, --mode, --dtype, the quantization flags and --engine
    (not for commands that run no decode step). explain_quantized: the long
    help of each way a quantized source runs (convert's); otherwise a few words
    each and a pointer to it."""
    _add_source_args(parser)
    if mode:
        parser.add_argument(
            "--mode",
            choices=RUN_MODES,
            default=None,  # flashnorm where it covers the model_type, else stock
            help="flashnorm (ours; the default for the families it covers) or "
            "stock (mlx-lm's own model class on the same weights; the default, "
            "said in a note, for every other family mlx-lm loads)",
        )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPE_NAMES),
        default=None,
        help="compute dtype (default: float32 on MLX's CPU backend, whose float16 "
        "kernels are slow; the checkpoint's own dtype on Metal and CUDA); "
        "quantized weights run as stored are not cast, and their activations "
        "take mlx-lm's dtype (the norms' promotion), at least this one",
    )
    _add_quantize_args(parser, explain_quantized)
    if engine:
        add_engine_arg(parser)


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    """MODEL (or --model) and --tokenizer: where the weights and tokenizer come from."""
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


def _add_quantize_args(
    parser: argparse.ArgumentParser, explain_quantized: bool
) -> None:
    """-q and its settings, and the ways a quantized source runs (one of them)."""
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
        choices=WEIGHT_BITS,
        help="bits per weight with -q (default: 4)",
    )
    parser.add_argument(
        "--q-group-size",
        type=int,
        default=None,
        choices=GROUP_SIZES,
        help="weights per quantization group with -q (default: 64)",
    )
    section = parser.add_argument_group(
        "quantized source", None if explain_quantized else QUANTIZED_POINTER
    )
    group = section.add_mutually_exclusive_group()
    for way, (flag, text) in QUANTIZED_FLAGS.items():
        text = text if explain_quantized else QUANTIZED_SHORT[way]
        group.add_argument(
            flag, dest="quantized_way", action="store_const", const=way, help=text
        )
    parser.set_defaults(quantized_way="stored")


def add_engine_arg(parser: argparse.ArgumentParser, default_text: str = "") -> None:
    """--engine, and --compile/--no-compile as its aliases for one release."""
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


def run_main(fn):
    """Turn user errors into one line on stderr and exit status 1, no traceback."""

    @functools.wraps(fn)
    def wrapper(argv=None):
        interrupt.reset()
        try:
            return fn(argv)
        except FlashNormError as e:
            from ..parallel import distributed  # imported by then: the error's

            distributed.report_error(e)  # a launch: one line, not one per rank
            return 1
        except RuntimeError as e:  # a collective failed: a peer exited
            distributed = sys.modules.get("flashnorm_mlx.parallel.distributed")
            if distributed is None or not distributed.is_collective_error(e):
                raise
            rank, why = distributed.rank_prefix(), distributed.lost_peer_message(e)
            print(f"flashnorm-mlx: error: {rank}{why}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            interrupt.hand_over()  # a guard's watcher is printing its line
            command = fn.__module__.rsplit(".", 1)[-1]
            interrupt.say(interrupt.interrupted(f"flashnorm-mlx {command}"))
            return 130
        except SystemExit as e:  # argparse: --help (0) or a bad flag (2), printed
            return e.code if isinstance(e.code, int) else 0 if e.code is None else 1

    return wrapper
