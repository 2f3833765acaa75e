"""Perplexity: stock and FlashNorm agree in float32; the NLL matches mlx-lm's own."""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny

from flashnorm_mlx.cli import main
from flashnorm_mlx.jobs.likelihood import default_text, perplexity, windows
from flashnorm_mlx.loading import LoadError, build_model, read_source
from flashnorm_mlx.modes import STOCK


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("m"), "gqa_untied")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(default_text()[:6000])
    return path


def test_stock_and_flashnorm_agree_in_float32(model_dir, data_file):
    source = read_source(str(model_dir))
    r = perplexity(
        source, text=data_file.read_text(), seq_len=48, num_seqs=6, dtype=mx.float32
    )
    assert r["num_seqs"] == 6 and r["tokens_scored"] == 6 * 47, r
    assert abs(r["diff_rel"]) < tiny.f32_tol(), r
    assert r["max_token_nll_diff"] < 1e-3, r
    # Independent reference: mlx-lm's own perplexity loop on the stock model.
    from mlx_lm.perplexity import eval_ppl

    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    data = windows(source.tokenizer.encode(data_file.read_text()), 48, 6)
    ppl_mlx_lm, _ = eval_ppl(stock, data, batch_size=4)
    for mode in ("stock", "flashnorm"):
        rel = abs(r[mode] - ppl_mlx_lm) / ppl_mlx_lm
        assert rel < tiny.f32_tol(), (mode, r[mode], ppl_mlx_lm)


def test_windows_are_spread_and_disjoint():
    data = np.array(windows(list(range(1000)), 50, 4))
    assert data.shape == (4, 50), data.shape
    assert data[:, 0].tolist() == [0, 300, 650, 950], data[:, 0]
    assert np.array(windows(list(range(1000)), 50, None)).shape == (20, 50)
    with pytest.raises(LoadError, match="fewer than one window"):
        windows(list(range(10)), 50, 4)


def test_default_text_is_substantial_english():
    text = default_text()
    words = text.lower().split()
    counts = {w: words.count(w) for w in ("the", "of", "and", "is")}
    letters = sum(c.isalpha() for c in text) / len(text)
    assert len(text) > 200_000 and len(words) > 30_000, (len(text), len(words))
    assert all(c > 500 for c in counts.values()) and letters > 0.6, (counts, letters)


