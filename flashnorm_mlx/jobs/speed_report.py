"""What bench reports from its timed rounds: each variant's summary, the named
ratios with their spread, the share of the norm-removed headroom FlashNorm
takes, and the lines under the table (docs/design.md section 4c)."""

from typing import List

from .. import dispatch, kernels
from ..loading.rows import REFERENCE, STOCK
from ..machine import device_info, versions
from ..timing import HOST_NOTE, round_ratios, spread

DECODE_BYTES_NOTE = (
    "bytes of parameters one decode step reads: every linear (packed weights, "
    "scales, biases) and norm gain; the input embedding table only when it is "
    "also the output head (tied), since a step gathers just one row of it; "
    "KV-cache reads are not counted"
)

DISPATCH_NOTE = (
    "dispatches_per_token: kernel-launching primitives in the graph of one "
    "decode step on this build (views such as reshape/transpose counted apart); "
    "dispatches_per_token_gpu_model: the same step with every mx.fast op and "
    "FlashNorm kernel as one launch, as Metal and CUDA run them"
)


def headroom(summary: dict, ratios: dict) -> dict:
    """Share of the stock -> nonorm decode speed-up (same engine) that FlashNorm
    captures; none where nonorm's lead over stock is within the rounds' spread,
    since a share of noise would read as anything (even a negative share)."""
    need = ("stock", "flashnorm", "nonorm")
    if not all(v in summary for v in need):
        return {"share": None, "note": "needs all of stock, flashnorm and nonorm"}
    st, fn, nn_ = (summary[v]["decode_tps"]["median"] for v in need)
    bound = ratios["nonorm_vs_stock"]["decode"]
    gap = nn_ - st
    one = bound.get("rounds", 2) < 2  # one ratio: no spread, any gap looks real
    measurable = gap > 0 and not bound["within_noise"] and not one
    out = dict(stock_tps=st, flashnorm_tps=fn, nonorm_tps=nn_, headroom_tps=gap)
    out["bound_spread"] = [bound["min"], bound["max"]]
    out["share"] = (fn - st) / gap if measurable else None
    if one:
        out["note"] = (
            f"one round ({st:.1f} -> {nn_:.1f} tok/s): no spread to tell the "
            "nonorm lead from noise, so no share (-n 3 or more gives one)"
        )
    elif not measurable and not bound["within_noise"]:
        out["note"] = (
            f"nonorm is slower than stock here ({st:.1f} -> {nn_:.1f} tok/s): no "
            "headroom to share"
        )
    elif not measurable:
        out["note"] = (
            f"nonorm is within noise of stock here ({st:.1f} -> {nn_:.1f} tok/s, "
            f"per-round ratios {bound['min']:.2f}-{bound['max']:.2f}): no "
            "measurable headroom to share"
        )
    return out


def _summarize(info: dict, records: List[dict], variant: str) -> dict:
    rows = [t for t in records if t["variant"] == variant]
    decode = spread([t["decode_tps"] for t in rows])
    trial = spread([t["trial_memory_gb"] for t in rows])
    return {
        **info,
        "prompt_tps": spread([t["prompt_tps"] for t in rows]),
        "decode_tps": decode,
        "peak_memory_gb": spread([t["peak_memory_gb"] for t in rows]),
        "trial_memory_gb": trial,
        # What running this variant alone takes: its parameters plus the most
        # its trials added (the process's peak also holds the other variants).
        "variant_peak_gb": info["weight_bytes"] / 1e9 + trial["max"],
        "effective_gbps": decode["median"] * info["decode_bytes_per_token"] / 1e9,
        "all_trials_finite": all(t["last_logprobs_finite"] for t in rows),
    }


