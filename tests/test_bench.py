"""`bench` and the nonorm bound on tiny random models (small -p/-g/-n, no timing)."""

import json
import re

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten

from flashnorm_mlx import blas, dispatch
from flashnorm_mlx.cli import main
from flashnorm_mlx.jobs import speed, speed_report
from flashnorm_mlx.loading import Source, build_model, nonorm, read_source
from flashnorm_mlx.loading.rows import NAMES
from flashnorm_mlx.modes import NONORM, STOCK
from flashnorm_mlx.timing import time_generation

P, G, N = 8, 4, 2
SUMMARY_KEYS = (
    "class",
    "build_s",
    "source_checksum",
    "rms_norm_modules",
    "dtype",
    "quantization",
    "weight_bytes",
    "decode_bytes_per_token",
    "logits_finite",
    "max_abs_logit",
    "prompt_tps",
    "decode_tps",
    "peak_memory_gb",
    "effective_gbps",
    "all_trials_finite",
    "dispatches_per_token",
    "views_per_token",
    "dispatches_per_token_gpu_model",
    "compiled",
    "engine",
    "mode",
    "host_build_ms",
    "eval_ms",
    "compile_ms",
)
TRIAL_KEYS = (
    "round",
    "position",
    "variant",
    "prompt_s",
    "decode_s",
    "prompt_tps",
    "decode_tps",
    "generated_tokens",
    "peak_memory_gb",
    "trial_memory_gb",
    "last_logprobs_finite",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("bench"), "gqa_untied")


@pytest.fixture(scope="module")
def source(model_dir):
    return read_source(str(model_dir), need_tokenizer=False)


@pytest.fixture(scope="module")
def result(source):
    return speed.run_bench(source, NAMES, P, G, N, engine="compiled")


def _count_rms_norm_ops(model, tokens, monkeypatch) -> int:
    calls = []
    real = mx.fast.rms_norm

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(mx.fast, "rms_norm", counting)
    mx.eval(model(mx.array(tokens)[None]))
    monkeypatch.setattr(mx.fast, "rms_norm", real)
    return len(calls)


# --- the result of one run ---------------------------------------------------


def test_every_trial_and_summary(result):
    trials = result["trials"]
    assert len(trials) == N * len(NAMES), trials
    for t in trials:
        assert all(k in t for k in TRIAL_KEYS), t
        assert t["generated_tokens"] == G, t
        assert t["prompt_tps"] > 0 and t["decode_tps"] > 0, t
    # Rounds interleave all variants, each round starting one variant later.
    for r in range(N):
        order = [t["variant"] for t in trials if t["round"] == r]
        assert sorted(order) == sorted(NAMES) and order[0] == NAMES[r]
    for v, s in result["variants"].items():
        assert all(k in s for k in SUMMARY_KEYS), (v, sorted(s))
        for k in ("median", "min", "max", "q1", "q3"):
            assert k in s["decode_tps"] and k in s["prompt_tps"], s
        assert s["decode_bytes_per_token"] <= s["weight_bytes"], s
    same = {(s["dtype"], str(s["quantization"])) for s in result["variants"].values()}
    assert len(same) == 1, same
    ratios = result["ratios"]
    for key in ("flashnorm_vs_mlx_lm", "flashnorm_vs_stock", "nonorm_vs_stock"):
        for k in ("median_of_ratios", "min", "max", "within_noise", "rounds"):
            assert k in ratios[key]["decode"] and k in ratios[key]["prompt"], ratios
        r = ratios[key]["decode"]
        assert r["min"] <= r["median_of_ratios"] <= r["max"] and r["rounds"] == N, r
    fn, st = (
        result["variants"][v]["decode_tps"]["median"] for v in ("flashnorm", "stock")
    )
    assert (
        abs(ratios["flashnorm_vs_stock"]["decode"]["ratio_of_medians"] - fn / st) < 1e-9
    )
    by = ratios["by_variant"]
    assert by["flashnorm"]["x_stock"] == ratios["flashnorm_vs_stock"], by
    assert by["flashnorm"]["x_mlx_lm"] == ratios["flashnorm_vs_mlx_lm"], by
    h = result["headroom"]
    assert {"stock_tps", "flashnorm_tps", "nonorm_tps", "share"} <= set(h), h
    assert result["device"]["name"] and result["device"]["backend"], result["device"]
    assert result["versions"]["mlx"] == mx.__version__, result["versions"]


