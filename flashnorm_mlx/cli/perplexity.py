"""`flashnorm-mlx perplexity [MODEL]`: stock vs FlashNorm perplexity on real text."""

import argparse
import json
import sys
from pathlib import Path

from ..errors import LoadError
from .flags import (
    DEFAULT_Q_METHOD,
    Q_METHODS,
    RUN_MODES,
    Parser,
    add_model_args,
    run_main,
)

# (--seq-len, --num-seqs) by default: the CPU's run about a minute on the
# embedded model (2-core CPU: ~8 tokens/s a side), a GPU's the fuller one.
CPU_SIZE, GPU_SIZE = (32, 4), (256, 16)


def default_size(seq_len, num_seqs, on_cpu: bool):
    """(seq_len, num_seqs) with the machine's defaults where not given."""
    size = CPU_SIZE if on_cpu else GPU_SIZE
    return (
        size[0] if seq_len is None else seq_len,
        size[1] if num_seqs is None else num_seqs,
    )


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx perplexity",
        description="Perplexity of stock mlx-lm and FlashNorm on the same text and "
        "weights, with a 95% interval of their difference; -q quantizes both from "
        "the same float weights.",
    )
    add_model_args(p, mode=False, engine=False)  # scores whole windows
    p.add_argument(
        "--data",
        default=None,
        help="UTF-8 text file (default: the pydoc topics that ship with Python)",
    )
    # Sized for the machine: MLX's CPU backend scores ~8 tokens/s a side on the
    # embedded model, so 16 x 256 took 16 minutes there (issue 60).
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help=f"tokens per window (default: {CPU_SIZE[0]} on MLX's CPU backend, "
        f"{GPU_SIZE[0]} on Metal and CUDA)",
    )
    p.add_argument(
        "--num-seqs",
        type=int,
        default=None,
        help=f"windows to score, 0: all of the text (default: {CPU_SIZE[1]} on "
        f"MLX's CPU backend, about a minute for the embedded model; {GPU_SIZE[1]} "
        "on Metal and CUDA)",
    )
    p.add_argument(
        "-b", "--batch-size", type=int, default=4, help="windows per forward"
    )
    p.add_argument(
        "--mode",
        choices=("both", *RUN_MODES),
        default="both",
        help="models to score (stock alone for a family FlashNorm does not cover)",
    )
    p.add_argument(
        "--q-method",
        choices=Q_METHODS,
        default=DEFAULT_Q_METHOD,
        help="how FlashNorm is quantized (stock: mlx-lm's round-to-nearest): gptq, "
        "fold-aware and calibrated on text never scored (minutes on a CPU); rtn; "
        "auto (default): rtn on a CPU, gptq where a GPU runs it",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


@run_main
def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.data is not None and not Path(args.data).expanduser().is_file():
        parser.error(f"--data: no such data file: {args.data}")  # before MLX loads
    # MLX and mlx-lm (seconds) once the flags are good.
    import mlx.core as mx

    from .. import models
    from ..jobs.likelihood import load_text, perplexity
    from ..loading import read_source
    from ..loading.rows import comparison
    from ..quant import gptq
    from .common import (
        StageLog,
        interruptible,
        model_kwargs,
        need_tokenizer,
        say_note,
        say_slow,
    )

    on_cpu = mx.default_device() == mx.cpu
    args.seq_len, args.num_seqs = default_size(args.seq_len, args.num_seqs, on_cpu)
    try:
        text = load_text(args.data)
    except LoadError as e:  # a flag's file: flashnorm-mlx perplexity: error:
        parser.error(f"--data: {e}")
    with StageLog("perplexity") as log, interruptible(log):
        log.step(f"reading {args.model or 'the embedded model'}")
        source = read_source(args.model, tokenizer=args.tokenizer)
        tokenizer = need_tokenizer(source.tokenizer, source.name)
        asked = RUN_MODES if args.mode == "both" else (args.mode,)
        covered = models.is_covered(source.config)
        if not covered:  # the stock row alone; flashnorm asked alone is one line
            asked = (None if args.mode == "both" else args.mode,)
        modes = [models.run_mode(source.config, m) for m in asked]
        if not covered:
            say_note(models.stock_note(source.config))
        auto = gptq.auto_note(args.q_method, bool(args.quantize))
        if auto and any(m.ours for m in modes):  # ours: GPTQ's side
            say_note(auto)
        log.step("tokenizing the text")
        r = perplexity(
            source,
            tokens=list(tokenizer.encode(text)),
            seq_len=args.seq_len,
            num_seqs=args.num_seqs,
            modes=modes,
            batch_size=args.batch_size,
            progress=sys.stderr.isatty(),
            on_stage=log,
            on_step=log.step,
            on_slow=say_slow("perplexity"),
            q_method=args.q_method,
            **model_kwargs(args),
        )
    kw = model_kwargs(args)
    r.update(comparison(source, kw["quantize"], kw["quantized_way"]))
    if args.json:
        print(json.dumps(r))
        return 0
    _print_table(r)
    return 0


def _print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..jobs.likelihood import MIN_TIMED_TOKENS

    quant = r["quantization"] or "not quantized"
    t = Table(title=f"Perplexity: {r['model']} ({r['dtype']}, {quant})")
    t.add_column("model")
    t.add_column("weights", justify="left")
    t.add_column("bits/weight", justify="right")
    t.add_column("perplexity", justify="right")
    t.add_column("mean NLL", justify="right")
    timed = all(r.get(f"{m}_tokens_per_sec") for m in RUN_MODES if m in r)
    if timed:  # both warmed up, and enough tokens to time more than overhead
        t.add_column("tokens/sec", justify="right")
    for mode in RUN_MODES:
        if mode in r:
            t.add_row(
                mode,
                r[f"{mode}_method"],
                f"{r[f'{mode}_bits_per_weight']:.2f}",
                f"{r[mode]:.4f}",
                f"{r[f'{mode}_nll']:.6f}",
                *([f"{r[f'{mode}_tokens_per_sec']:.0f}"] if timed else []),
            )
    console = Console()
    console.print(t)
    console.print(
        f"comparison ({r['comparison']}): {r['comparison_note']}", markup=False
    )
    console.print(
        f"{r['num_seqs']} windows of {r['seq_len']} tokens, "
        f"{r['tokens_scored']} tokens scored"
        + ("" if timed else f" (too few to time: under {MIN_TIMED_TOKENS} per side)")
    )
    if "diff_rel" in r:
        console.print(
            f"FlashNorm vs stock perplexity: {r['diff_rel']:+.3e} relative "
            f"({100 * r['diff_rel']:+.2g}%), largest per-token NLL difference "
            f"{r['max_token_nll_diff']:.3e}"
        )
    if r.get("diff_rel_ci95"):
        lo, hi = r["diff_rel_ci95"]
        console.print(
            f"95% interval of the difference (over windows): {100 * lo:+.2f}% to "
            f"{100 * hi:+.2f}%"
        )
