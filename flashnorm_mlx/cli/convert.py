"""`flashnorm-mlx convert [MODEL] -o DIR [-q]`: write a folded checkpoint."""

import argparse
import sys

from .flags import (
    CALIB_LEN,
    CALIB_SEQS,
    DEFAULT_Q_METHOD,
    Q_METHODS,
    Parser,
    add_model_args,
    run_main,
)
from .mlx_lm_flags import add_adapter_args


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx convert",
        description="Fold the norm gains into the weights (in float32), optionally "
        "quantize, and save a checkpoint that flashnorm-mlx loads without folding "
        "again. -q quantizes the folded float weights with --q-bits/--q-group-size "
        "(a quantized source is dequantized first). Without -q a quantized source "
        "is written as stored: its weights unchanged, config.json marked for "
        "FlashNorm to apply the norm gains in its kernels (stock's exact function "
        "and bytes); --requantize folds it and quantizes again with its own "
        "settings, --dequantize writes it folded in float.",
    )
    add_model_args(p, mode=False, engine=False, explain_quantized=True)
    add_adapter_args(p)
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
    q = p.add_argument_group("quantization method (with -q, or a quantized source)")
    q.add_argument(
        "--q-method",
        choices=Q_METHODS,
        default=DEFAULT_Q_METHOD,
        help="auto (default): rtn on a CPU, gptq where a GPU runs it; gptq: "
        "fold-aware GPTQ calibrated on offline text (FlashNorm 4-bit at stock's "
        "quality; minutes on a CPU; needs a tokenizer); rtn: round-to-nearest "
        "(seconds)",
    )
    q.add_argument(
        "--calib-seqs",
        type=int,
        default=CALIB_SEQS,
        help="GPTQ calibration windows",
    )
    q.add_argument(
        "--calib-len",
        type=int,
        default=CALIB_LEN,
        help="tokens per calibration window",
    )
    return p


@run_main
def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if not args.output.strip():
        parser.error("-o/--output is empty")
    # MLX and mlx-lm (seconds) once the flags are good.
    from .. import quant
    from ..checkpoint import convert
    from ..loading import gguf_kquant
    from ..quant import gptq
    from .common import StageLog, interruptible, model_kwargs, say_slow

    with StageLog("convert") as log, interruptible(log):
        log.step(f"reading {args.model or 'the embedded model'}")
        r = convert(
            args.model,
            args.output,
            compat=args.compat,
            force=args.force,
            progress=sys.stderr.isatty(),
            tokenizer=args.tokenizer,
            q_method=args.q_method,
            calibration=gptq.Calibration(args.calib_seqs, args.calib_len),
            on_stage=log,
            on_step=log.step,
            on_slow=say_slow("convert"),
            adapter_path=args.adapter_path,
            **model_kwargs(args),
        )
    q = r["quantization"]
    how = "not quantized"
    if q:
        how = f"{quant.describe({'quantization': q})}, " + (
            "the source's weights as stored, norm gains applied in FlashNorm's "
            "kernels"
            if r["as_stored"]
            else r["quantization_method"]
        )
    if r["float_kquants"]:  # never "not quantized": the file's were
        how = gguf_kquant.written_words(r["float_kquants"], r["dtype"]) + (
            f"; the rest {how}" if q else ""
        )
    print(
        f"Wrote {r['path']}: {r['tensors']} tensors in {len(r['files'])} file(s), "
        f"{r['bytes'] / 1e6:.1f} MB, {r['dtype']}, {how}"
        + (", all-ones norms kept (--compat)" if r["compat"] else "")
    )
    if args.compat and r["as_stored"]:
        print(COMPAT_AS_STORED)
    return 0


# --compat on a source written as stored: nothing to keep, and said.
COMPAT_AS_STORED = (
    "--compat changed nothing: a quantized source written as stored keeps its "
    "norms, so stock mlx_lm.load runs it already; its tensors are the source's, "
    "byte for byte"
)
