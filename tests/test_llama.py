"""FlashNorm Llama against stock mlx-lm's Llama on the same (random) weights."""

import json

import mlx.core as mx
import pytest
import tiny
from mlx_lm.models.cache import make_prompt_cache
from tiny import PROMPT

from flashnorm_mlx import fold, quant
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK


@pytest.fixture(scope="module", params=list(tiny.LLAMA_CONFIGS))
def source(request, tmp_path_factory):
    path = tiny.make_llama(tmp_path_factory.mktemp(request.param), request.param)
    return read_source(str(path))


def test_stock_is_mlx_lm_and_flashnorm_has_no_norm_gains(source):
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    assert type(stock).__module__ == "mlx_lm.models.llama"
    assert type(flash).__module__ == "flashnorm_mlx.models.llama"
    # Only the final norm's gain of a tied head survives (nothing to fold it into).
    held = ("RMSNorm", "Gain")  # a norm, or its gain held for the kernels
    norms = [n for n, m in flash.named_modules() if type(m).__name__ in held]
    assert norms == (
        ["model.norm"] if source.config["tie_word_embeddings"] else []
    ), norms


# Stated tolerances for low precision, as max |logit diff| / max |logit| against
# the float32 stock model. Stock itself drifts by 0.3-0.7% (fp16) and 2.5-7% (bf16)
# on these random models; FlashNorm rounds in different places, so allow ~3x that.
LOW_PRECISION_TOL = {mx.float16: 0.03, mx.bfloat16: 0.12}


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_close_to_float32_stock(source, dtype):
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=dtype)
    flash, _ = build_model(source, FLASHNORM, dtype=dtype)
    x = mx.array([PROMPT])
    r = ref(x)
    scale = mx.abs(r).max().item()
    err_stock = mx.abs(stock(x).astype(mx.float32) - r).max().item() / scale
    err_flash = mx.abs(flash(x).astype(mx.float32) - r).max().item() / scale
    assert (
        err_flash < LOW_PRECISION_TOL[dtype]
    ), f"{dtype}: flashnorm {err_flash:.3e}, stock {err_stock:.3e}"


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_no_inf_nan_with_residuals_scaled_by_1000(source, dtype):
    """x @ W* sees the unnormalized residual: fp16 would overflow without the
    power-of-two prescale (docs/design.md section 2g)."""
    key = "model.embed_tokens.weight"
    scaled = type(source)(
        source.name, source.config, {**source.weights, key: source.weights[key] * 1000}
    )
    x = mx.array([PROMPT])
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(scaled, mode, dtype=dtype)
        cache = make_prompt_cache(model)
        out = model(x, cache=cache)
        out2 = model(mx.array([[9]]), cache=cache)
        finite = bool(mx.isfinite(out).all()) and bool(mx.isfinite(out2).all())
        if mode is STOCK:
            stock_finite = finite
        else:
            assert (
                finite or not stock_finite
            ), f"{dtype}: flashnorm inf/NaN, stock finite"
    if dtype == mx.float32:
        r = compare(scaled, PROMPT, horizon=4, dtype=mx.float32)
        assert r["max_rel_logit_diff"] < tiny.f32_tol(), r


def test_fold_twice_equals_fold_once(source):
    w, c = source.weights, source.config
    once_w, once_c = fold.fold_norms(w, c)
    twice_w, twice_c = fold.fold_norms(once_w, once_c)
    assert once_c == twice_c
    assert once_w.keys() == twice_w.keys()
    for k in once_w:
        assert mx.array_equal(once_w[k], twice_w[k]), k
    # And folding changed something: the gains are far from 1.
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not mx.allclose(once_w[name], w[name]), name


def test_saved_folded_checkpoint_loads_without_second_fold(
    source, tmp_path, monkeypatch
):
    w, c = fold.fold_norms(source.weights, source.config)
    tiny.write_model(tmp_path, c, {k: v for k, v in w.items()}, tokenizer=False)
    assert json.loads((tmp_path / "config.json").read_text())[fold.MARKER]["folded"]

    expected, _ = build_model(source, FLASHNORM, dtype=mx.float32)

    def no_fold(*a, **k):
        raise AssertionError("a folded checkpoint was folded again")

    monkeypatch.setattr(fold, "fold_norms", no_fold)
    loaded, _ = build_model(read_source(str(tmp_path)), FLASHNORM, dtype=mx.float32)
    stock_on_folded, _ = build_model(
        read_source(str(tmp_path)), STOCK, dtype=mx.float32
    )
    x = mx.array([PROMPT])
    diff = mx.abs(loaded(x) - expected(x)).max().item()
    assert diff == 0.0, diff
    # Stock mlx-lm on the folded weights (unit gains restored) is the same function.
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    rel = (mx.abs(stock_on_folded(x) - ref(x)).max() / mx.abs(ref(x)).max()).item()
    assert rel < tiny.f32_tol(), rel


