"""Flags and error handling shared by the commands (names follow mlx-lm)."""

import argparse
import functools
import sys


from ..fold import FoldError
from ..loading import DTYPES, LoadError


class UserError(Exception):
    """A bad flag or input detected by a command: reported as one line."""


# The modes a user runs; bench adds the "nonorm" speed bound itself.
RUN_MODES = ("flashnorm", "stock")


def add_model_args(
    parser: argparse.ArgumentParser, mode: bool = True, exact_default: bool = False
) -> None:
    """MODEL, --tokenizer, --mode, --dtype and the quantization flags.

    exact_default: a quantized source runs dequantized (exact) unless --requantize;
    otherwise it is requantized unless --dequantize.
    """
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model folder, Hugging Face repo id or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder or repo id, for checkpoints that ship none (OpenELM)",
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
        help="quantize a float model after folding",
    )
    parser.add_argument("--q-bits", type=int, default=4, choices=(2, 3, 4, 5, 6, 8))
    parser.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128))
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--dequantize",
        dest="dequantize",
        action="store_true",
        default=exact_default,
        help="quantized source: dequantize, fold and run in float, the same function "
        "as the source" + (" (default)" if exact_default else ""),
    )
    group.add_argument(
        "--requantize",
        dest="dequantize",
        action="store_false",
        help="quantized source: dequantize, fold in float32, requantize with the "
        "source's bits and group size (stock is requantized the same way)"
        + ("" if exact_default else " (default)"),
    )


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """-m/--max-tokens, --temp, --top-p, --seed, as mlx-lm names them."""
    parser.add_argument(
        "-m", "--max-tokens", type=int, default=max_tokens, help="most tokens per reply"
    )
    parser.add_argument(
        "--temp", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling threshold"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed for sampling"
    )


def model_kwargs(args) -> dict:
    return dict(
        dtype=DTYPES[args.dtype] if args.dtype else None,
        quantize=(args.q_bits, args.q_group_size) if args.quantize else None,
        dequantize=args.dequantize,
    )


def run_main(fn):
    """Turn user errors into one line on stderr and exit status 1, no traceback."""

    @functools.wraps(fn)
    def wrapper(argv=None):
        try:
            return fn(argv)
        except (LoadError, FoldError, UserError) as e:
            print(f"flashnorm-mlx: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("", file=sys.stderr)
            return 130

    return wrapper


def need_tokenizer(tokenizer, model_name):
    if tokenizer is None:
        raise UserError(
            f"{model_name} has no tokenizer; pass --tokenizer PATH_OR_REPO "
            "(OpenELM checkpoints use the Llama-2 tokenizer)"
        )
    return tokenizer