def test_cli_end_to_end(model_dir, data_file, capsys):
    args = ["perplexity", str(model_dir), "--data", str(data_file), "--seq-len", "32"]
    assert main([*args, "--num-seqs", "3", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "stock" in out and "flashnorm" in out and "FlashNorm vs stock" in out, out
    assert main([*args, "--num-seqs", "2", "--mode", "flashnorm", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "flashnorm" in r and "stock" not in r and "diff_rel" not in r, r
    assert r["num_seqs"] == 2 and np.isfinite(r["flashnorm"]), r


def test_cli_quantized_both_from_same_settings(model_dir, data_file, capsys):
    args = ["perplexity", str(model_dir), "--data", str(data_file), "--seq-len", "32"]
    assert main([*args, "--num-seqs", "2", "-q", "--q-group-size", "32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["quantization"] == "4-bit group 32", r
    assert np.isfinite(r["stock"]) and np.isfinite(r["flashnorm"]), r


def test_cli_bad_data_file_is_one_line(model_dir, tmp_path, capsys):
    rc = main(["perplexity", str(model_dir), "--data", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no such data file" in err[0], (rc, err)
    assert err[0].startswith("flashnorm-mlx perplexity: error: --data:"), err


def test_quant_table_rows_are_perplexity_keywords():
    """scripts/quant-table.py's rows (each 10-25 minutes, not run here) call
    perplexity() with keywords it has and values it accepts."""
    import importlib.util
    import inspect
    from pathlib import Path

    from flashnorm_mlx import quant
    from flashnorm_mlx.jobs.likelihood import perplexity

    path = Path(__file__).parent.parent / "scripts" / "quant-table.py"
    spec = importlib.util.spec_from_file_location("quant_table", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    params = inspect.signature(perplexity).parameters
    for label, kw in table.PLAN.items():
        assert set(kw) | set(table.EVAL) <= set(params), (label, kw)
        assert kw.get("quantized_way", "stored") in quant.QUANTIZED_WAYS, (label, kw)


def test_both_sides_are_timed_warm(model_dir, data_file, monkeypatch):
    """Each model runs a short warm-up forward pass before its timed windows,
    so the first side does not pay MLX's first-call costs alone."""
    import flashnorm_mlx.jobs.likelihood as P

    calls = []
    real_nll, real_timed = P.token_nll, P._model_nll
    monkeypatch.setattr(
        P, "token_nll", lambda m, b: calls.append(("call", b.shape)) or real_nll(m, b)
    )

    def timed(model, *a, **k):
        calls.append(("timed", None))
        return real_timed(model, *a, **k)

    monkeypatch.setattr(P, "_model_nll", timed)
    source = read_source(str(model_dir))
    r = perplexity(source, text=data_file.read_text(), seq_len=64, num_seqs=4)
    timed_at = [i for i, (what, _) in enumerate(calls) if what == "timed"]
    assert len(timed_at) == 2, calls
    for i in timed_at:  # a short forward pass right before the timing starts
        assert i > 0 and calls[i - 1] == ("call", (1, P.WARMUP_TOKENS)), calls
    assert r["stock_tokens_per_sec"] > 0 and r["flashnorm_tokens_per_sec"] > 0, r


def test_too_few_tokens_have_no_tokens_per_sec(model_dir, data_file, capsys):
    """`--seq-len 2 --num-seqs 1` times call overhead, not the model: no column."""
    args = ["perplexity", str(model_dir), "--data", str(data_file)]
    assert main([*args, "--seq-len", "2", "--num-seqs", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["stock_tokens_per_sec"] is None, r
    assert r["flashnorm_tokens_per_sec"] is None, r
    assert main([*args, "--seq-len", "2", "--num-seqs", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tokens/sec" not in out and "too few to time" in out, out
    assert main([*args, "--seq-len", "64", "--num-seqs", "4"]) == 0
    assert "tokens/sec" in capsys.readouterr().out


def test_step_lines_count_the_windows_of_calibration_and_scoring(model_dir, data_file):
    """on_step hears where the work is: GPTQ's calibration windows, then each
    side's scored windows, from 0 to all (the CLI prints these when piped)."""
    from flashnorm_mlx.quant import gptq

    steps = []
    perplexity(
        read_source(str(model_dir)),
        text=data_file.read_text(),
        seq_len=32,
        num_seqs=3,
        batch_size=2,
        dtype=mx.float32,
        quantize=(4, 32),
        q_method="gptq",
        calibration=gptq.Calibration(num_seqs=2, seq_len=16),
        on_step=steps.append,
    )
    calibrating = [s for s in steps if s.startswith("calibrating GPTQ: ")]
    assert calibrating[0] == "calibrating GPTQ: 0/2 windows", steps
    assert calibrating[-1] == "calibrating GPTQ: 2/2 windows", steps
    for mode in ("stock", "flashnorm"):
        scored = [s for s in steps if s.startswith(f"scoring {mode}: ")]
        assert scored == [
            f"scoring {mode}: {n}/3 windows scored" for n in (0, 2, 3)
        ], steps


def test_cli_q_says_auto_chose_rtn_on_the_cpu(model_dir, data_file, capsys):
    """perplexity -q on the CPU: FlashNorm by round-to-nearest (auto), and
    one note naming --q-method gptq; --q-method rtn asked: no note."""
    from flashnorm_mlx.quant import gptq

    argv = ["perplexity", str(model_dir), "--data", str(data_file), "-q"]
    argv += ["--q-group-size", "32", "--seq-len", "16", "--num-seqs", "2", "--json"]
    assert main(argv) == 0
    err = " ".join(capsys.readouterr().err.split())
    want = gptq.resolve("auto") == "rtn"
    assert (gptq.AUTO_RTN_NOTE in err) == want, err
    assert main([*argv, "--q-method", "rtn"]) == 0
    assert gptq.AUTO_RTN_NOTE not in " ".join(capsys.readouterr().err.split())


def test_cli_default_size_is_the_machines(model_dir, data_file, capsys):
    """Issue 60 item 2: with no --seq-len/--num-seqs the run is sized for the
    backend (on MLX's CPU backend 4 windows of 32 tokens: 39 s on the
    embedded model, 2-core CPU under load, where 16 x 256 took 16 minutes);
    a flag given is kept."""
    from flashnorm_mlx.cli.perplexity import CPU_SIZE, GPU_SIZE

    on_cpu = mx.default_device() == mx.cpu
    seq_len, num_seqs = CPU_SIZE if on_cpu else GPU_SIZE
    argv = ["perplexity", str(model_dir), "--data", str(data_file), "--json"]
    assert main([*argv, "--mode", "stock"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["seq_len"], r["num_seqs"]) == (seq_len, num_seqs), r
    assert seq_len * num_seqs <= (128 if on_cpu else 4096), (seq_len, num_seqs)
    assert main([*argv, "--mode", "stock", "--num-seqs", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["seq_len"], r["num_seqs"]) == (seq_len, 2), r