def test_host_time_per_step_and_which_variants_ran_compiled(result):
    """Build and eval per decode step for every variant; with --engine compiled
    the four norm handlings ran the compiled step, mlx-lm eager (its reference)."""
    variants = result["variants"]
    for v, s in variants.items():
        assert s["host_build_ms"] > 0 and s["eval_ms"] > 0, (v, s)
        assert s["compile_ms"] >= 0, (v, s)
    engines = {v: (s["engine"], s["compiled"]) for v, s in variants.items()}
    assert engines == {
        "mlx-lm": ("eager", False),
        "stock": ("compiled", True),
        "stock_fused": ("compiled", True),
        "nonorm": ("compiled", True),
        "flashnorm": ("compiled", True),
    }, engines
    assert result["settings"]["engine"] == "compiled", result["settings"]
    # Each compiled class's first steps: an eager step and a trace, seconds here.
    for v in ("stock", "flashnorm"):
        assert variants[v]["compile_ms"] > 0, (v, variants[v])


def test_the_eager_engine_runs_every_variant_uncompiled(source):
    r = speed.run_bench(
        source, ["mlx-lm", "stock", "flashnorm"], P, G, 1, engine="eager"
    )
    assert not any(s["compiled"] for s in r["variants"].values()), r["variants"]
    assert {s["engine"] for s in r["variants"].values()} == {"eager"}
    assert r["settings"]["engine"] == "eager"
    assert any("their ratio is the run-to-run noise" in n for n in r["notes"]), r[
        "notes"
    ]
    assert "nonorm_vs_stock" not in r["ratios"] and r["headroom"]["share"] is None


def _summary(stock, flashnorm, nonorm):
    """decode medians as _summarize gives them."""
    return {
        v: {"decode_tps": {"median": m}}
        for v, m in (("stock", stock), ("flashnorm", flashnorm), ("nonorm", nonorm))
    }


def _bound(per_round):
    """ratios["nonorm_vs_stock"] from per-round decode ratios."""
    return {
        "nonorm_vs_stock": {
            "decode": {
                "min": min(per_round),
                "max": max(per_round),
                "within_noise": min(per_round) <= 1.0 <= max(per_round),
            }
        }
    }


def test_a_kernel_that_fell_back_is_in_the_notes_and_json(result, monkeypatch):
    from flashnorm_mlx.kernels import _common

    assert result["kernel_failures"] == [], result["kernel_failures"]
    line = "the residual kernel failed its first-use check on cuda (boom); ..."
    monkeypatch.setattr(_common, "FAILED", {("residual", "cuda"): line})
    assert line in speed_report.notes(result["device"], result["variants"])


def test_headroom_share_only_outside_the_noise():
    """A share of a gap the rounds' spread includes is a percentage of noise
    (this CPU once printed -221%): none is given, and the note says why."""
    h = speed_report.headroom(_summary(10.0, 11.0, 12.0), _bound([1.15, 1.2, 1.25]))
    assert h["share"] == 0.5 and "note" not in h, h
    h = speed_report.headroom(_summary(10.60, 10.0, 10.61), _bound([0.97, 1.0, 1.04]))
    assert h["share"] is None and "within noise" in h["note"], h
    h = speed_report.headroom(_summary(10.0, 10.0, 9.0), _bound([0.85, 0.9, 0.95]))
    assert h["share"] is None and "slower than stock" in h["note"], h


