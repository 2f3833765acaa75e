"""`flashnorm-mlx verify [MODEL]`: FlashNorm vs stock mlx-lm on the same weights."""

import argparse
import json

from .flags import Parser, UserError, add_model_args, run_main
from .mlx_lm_flags import add_adapter_args


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="flashnorm-mlx verify",
        description="Run stock mlx-lm and FlashNorm on the same weights and tokens; "
        "report logit differences, KL divergence and greedy agreement.",
    )
    add_model_args(p, mode=False)
    add_adapter_args(p)
    p.add_argument(
        "-p", "--prompt", default=None, help="prompt text (default: a fixed sentence)"
    )
    p.add_argument(
        "-g", "--horizon", type=int, default=32, help="greedy decode steps compared"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


@run_main
def main(argv=None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.prompt is not None and not args.prompt.strip():
        parser.error("-p/--prompt is empty (leave -p out for the fixed sentence)")
    # MLX and mlx-lm (seconds) once the flags are good.
    from .. import models
    from ..jobs.equivalence import compare, prompt_tokens
    from ..loading import read_source
    from ..loading.adapters import adapter_comparison
    from ..loading.rows import comparison
    from .common import StageLog, model_kwargs

    source = read_source(args.model, tokenizer=args.tokenizer)
    if not models.is_covered(source.config):  # stock is the reference itself
        _say_nothing_to_compare(source, comparison(source), args.json)
        return 0
    tokens = prompt_tokens(source, args.prompt)
    if not tokens:
        raise UserError("the prompt encodes to no tokens")
    kw = model_kwargs(args)
    how = comparison(source, kw["quantize"], kw["quantized_way"])
    if args.adapter_path is not None:  # the reference is mlx-lm's adapted model
        how = adapter_comparison(source, how)
    # verify has no live bar: its stage lines show on a terminal too.
    r = compare(
        source,
        tokens,
        horizon=args.horizon,
        on_stage=StageLog("verify", True),
        adapter=args.adapter_path,
        **kw,
    )
    r.update(how)
    if args.json:
        print(json.dumps(r))
    else:
        _print_report(r)
    return 0 if r["passed"] else 1


def _say_nothing_to_compare(source, how: dict, as_json: bool) -> None:
    """A model FlashNorm does not cover: stock is the reference itself."""
    if as_json:
        mt = source.config.get("model_type")
        print(json.dumps({"model": source.name, "model_type": mt, **how}))
    else:  # one line: what verify would compare is one model
        print(
            f"nothing to compare: FlashNorm does not cover model_type "
            f"{source.config.get('model_type')!r} yet, so flashnorm-mlx runs "
            "it as stock, mlx-lm's own class: the very reference verify "
            "compares FlashNorm with"
        )


def _print_report(r: dict) -> None:
    """compare's result as a table, the comparison, and the verdict last."""
    from rich.console import Console
    from rich.table import Table

    adapted = f", adapter {r['adapter']}" if "adapter" in r else ""
    t = Table(title=f"FlashNorm vs stock mlx-lm: {r['model']} ({r['dtype']}{adapted})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("prompt tokens", str(r["prompt_tokens"]))
    t.add_row("max |logit diff|", f"{r['max_abs_logit_diff']:.3e}")
    t.add_row("max |logit diff| / max |logit|", f"{r['max_rel_logit_diff']:.3e}")
    t.add_row("KL(stock || flashnorm) mean", f"{r['kl']:.3e}")
    t.add_row("KL max", f"{r['kl_max']:.3e}")
    t.add_row("greedy tokens agreeing", f"{r['greedy_match']} / {r['greedy_horizon']}")
    t.add_row(
        "finite logits (stock, flashnorm)",
        f"{r['stock_finite']}, {r['flashnorm_finite']}",
    )
    if "reference" in r:
        t.add_row(
            "vs stock float32: FlashNorm, stock",
            f"{r['reference_flashnorm_rel_diff']:.3e}, "
            f"{r['reference_stock_rel_diff']:.3e}",
        )
    console = Console()
    console.print(t)
    console.print(
        f"comparison ({r['comparison']}): {r['comparison_note']}", markup=False
    )
    if "reference" in r:
        within = r["flashnorm_within_stock_error"]
        ratio = r["reference_flashnorm_rel_diff"] / max(
            r["reference_stock_rel_diff"], 1e-30
        )
        console.print(
            f"against {r['reference']} (max |logit diff| / max |logit|): "
            + (
                "FlashNorm's error is within stock's own"
                if within
                else f"FlashNorm's error is {ratio:.2f}x stock's own"
            ),
            markup=False,
        )
    console.print(r["verdict"], markup=False)  # the last line: PASS or FAIL
