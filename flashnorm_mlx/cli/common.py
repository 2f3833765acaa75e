"""Flags and error handling shared by the commands (names follow mlx-lm)."""

import argparse
import functools
import sys

import mlx.core as mx

from ..fold import FoldError
from ..loading import DTYPES, MODES, LoadError


class UserError(Exception):
    """A bad flag or input detected by a command: reported as one line."""


def add_model_args(parser: argparse.ArgumentParser, mode: bool = True) -> None:
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
            choices=MODES,
            default="flashnorm",
            help="flashnorm (ours, default) or stock (mlx-lm's own model class "
            "on the same weights)",
        )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="compute dtype (default: the checkpoint's; float16 for a dequantized GGUF)",
    )
    parser.add_argument(
        "-q", "--quantize", action="store_true", help="quantize a float model after folding"
    )
    parser.add_argument("--q-bits", type=int, default=4, choices=(2, 3, 4, 5, 6, 8))
    parser.add_argument("--q-group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="for a quantized source: run unquantized in float (exact FlashNorm) "
        "instead of requantizing the folded weights with the source's settings",
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


def peak_memory_gb() -> float:
    return mx.get_peak_memory() / 1e9
