"""`flashnorm-mlx convert [MODEL] -o DIR [-q]`: write a folded checkpoint."""

import argparse
import sys

from ..convert import convert
from .common import Parser, StageLog, add_model_args, model_kwargs, run_main


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx convert",
        description="Fold the norm gains into the weights (in float32), optionally "
        "quantize, and save a checkpoint that flashnorm-mlx loads without folding "
        "again. -q quantizes the folded float weights with --q-bits/--q-group-size "
        "(a quantized source is dequantized first); without -q a quantized source "
        "is requantized with its own settings, or written in float with --dequantize.",
    )
    add_model_args(p, mode=False)
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="folder to write; an existing one is refused, with --force "
        "replaced only if it is a model checkpoint (config.json + *.safetensors)",
    )
    p.add_argument(
        "--compat",
        action="store_true",
        help="keep all-ones norm tensors so stock mlx_lm.load runs the checkpoint",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing checkpoint folder (nothing else) once the new "
        "one is complete",
    )
    return p


@run_main
def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    log = StageLog("convert")
    r = convert(
        args.model,
        args.output,
        compat=args.compat,
        force=args.force,
        progress=sys.stderr.isatty(),
        on_layer=lambda i, n: log(f"layer group {i + 1}/{n} folded"),
        tokenizer=args.tokenizer,
        **model_kwargs(args),
    )
    q = r["quantization"]
    how = f"{q['bits']}-bit, group size {q['group_size']}" if q else "not quantized"
    print(
        f"Wrote {r['path']}: {r['tensors']} tensors in {len(r['files'])} file(s), "
        f"{r['bytes'] / 1e6:.1f} MB, {r['dtype']}, {how}"
        + (", all-ones norms kept (--compat)" if r["compat"] else "")
    )
    return 0