def test_one_round_gives_no_headroom_share():
    """bench -n 1: one ratio has no spread, so a gap of any size reads as real
    (it once printed "FlashNorm captures -84% of the headroom"): no share, and
    the note says why."""
    bound = _bound([1.3])
    bound["nonorm_vs_stock"]["decode"]["rounds"] = 1
    h = speed_report.headroom(_summary(10.0, 8.0, 13.0), bound)
    assert h["share"] is None and "one round" in h["note"], h
    bound["nonorm_vs_stock"]["decode"]["rounds"] = 3  # the same numbers, 3 rounds
    assert speed_report.headroom(_summary(10.0, 8.0, 13.0), bound)["share"] < 0


def test_launches_per_token_reported_and_flashnorm_fewest_on_a_gpu(result):
    """bench's launch counts (tests/test_dispatch.py checks the counter itself)."""
    v = result["variants"]
    gpu = {name: v[name]["dispatches_per_token_gpu_model"] for name in v}
    assert gpu["flashnorm"] < gpu["nonorm"] < gpu["stock"], gpu
    for name, s in v.items():
        assert s["dispatches_per_token"] >= s["dispatches_per_token_gpu_model"], name
        assert s["views_per_token"] > 0, name
    cpu_note = [n for n in result["notes"] if "mx.fast ops decompose" in n]
    assert len(cpu_note) == (0 if dispatch.has_gpu_kernels() else 1), result["notes"]


def test_variants_ran_on_the_same_weights(result, source):
    sums = {v: s["source_checksum"] for v, s in result["variants"].items()}
    assert set(sums.values()) == {result["source"]["checksum"]}, sums
    # The checksum does see a change of one element.
    w = dict(source.weights)
    k = "model.layers.1.mlp.down_proj.weight"
    w[k] = mx.concatenate([w[k][:1] + 1e-3, w[k][1:]])
    assert speed.weights_checksum(w) != result["source"]["checksum"]


def test_stock_is_mlx_lm_class(result):
    cls = {v: s["class"] for v, s in result["variants"].items()}
    assert cls["stock"].startswith("mlx_lm.models."), cls
    assert cls["nonorm"].startswith("mlx_lm.models."), cls  # stock, norms removed
    assert cls["flashnorm"].startswith("flashnorm_mlx.models."), cls


def test_nonorm_logits_finite_and_no_norms(result):
    s = result["variants"]["nonorm"]
    assert s["logits_finite"] and s["all_trials_finite"], s
    assert s["rms_norm_modules"] == 0, s
    assert result["variants"]["stock"]["rms_norm_modules"] == 5, result["variants"]


def test_decode_bytes_count_the_head_not_the_gathered_table(result, source):
    embed = source.weights["model.embed_tokens.weight"].nbytes
    s = result["variants"]["stock"]
    assert s["weight_bytes"] - s["decode_bytes_per_token"] == embed, s


# --- nonorm ------------------------------------------------------------------


def test_nonorm_is_stock_with_zero_norm_ops(source, monkeypatch):
    from mlx_lm.models.llama import Model

    stock, _ = build_model(source, STOCK)
    model, config = build_model(source, NONORM)
    assert type(model) is Model
    assert nonorm.rms_norm_paths(model) == []
    assert not any("norm" in k for k in dict(tree_flatten(model.parameters())))
    tokens = list(range(1, 13))
    n_stock = _count_rms_norm_ops(stock, tokens, monkeypatch)
    n_nonorm = _count_rms_norm_ops(model, tokens, monkeypatch)
    assert (n_stock, n_nonorm) == (5, 0), (n_stock, n_nonorm)
    assert config["nonorm"]["calibrated_norms"] == 5