def _skip_if_not_quantizable(source):
    if source.config["hidden_size"] % 32:
        pytest.skip("hidden_size not a multiple of the 32-wide quantization groups")


def test_quantized_tensors_are_never_refolded(source):
    _skip_if_not_quantizable(source)
    w = dict(source.weights)
    name = "model.layers.0.self_attn.q_proj"
    wq, s, b = mx.quantize(w[f"{name}.weight"], group_size=32, bits=4)
    w.update({f"{name}.weight": wq, f"{name}.scales": s, f"{name}.biases": b})
    with pytest.raises(fold.FoldError, match="quantized"):
        fold.fold_norms(w, source.config)


def test_quantized_source_is_dequantized_folded_requantized(source):
    """4-bit source, --requantize: both modes are quantized from the same float
    weights with the source's settings; FlashNorm's quantized model equals
    quantizing the in-memory fold of the dequantized weights."""
    from flashnorm_mlx.loading import Source

    _skip_if_not_quantizable(source)
    qsrc = tiny.quantized(source)
    deq_w, deq_c = quant.dequantize_weights(qsrc.weights, qsrc.config)
    fsrc = Source("f", deq_c, deq_w)
    x = mx.array([PROMPT])
    a, _ = build_model(qsrc, FLASHNORM, quantized_way="requantize")
    b, _ = build_model(fsrc, FLASHNORM, dtype=mx.float32, quantize=(4, 32))
    assert mx.array_equal(a(x), b(x)), mx.abs(a(x) - b(x)).max().item()
    s, _ = build_model(qsrc, STOCK)
    assert type(s.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    # Exact mode: dequantize and run float; matches stock on the dequantized weights.
    r = compare(qsrc, PROMPT, horizon=8, dtype=mx.float32, quantized_way="dequantize")
    assert r["max_rel_logit_diff"] < tiny.f32_tol() and r["greedy_match"] == 8, r


def test_mixed_quantization_across_fused_layers_runs_lifted(source):
    """q stored at 4 bits, k and v at 8 (a folded checkpoint): FlashNorm stacks
    them as one 8-bit qkv_proj (loading/stacks.py), the same weights: its
    logits equal those of the same checkpoint with q, k, v in float."""
    from flashnorm_mlx.loading import Source

    _skip_if_not_quantizable(source)
    w, c = fold.fold_norms(source.weights, source.config)
    floats = dict(w)
    c = dict(c, quantization={"group_size": 32, "bits": 8, "mode": "affine"})
    for n, bits in (("q", 4), ("k", 8), ("v", 8)):
        m = f"model.layers.0.self_attn.{n}_proj"
        w[f"{m}.weight"], w[f"{m}.scales"], w[f"{m}.biases"] = mx.quantize(
            w[f"{m}.weight"], 32, bits
        )
        c["quantization"][m] = {"group_size": 32, "bits": bits, "mode": "affine"}
        floats[f"{m}.weight"] = mx.dequantize(
            w[f"{m}.weight"], w[f"{m}.scales"], w[f"{m}.biases"], 32, bits
        )
    notes = []
    got, _ = build_model(Source("mixed", c, w), FLASHNORM, mx.float32, notes=notes)
    assert got.model.layers[0].self_attn.qkv_proj.bits == 8
    assert len(notes) == 1 and "lifted" in notes[0], notes
    plain = {k: v for k, v in c.items() if k != "quantization"}
    want, _ = build_model(Source("float", plain, floats), FLASHNORM, mx.float32)
    x = mx.array([[5, 17, 99, 3, 250, 42, 7]])
    err = (mx.abs(got(x) - want(x)).max() / mx.abs(want(x)).max()).item()
    assert err < tiny.f32_tol(), f"lifted vs float q|k|v: {err:.3e}"
