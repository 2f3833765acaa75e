"""`flashnorm-mlx bench [MODEL]`: mlx-lm, stock, FlashNorm and the norm-removed
bound, the four modes on one engine."""

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import List, Optional

from .flags import VARIANT_NAMES, Parser, add_model_args, run_main
from .mlx_lm_flags import add_adapter_args, add_draft_args


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx bench",
        description="Prompt and decode tokens/sec of mlx-lm as users run it "
        "(stock, eager), then stock, stock_fused, nonorm (the norm-removed upper "
        "bound) and FlashNorm on one engine, so that they differ in the norms "
        "alone: same weights, random prompt tokens and generation loop "
        "(end-of-sequence ignored), trials interleaved.",
    )
    add_model_args(p, mode=False)
    add_adapter_args(p)
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
        default=None,
        help=f"comma-separated subset of {','.join(VARIANT_NAMES)} (default: all; "
        "mlx-lm and stock for a family FlashNorm does not cover)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="a second table: host build and eval ms per step, launches and "
        "parameter MB per token, GB/s, load s, norm modules, logits check",
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
    add_draft_args(p)  # with a draft: FlashNorm alone against it with the draft
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


def _cell(s: dict) -> str:
    """A tok/s median and its rounds' spread as +-% of it."""
    half = 100 * (s["max"] - s["min"]) / 2 / s["median"] if s["median"] else 0.0
    return f"{s['median']:.1f} ±{half:.0f}%"


def _ratio_cell(r) -> str:
    """The median of per-round decode ratios, or "noise" where they fall on
    both sides of 1.0 or come from under 3 rounds (the spread is in the ratio
    lines and the JSON)."""
    if r is None:
        return "-"
    d = r["decode"]
    return "noise" if d["within_noise"] else f"{d['median_of_ratios']:.2f}"


def render(result: dict, console, verbose: bool = False) -> None:
    """The summary as a rich table (a second with --verbose), then the three
    ratios and a few lines under it."""
    console.print(_table(result))
    if verbose:
        console.print(_details(result))
    _print_lines(result, console)


def _table(result: dict):
    """What every run shows, in 100 columns: tok/s, the two decode ratios and
    the peak memory."""
    from rich import box
    from rich.table import Table

    st, device = result["settings"], result["device"]
    on = f", BLAS {device['blas']}" if device.get("backend") == "cpu" else ""
    table = Table(
        title=f"{result['source']['name']}: prompt {st['prompt_tokens']}, "
        f"generate {st['gen_tokens']}, {st['trials']} rounds{on}",
        box=box.SIMPLE_HEAD,
    )
    for col in ("variant", "engine", "prompt tok/s", "decode tok/s"):
        table.add_column(
            col,
            justify="left" if col in ("variant", "engine") else "right",
            no_wrap=True,
        )
    for col in ("x mlx-lm", "x stock", "peak GB"):
        table.add_column(col, justify="right", no_wrap=True)
    by_variant = result["ratios"]["by_variant"]
    for v, s in result["variants"].items():
        r = by_variant.get(v, {})
        ok = s["logits_finite"] and s["all_trials_finite"]
        table.add_row(
            v if ok else f"[red]{v}![/red]",  # NaN/inf: see the note below
            s["engine"],
            _cell(s["prompt_tps"]),
            _cell(s["decode_tps"]),
            _ratio_cell(r.get("x_mlx_lm")),
            _ratio_cell(r.get("x_stock")),
            f"{s['variant_peak_gb']:.3f}",
        )
    return table


def _details(result: dict):
    """--verbose: host time, launches and bytes per decode step, load."""
    from rich import box
    from rich.table import Table

    table = Table(title="per decode step", box=box.SIMPLE_HEAD)
    cols = ("variant", "build ms", "eval ms", "compile ms", "launches")
    cols += ("MB/tok", "GB/s", "load s", "norms", "logits")
    for col in cols:
        left = col == "variant"
        table.add_column(col, justify="left" if left else "right", no_wrap=left)
    for v, s in result["variants"].items():
        launches = str(s["dispatches_per_token"])
        if s["dispatches_per_token_gpu_model"] != s["dispatches_per_token"]:
            launches += f" ({s['dispatches_per_token_gpu_model']})"  # see the note
        ok = s["logits_finite"] and s["all_trials_finite"]
        table.add_row(
            v,
            f"{s['host_build_ms']:.2f}",
            f"{s['eval_ms']:.2f}",
            f"{s['compile_ms']:.0f}",
            launches,
            f"{s['decode_bytes_per_token'] / 1e6:.1f}",
            f"{s['effective_gbps']:.2f}",
            f"{s['build_s']:.1f}",
            str(s["rms_norm_modules"]),
            "finite" if ok else "[red]NaN/inf[/red]",
        )
    return table


# The three ratios apart (docs/design.md section 4c): key, what it answers.
RATIO_LINES = (
    ("flashnorm_vs_mlx_lm", "flashnorm vs mlx-lm (what switching buys)"),
    ("flashnorm_vs_stock", "flashnorm vs stock, same engine (what FlashNorm buys)"),
    ("nonorm_vs_stock", "nonorm vs stock, same engine (the bound)"),
)


def ratio_line(r: dict) -> str:
    """ "1.08x decode (1.05-1.10 over 5 rounds), prompt 1.01x (0.99-1.03)",
    each ratio led by "within noise, " where its per-round ratios fall on both
    sides of 1.0 or come from under 3 rounds (timing.round_ratios)."""
    d, p = r["decode"], r["prompt"]
    return (
        f"{_noise(d)}{d['median_of_ratios']:.2f}x decode ({d['min']:.2f}-"
        f"{d['max']:.2f} over {d['rounds']} round{'s' * (d['rounds'] != 1)}), "
        f"prompt {_noise(p)}{p['median_of_ratios']:.2f}x "
        f"({p['min']:.2f}-{p['max']:.2f})"
    )