def _residuals_scaled(src: Source, scale: float) -> Source:
    """Embedding and every residual branch x scale: stock barely changes (RMSNorm)."""
    w = dict(src.weights)
    for k in list(w):
        if k.endswith(("embed_tokens.weight", "o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * scale
    return Source(f"{src.name} x{scale}", src.config, w)


# float16 tops out at 65504: with x1000 stock's own residual reaches ~25000 there.
@pytest.mark.parametrize(
    "dtype, scale", [(mx.float32, 1000.0), (mx.bfloat16, 1000.0), (mx.float16, 100.0)]
)
def test_nonorm_finite_with_residuals_scaled(source, dtype, scale):
    big = _residuals_scaled(source, scale)
    tokens = mx.array([list(range(3, 40))])
    stock, _ = build_model(big, STOCK, dtype=dtype)
    ref = stock(tokens).astype(mx.float32)
    assert mx.isfinite(ref).all().item()

    # Norms removed without the calibration constants: inf in fp16, huge otherwise.
    naive, _ = build_model(big, STOCK, dtype=dtype)
    nonorm.strip_norms(naive)
    out_naive = naive(tokens).astype(mx.float32)
    peak_naive = mx.abs(out_naive).max().item()
    assert not mx.isfinite(out_naive).all().item() or peak_naive > 1e6, peak_naive

    model, _ = build_model(big, NONORM, dtype=dtype)
    out = model(tokens).astype(mx.float32)
    peak, peak_ref = mx.abs(out).max().item(), mx.abs(ref).max().item()
    assert mx.isfinite(out).all().item() and peak < 10 * peak_ref, (peak, peak_ref)


def _quantized_source(src: Source) -> Source:
    """`src` stored pre-quantized (weight, scales, biases), as a 4-bit checkpoint is."""
    return tiny.quantized(src)


def test_nonorm_from_a_quantized_source(source):
    qsrc = _quantized_source(source)
    tokens = mx.array([list(range(5, 25))])
    for dequantize in (False, True):
        how = "dequantize" if dequantize else "stored"
        model, config = build_model(qsrc, NONORM, quantized_way=how)
        stock, _ = build_model(qsrc, STOCK, quantized_way=how)
        qlayers = {
            type(model.model.layers[0].self_attn.q_proj).__name__,
            type(stock.model.layers[0].self_attn.q_proj).__name__,
        }
        assert qlayers == ({"Linear"} if dequantize else {"QuantizedLinear"}), qlayers
        if not dequantize:
            assert config["quantization"]["bits"] == 4, config["quantization"]
            assert model.lm_head.group_size == stock.lm_head.group_size == 32
        assert mx.isfinite(model(tokens)).all().item()
        assert nonorm.rms_norm_paths(model) == []
        assert speed.model_dtype(model) == speed.model_dtype(stock)


def test_nonorm_unties_a_tied_head(tmp_path):
    src = read_source(
        str(tiny.make_llama(tmp_path, "mha_tied", tokenizer=False)),
        need_tokenizer=False,
    )
    model, config = build_model(src, NONORM, quantize=(4, 32))
    assert config["tie_word_embeddings"] is False and "lm_head" in model, config
    assert type(model.lm_head).__name__ == "QuantizedLinear"
    assert nonorm.rms_norm_paths(model) == []
    assert mx.isfinite(model(mx.array([[1, 2, 3, 4]]))).all().item()


def test_fold_constants_is_pure(source):
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    w = stock.sanitize(dict(source.weights))
    before = {k: v for k, v in w.items()}
    cfg_before = json.dumps(source.config, sort_keys=True)
    sites = nonorm.norm_sites(stock, source.config, w)
    rms = {s.norm: 2.0 for s in sites}
    out, cfg = nonorm.fold_constants(w, source.config, sites, rms)
    assert all(w[k] is before[k] for k in before) and set(w) == set(before)
    assert json.dumps(source.config, sort_keys=True) == cfg_before
    assert not any(
        k.endswith("layernorm.weight") or k == "model.norm.weight" for k in out
    )
    # c = gain / rms on the input columns of the linears the norm feeds.
    k, g = (
        "model.layers.0.self_attn.q_proj.weight",
        w["model.layers.0.input_layernorm.weight"],
    )
    expect = w[k] * (g / 2.0)[None, :]
    assert mx.allclose(out[k], expect, rtol=1e-6, atol=1e-7).item()


# --- generation loop ---------------------------------------------------------


def test_exactly_g_tokens_even_when_eos_is_sampled(model_dir, source):
    from mlx_lm.utils import load_tokenizer

    eos = next(iter(load_tokenizer(model_dir).eos_token_ids))
    model, _ = build_model(source, STOCK)
    prompt = mx.array(speed.prompt_ids(source.config, P, 0))
    t = time_generation(model, prompt, 7, sampler=lambda lp: mx.array([eos]))
    assert t["generated_tokens"] == 7 and t["tokens"] == [eos] * 7, t


# --- CLI ---------------------------------------------------------------------


def test_cli_end_to_end_json(model_dir, tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = [
        "bench",
        str(model_dir),
        "-p",
        str(P),
        "-g",
        str(G),
        "-n",
        "2",
        "--variants",
        "stock,nonorm",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "nonorm" in out and "device:" in out, out
    assert "build ms" not in out, out  # --verbose's
    r = json.loads(path.read_text())
    assert r["device"]["blas"] == blas.name(), r["device"]
    if r["device"]["backend"] == "cpu":  # the header names the BLAS it ran on
        assert f"BLAS {blas.name()}" in out, out
    assert [t["variant"] for t in r["trials"]] == ["stock", "nonorm", "nonorm", "stock"]
    assert (
        set(r["variants"]) == {"stock", "nonorm"} and "nonorm_vs_stock" in r["ratios"]
    )
    assert r["settings"]["prompt_tokens"] == P and r["settings"]["gen_tokens"] == G
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temp file left


@pytest.mark.parametrize(
    "flags, engine",
    [
        (["--engine", "compiled"], "compiled"),
        (["--engine", "eager"], "eager"),
        (["--compile"], "compiled"),  # the aliases, kept for one release
        (["--no-compile"], "eager"),
    ],
)
def test_cli_engine_and_verbose_table(model_dir, capsys, monkeypatch, flags, engine):
    argv = ["bench", str(model_dir), "-p", str(P), "-g", str(G), "-n", "1"]
    monkeypatch.setenv("COLUMNS", "100")
    assert (
        main([*argv, "--variants", "mlx-lm,stock,flashnorm", "--verbose", *flags]) == 0
    )
    out = capsys.readouterr().out
    assert "build ms" in out and "eval ms" in out and "launches" in out, out
    rows = {}  # the first table's rows: variant -> engine
    for cells in (line.split() for line in out.splitlines()):
        if cells[:1] in (["mlx-lm"], ["stock"], ["flashnorm"]) and len(cells) > 4:
            rows.setdefault(cells[0], cells[1])
    assert rows == {"mlx-lm": "eager", "stock": engine, "flashnorm": engine}, out
    # -n 1: no ratio without "within noise" (one round has no spread).
    ratios = [line for line in out.splitlines() if re.search(r"\d\.\d+x", line)]
    assert ratios and all("within noise" in line for line in ratios), out
    cells = [line.split() for line in out.splitlines()[:8]]
    assert any(c[:1] == ["flashnorm"] and "noise" in c for c in cells), out


def test_under_three_rounds_or_a_spread_over_one_is_within_noise():
    """timing.round_ratios: 2 rounds both 1.5x are no verdict; 3 rounds all
    over 1 are one; 3 rounds on both sides of 1 are not."""
    from flashnorm_mlx.timing import round_ratios

    def trials(pairs):
        return [
            {"round": i, "variant": v, "x": x}
            for i, (a, b) in enumerate(pairs)
            for v, x in (("a", a), ("b", b))
        ]

    assert round_ratios(trials([(3, 2)] * 2), "a", "b", "x")["within_noise"]
    assert not round_ratios(trials([(3, 2)] * 3), "a", "b", "x")["within_noise"]
    spread = [(3, 2), (2, 3), (3, 2)]
    assert round_ratios(trials(spread), "a", "b", "x")["within_noise"]


def test_cli_default_table_fits_100_columns(result, monkeypatch):
    """No cell of the default table is cut at COLUMNS=100 (rich marks a cut
    cell with an ellipsis) and no line is wider."""
    from rich.console import Console

    from flashnorm_mlx.cli.bench import _table

    console = Console(width=100, record=True, file=open("/dev/null", "w"))
    console.print(_table(result))
    text = console.export_text()
    print(text)
    assert "…" not in text and max(map(len, text.splitlines())) <= 100, text
    for v in NAMES:
        assert any(line.split()[:1] == [v] for line in text.splitlines()), (v, text)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["-n", "0"], "at least 1"),
        (["--variants", "stock,bogus"], "unknown variant 'bogus'"),
        (["-g", "1"], "at least 2"),
        (["--json", "/no/such/dir/x.json"], "no such folder"),
        (["--engine", "jit"], "invalid choice: 'jit'"),
        (["--variants", "stock_compiled"], "unknown variant 'stock_compiled'"),
    ],
)
def test_cli_bad_flags_one_line(model_dir, flags, message, capsys):
    rc = main(["bench", str(model_dir), *flags])
    err = capsys.readouterr().err
    assert rc != 0 and len(err.strip().splitlines()) == 1 and message in err, (rc, err)


# --- OpenELM -----------------------------------------------------------------


def test_openelm_variants(tmp_path):
    src = read_source(str(tiny.make_openelm(tmp_path, "shared")), need_tokenizer=False)
    variants = ["stock", "flashnorm", "nonorm"]
    r = speed.run_bench(src, variants, P, G, 1)
    v = r["variants"]
    assert v["stock"]["class"] == "mlx_lm.models.openelm.Model", v["stock"]
    # 3 layers x (attn, ffn, q, k) + final = 13 norms, all removed (QK-norms too).
    assert v["stock"]["rms_norm_modules"] == 13 and v["nonorm"]["rms_norm_modules"] == 0
    assert v["nonorm"]["logits_finite"] and v["nonorm"]["all_trials_finite"], v[
        "nonorm"
    ]
    assert len({s["source_checksum"] for s in v.values()}) == 1
    assert v["flashnorm"]["class"] == "flashnorm_mlx.models.openelm.Model", v[
        "flashnorm"
    ]
    assert v["flashnorm"]["logits_finite"], v["flashnorm"]


def test_the_estimate_prices_every_pass_left():
    """Issue 60 item 2: after the first variant's warm-up (6 s: first steps,
    a 4.1 s generation, the logits check), 4 variants and 1 round leave 3
    warm-ups (18 s), 4 timed generations (16.4 s) and 4 host-time passes
    (a 1 s prompt and 32 steps at 10 tok/s: 16.8 s): 51 s, where counting
    generations alone said 29 s."""
    from flashnorm_mlx.timing import passes_left

    warm = {"prompt_s": 1.0, "decode_s": 3.1, "decode_tps": 10.0}
    left = passes_left(4, 1, 32, warm, 4.1, 6.0)
    print(f"{left:.2f} s left")
    assert left == pytest.approx(18 + 16.4 + 16.8), left


def test_the_host_pass_is_one_line_without_verbose(result):
    """Issue 60 item 2: the host-time pass (seconds of the run) is shown
    without --verbose, one line (wrapped at 100 columns), every variant."""
    from rich.console import Console

    from flashnorm_mlx.cli.bench import host_line, render

    line = host_line(result)
    assert "\n" not in line and line.count("host pass (") == 1, line
    for v, s in result["variants"].items():
        assert f"{v} {s['host_build_ms']:.2f} + {s['eval_ms']:.1f}" in line, line
    console = Console(width=100, record=True, file=open("/dev/null", "w"))
    render(result, console, verbose=False)
    text = " ".join(console.export_text().split())
    print(text)
    assert " ".join(line.split()) in text, (line, text)
    assert "per decode step " not in text.replace(line, "")  # --verbose's table