def notes(device: dict, summary: dict, covered: bool = True) -> List[str]:
    """Lines under the table for what would otherwise mislead."""
    notes = []
    dtypes = {s["dtype"] for s in summary.values()}
    if device["backend"] == "cpu" and dtypes & {"float16", "bfloat16"}:
        notes.append(
            "MLX's CPU backend has no fast float16/bfloat16 matmul (6-16x slower "
            "than float32 on SmolLM2 here): pass --dtype float32 for CPU numbers"
        )
    if not dispatch.has_gpu_kernels():
        notes.append(
            "launches/token: on this build mx.fast ops decompose into several plain "
            "ops and FlashNorm kernels run as their plain twins, so the raw counts "
            "are not the GPU's; in parentheses the same step with each mx.fast op "
            "and FlashNorm kernel as one launch, as on Metal and CUDA"
        )
    if not covered and STOCK.name in summary:
        notes.append(
            "mlx-lm and stock are one variant on the eager engine (a family "
            "FlashNorm does not cover runs on it alone): their ratio is the "
            "run-to-run noise"
        )
    elif summary.get("mlx-lm", {}).get("engine") == summary.get("stock", {}).get(
        "engine"
    ):
        notes.append(
            "mlx-lm and stock are one variant on the eager engine: their ratio is "
            "the run-to-run noise (pass --engine compiled to compare the engines)"
        )
    notes += kernels.failures()  # a kernel that fell back to its twin here
    if any(
        not s["logits_finite"] or not s["all_trials_finite"] for s in summary.values()
    ):
        notes.append(
            "a variant produced NaN/inf logits: its timings are not meaningful"
        )
    return notes


# The ratios bench reports by name (section 4c): (key, variant, base).
NAMED_RATIOS = (
    ("flashnorm_vs_mlx_lm", "flashnorm", REFERENCE.name),  # what switching buys
    ("flashnorm_vs_stock", "flashnorm", "stock"),  # what FlashNorm buys
    ("nonorm_vs_stock", "nonorm", "stock"),  # the bound
)


def _ratio(records: List[dict], variant: str, base: str) -> dict:
    return {
        "decode": round_ratios(records, variant, base, "decode_tps"),
        "prompt": round_ratios(records, variant, base, "prompt_tps"),
    }


def _ratios(variants: List[str], records: List[dict]) -> dict:
    """The three named ratios, where both sides ran, and `by_variant`: each
    variant over stock on the same engine (`x_stock`) and over mlx-lm
    (`x_mlx_lm`)."""
    out = {
        key: _ratio(records, v, base)
        for key, v, base in NAMED_RATIOS
        if v in variants and base in variants
    }
    out["by_variant"] = {
        v: {
            name: _ratio(records, v, base)
            for name, base in (("x_stock", "stock"), ("x_mlx_lm", REFERENCE.name))
            if base in variants
        }
        for v in variants
    }
    return out


def report(
    settings: dict, src: dict, info: dict, records: List[dict], covered: bool = True
) -> dict:
    """run_bench's result from what was built (info) and timed (records)."""
    variants = settings["variants"]
    summary = {v: _summarize(info[v], records, v) for v in variants}
    ratios = _ratios(variants, records)
    device = device_info()
    words = {
        "decode_tps": "(G - 1) / time from the first generated token to the G-th",
        "decode_bytes": DECODE_BYTES_NOTE,
        "dispatches": DISPATCH_NOTE,
        "host": HOST_NOTE,
        "ratios": "median of per-round ratios, with their min and max; "
        "within_noise: that spread includes 1.0",
    }
    return {
        "notes": notes(device, summary, covered),
        "settings": {**settings, **words},
        "device": device,
        "versions": versions(),
        "source": {k: v for k, v in src.items() if not k.startswith("comparison")},
        "comparison": src["comparison"],
        "comparison_note": src["comparison_note"],
        "variants": summary,
        "ratios": ratios,
        "headroom": (
            headroom(summary, ratios)
            if "nonorm_vs_stock" in ratios
            else {"share": None, "note": "needs all of stock, flashnorm and nonorm"}
        ),
        "kernel_failures": kernels.failures(),
        "trials": records,
    }
