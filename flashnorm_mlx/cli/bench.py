"""`flashnorm-mlx bench [MODEL]`: stock vs FlashNorm vs the norm-removed bound."""

import argparse
import json
import os
import tempfile
from pathlib import Path

from .. import quant
from ..bench import run_bench, validate
from ..errors import BenchError
from ..loading import MODES, read_source
from ..parallel import distributed
from .common import (
    Parser,
    StageLog,
    add_model_args,
    join_launch,
    model_kwargs,
    run_main,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx bench",
        description="Prompt and decode tokens/sec of stock mlx-lm, FlashNorm and "
        "the norm-removed upper bound, on the same weights, random prompt tokens "
        "and generation loop (end-of-sequence ignored), trials interleaved.",
    )
    add_model_args(p, mode=False)
    p.add_argument(
        "-p",
        "--prompt-tokens",
        type=int,
        default=256,
        help="prompt length (random ids)",
    )
    p.add_argument(
        "-g", "--generation-tokens", type=int, default=128, help="tokens to generate"
    )
    p.add_argument("-n", "--num-trials", type=int, default=5, help="timed rounds")
    p.add_argument(
        "--variants",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens")
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="prompt tokens per forward while prefilling (mlx-lm's setting)",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="write every trial here"
    )
    return p


def write_json(path: str, result: dict) -> None:
    """Write a temporary file in the same folder, then rename: never half-written."""
    target = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def _cell(s: dict, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def render(result: dict, console) -> None:
    """The summary as a rich table plus a few lines under it."""
    console.print(_table(result))
    _print_lines(result, console)


def _table(result: dict):
    from rich.table import Table

    st = result["settings"]
    table = Table(
        title=f"{result['source']['name']}: prompt {st['prompt_tokens']}, "
        f"generate {st['gen_tokens']}, {st['trials']} rounds: median (min-max)"
    )
    for col in (
        "variant",
        "prompt tok/s",
        "decode tok/s",
        "decode x stock",
        "prompt x stock",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    cols = ("build ms", "eval ms", "launches/tok", "MB/tok", "peak GB", "GB/s")
    cols += ("load s", "norms", "logits")
    for col in cols:
        table.add_column(col, justify="right")
    for v, s in result["variants"].items():
        r = result["ratios"].get(v)
        ok = s["logits_finite"] and s["all_trials_finite"]
        launches = str(s["dispatches_per_token"])
        if s["dispatches_per_token_gpu_model"] != s["dispatches_per_token"]:
            launches += f" ({s['dispatches_per_token_gpu_model']})"  # see the note
        table.add_row(
            v + ("*" if s["compiled"] else ""),  # the compiled-step note says why
            _cell(s["prompt_tps"]),
            _cell(s["decode_tps"]),
            f"{r['decode']['median_of_ratios']:.3f}" if r else "1.000",
            f"{r['prompt']['median_of_ratios']:.3f}" if r else "1.000",
            f"{s['host_build_ms']:.2f}",
            f"{s['eval_ms']:.2f}",
            launches,
            f"{s['decode_bytes_per_token'] / 1e6:.1f}",
            f"{s['variant_peak_gb']:.3f}",
            f"{s['effective_gbps']:.2f}",
            f"{s['build_s']:.1f}",
            str(s["rms_norm_modules"]),
            "finite" if ok else "[red]NaN/inf[/red]",  # see the note below
        )
    return table


def _print_lines(result: dict, console) -> None:
    from rich.markup import escape

    st = result["settings"]
    h = result["headroom"]
    if h.get("share") is not None:
        console.print(
            f"FlashNorm captures {100 * h['share']:.0f}% of the stock -> nonorm decode "
            f"headroom ({h['stock_tps']:.1f} -> {h['nonorm_tps']:.1f} tok/s)"
        )
    elif "note" in h:
        console.print(f"headroom: {h['note']}")
    sums = {s["source_checksum"] for s in result["variants"].values()}
    same = (
        "same weights"
        if sums == {result["source"]["checksum"]}
        else "[red]WEIGHTS DIFFER[/red]"
    )
    first = next(iter(result["variants"].values()))
    q = first["quantization"]
    qtxt = quant.describe({"quantization": q}) if q else "unquantized"
    console.print(
        f"{same} (checksum {result['source']['checksum'][:12]}), "
        f"{first['dtype']}, {qtxt}; "
        f"x stock = median of per-round ratios; MB/tok = parameter bytes one "
        f"decode step reads (embedding table counted only when tied); peak GB = "
        f"the variant's parameters plus the most its trials added; GB/s = "
        f"decode tok/s x MB/tok; build ms / eval ms = host time to build one "
        f"decode step's graph / MLX encoding and running it (medians of a "
        f"synchronous pass after the rounds)"
    )
    console.print(
        f"comparison ({result['comparison']}): {escape(result['comparison_note'])}"
    )
    d, ver = result["device"], result["versions"]
    parallel = st.get("parallel")
    console.print(
        f"device: {d['name']}{f', {parallel}' if parallel else ''}; "
        f"mlx {ver['mlx']}, mlx-lm {ver['mlx_lm']}"
    )
    for note in result["notes"]:
        console.print(f"[yellow]note: {escape(note)}[/yellow]")


@run_main
def main(argv=None):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    # Flags checked before the (slow) read: flashnorm-mlx bench: error:, exit 2.
    try:
        validate(variants, args.prompt_tokens, args.generation_tokens, args.num_trials)
    except BenchError as e:
        parser.error(str(e))
    if args.json and not Path(args.json).expanduser().parent.is_dir():
        parser.error(f"--json: no such folder: {Path(args.json).expanduser().parent}")
    join_launch(args, sampling=False)  # mlx.launch with several ranks: tensor parallel
    source = read_source(args.model, need_tokenizer=False)

    err = Console(stderr=True)
    with Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("reading", total=None)

        log, previous = StageLog("bench"), []

        def progress(desc, done, total):
            bar.update(task, description=desc, completed=done, total=total)
            if previous:  # a step is reported once the next one starts
                log(f"{previous[0]}: done, step {done}/{total}")
            previous[:] = [desc]

        result = run_bench(
            source,
            variants,
            args.prompt_tokens,
            args.generation_tokens,
            args.num_trials,
            seed=args.seed,
            prefill_step_size=args.prefill_step_size,
            progress=progress,
            **model_kwargs(args),
        )
    if args.json and distributed.is_main_rank():  # one writer per launch
        write_json(args.json, result)
    out = Console()
    if not out.is_terminal:  # piped or redirected: don't wrap the table at 80
        out = Console(width=160)
    render(result, out)
    if args.json:
        print(f"wrote {args.json}")
    return 0