def _noise(ratio: dict) -> str:
    return "within noise, " if ratio["within_noise"] else ""


def host_line(result: dict) -> str:
    """The host-time pass in one line (its table is --verbose's): each
    variant's median host build and eval ms per decode step."""
    from ..timing import HOST_STEPS

    parts = [
        f"{v} {s['host_build_ms']:.2f} + {s['eval_ms']:.1f}"
        for v, s in result["variants"].items()
    ]
    steps = min(result["settings"]["gen_tokens"], HOST_STEPS)
    return (
        f"host pass ({steps} decode steps after the rounds), build + eval ms per "
        f"step: {', '.join(parts)}"
    )


def _print_lines(result: dict, console) -> None:
    from rich.markup import escape

    from .. import quant

    st = result["settings"]
    ratios = result["ratios"]
    for key, words in RATIO_LINES:
        if key in ratios:
            console.print(f"{words}: {ratio_line(ratios[key])}")
    console.print(host_line(result), markup=False)
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
    if result["source"].get("float_kquants"):  # the file's, in float: say so
        qtxt = "K-quants partly in float (see comparison)" if q else "K-quants in float"
    console.print(
        f"{same} (checksum {result['source']['checksum'][:12]}), "
        f"{first['dtype']}, {qtxt}, engine {st['engine']}; tok/s = median ±half "
        f"the rounds' range; x = median of per-round decode ratios, noise where "
        f"they fall on both sides of 1.0 or come from under 3 rounds (within "
        f"noise); peak GB = the variant's "
        f"parameters plus the most its trials added; --verbose for host time, "
        f"launches and bytes"
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

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.draft_model:  # speed_draft.py: the model alone against with the draft
        return _draft_main(parser, args)
    # MLX and mlx-lm (seconds) once argparse is content: bench's own checks need them.
    from ..loading import read_source
    from ..parallel import distributed
    from .common import join_launch

    variants = _checked_rows(parser, args)
    join_launch(args, sampling=False)  # mlx.launch with several ranks: tensor parallel
    source = read_source(
        args.model, need_tokenizer=False, adapter_path=args.adapter_path
    )
    result = _run_under_bar(args, source, variants)
    if args.json and distributed.is_main_rank():  # one writer per launch
        write_json(args.json, result)
    out = Console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=100)  # piped or redirected: the table's own width
    render(result, out, args.verbose)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _checked_rows(parser, args) -> Optional[List[str]]:
    """--variants as a list (None: every row the model can run), the flags
    checked before the (slow) read: flashnorm-mlx bench: error:, exit 2."""
    from ..errors import BenchError
    from ..jobs.speed import validate

    variants = None
    if args.variants is not None:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        validate(
            VARIANT_NAMES if variants is None else variants,
            args.prompt_tokens,
            args.generation_tokens,
            args.num_trials,
            args.engine,
        )
    except BenchError as e:
        parser.error(str(e))
    if args.json and not Path(args.json).expanduser().parent.is_dir():
        parser.error(f"--json: no such folder: {Path(args.json).expanduser().parent}")
    return variants


def _run_under_bar(args, source, variants):
    """run_bench with a live bar on a terminal; elsewhere StageLog's lines say
    where it is (a stopped bar would add a blank line, before Ctrl-C's too)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..jobs.speed import run_bench
    from ..parallel import distributed
    from .common import StageLog, model_kwargs

    err = Console(stderr=True)
    columns = (TextColumn("{task.description:<24}"), BarColumn())
    columns += (TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(
        *columns, console=err, transient=True, disable=not err.is_terminal
    ) as bar:
        task = bar.add_task("reading", total=None)
        log, previous = StageLog("bench"), []

        def say(line):  # above the live bar, where there is one
            err.print(
                f"flashnorm-mlx bench: {line}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

        def progress(desc, done, total):
            bar.update(task, description=desc, completed=done, total=total)
            if previous:  # a step is reported once the next one starts
                log(f"{previous[0]}: done, step {done}/{total}")
            previous[:] = [desc]

        return run_bench(
            source,
            variants,
            args.prompt_tokens,
            args.generation_tokens,
            args.num_trials,
            seed=args.seed,
            prefill_step_size=args.prefill_step_size,
            progress=progress,
            on_slow=say if distributed.is_main_rank() else None,
            **model_kwargs(args),
        )


def _draft_main(parser, args) -> int:
    """bench --draft-model: FlashNorm alone, then with the draft (speed_draft.py)."""
    from .. import models
    from ..jobs.speed_draft import check, lines, run_draft_bench
    from ..loading import read_source
    from .common import StageLog, model_kwargs, say_note

    wrong = check(args.num_trials, args.generation_tokens, args.prompt_tokens)
    if wrong:
        parser.error(wrong)
    if args.json and not Path(args.json).expanduser().parent.is_dir():
        parser.error(f"--json: no such folder: {Path(args.json).expanduser().parent}")
    source = read_source(
        args.model, need_tokenizer=False, adapter_path=args.adapter_path
    )
    if not models.is_covered(source.config):  # both run as stock then
        say_note(models.stock_note(source.config))
    log = StageLog("bench")
    result = run_draft_bench(
        source,
        args.draft_model,
        args.prompt_tokens,
        args.generation_tokens,
        args.num_trials,
        num_draft_tokens=args.num_draft_tokens,
        seed=args.seed,
        prefill_step_size=args.prefill_step_size,
        progress=log.step,
        **model_kwargs(args),
    )
    if args.json:
        write_json(args.json, result)
    print("\n".join(lines(result)))
    if args.json:
        print(f"wrote {args.json}")
    return 0
