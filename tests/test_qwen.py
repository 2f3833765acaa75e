"""FlashNorm Qwen2 (q/k/v biases) and Qwen3 (QK-norm) against mlx-lm's own classes.

Same weights for both sides, random norm gains in [0.25, 4], Qwen2 biases of
size 0.5-2 with either sign, Qwen3 QK-norm gains random too (and a large eps in
one config, so dropping the epsilon adjustment would show).
"""

import mlx.core as mx
import pytest
import tiny
from mlx_lm.models.cache import make_prompt_cache
from tiny import PROMPT

from flashnorm_mlx import fold
from flashnorm_mlx.jobs import speed
from flashnorm_mlx.jobs.checkpoint import convert
from flashnorm_mlx.jobs.likelihood import default_text, perplexity
from flashnorm_mlx.loading import Source, build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK


@pytest.fixture(scope="module", params=list(tiny.QWEN_CONFIGS))
def source(request, tmp_path_factory):
    path = tiny.make_qwen(tmp_path_factory.mktemp(request.param), request.param)
    return read_source(str(path))


def test_classes_and_what_is_left_of_the_norms(source):
    mt = source.config["model_type"]
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    assert type(stock).__module__ == f"mlx_lm.models.{mt}"
    assert type(flash).__module__ == f"flashnorm_mlx.models.{mt}"
    held = ("RMSNorm", "Gain")  # a norm, or its gain held for the kernels
    norms = [n for n, m in flash.named_modules() if type(m).__name__ in held]
    assert norms == (["model.norm"] if source.config["tie_word_embeddings"] else [])
    qk = [n for n, m in flash.named_modules() if type(m).__name__ == "QKNorm"]
    assert len(qk) == (0 if mt == "qwen2" else 2 * source.config["num_hidden_layers"])


def test_epsilon_adjustment_and_biases_matter(source):
    """The reference is sensitive to what FlashNorm must get right: drop Qwen3's
    QK-norm epsilon adjustment (where eps is large enough to matter) or its
    gains, or get Qwen2's biases wrong, and the logits move far beyond the
    tolerance."""
    from flashnorm_mlx.models import qwen2, qwen3

    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    x = mx.array([PROMPT])
    ref = stock(x)
    attn = flash.layers[0].self_attn
    if isinstance(attn, qwen3.Attention):
        gains = attn._qk_gains(attn.q_norm.weight, attn.k_norm.weight)
        if source.config["rms_norm_eps"] >= 0.01:
            gains["eps_q"] = gains["eps_k"] = 1e-12  # the naive drop of eps * ms
        else:
            gains["k_gain"] = mx.ones_like(gains["k_gain"])  # gains left out
    else:
        assert isinstance(attn, qwen2.Attention) and "qkv_bias" in attn
        attn.qkv_bias = attn.qkv_bias * 2  # a wrong bias must show
    rel = (mx.abs(flash(x) - ref).max() / mx.abs(ref).max()).item()
    assert rel > 10 * tiny.f32_tol(), rel


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_finite_and_close(source, dtype):
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=dtype)
    flash, _ = build_model(source, FLASHNORM, dtype=dtype)
    x = mx.array([PROMPT])
    r = ref(x)
    scale = mx.abs(r).max().item()
    outs = {"stock": stock(x), "flashnorm": flash(x)}
    for name, out in outs.items():
        assert mx.isfinite(out).all().item(), name
    err = {
        n: mx.abs(o.astype(mx.float32) - r).max().item() / scale
        for n, o in outs.items()
    }
    tol = {mx.float16: 0.03, mx.bfloat16: 0.12}[dtype]  # as for Llama (test_llama)
    assert err["flashnorm"] < tol, err


def test_no_inf_nan_with_residuals_scaled_by_1000_in_float16(source):
    key = "model.embed_tokens.weight"
    scaled = Source(
        source.name, source.config, {**source.weights, key: source.weights[key] * 1000}
    )
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(scaled, mode, dtype=mx.float16)
        cache = make_prompt_cache(model)
        outs = [
            model(mx.array([PROMPT]), cache=cache),
            model(mx.array([[9]]), cache=cache),
        ]
        finite = all(mx.isfinite(o).all().item() for o in outs)
        if mode is STOCK:
            stock_finite = finite
        else:
            assert finite or not stock_finite, "flashnorm inf/NaN where stock is finite"


def test_fold_twice_equals_fold_once(source):
    once_w, once_c = fold.fold_norms(source.weights, source.config)
    twice_w, twice_c = fold.fold_norms(once_w, once_c)
    assert once_c == twice_c and once_w.keys() == twice_w.keys()
    assert all(mx.array_equal(once_w[k], twice_w[k]).item() for k in once_w)


def test_bench_runs_all_three_variants(source):
    r = speed.run_bench(source, prompt_tokens=6, gen_tokens=3, trials=1)
    v = r["variants"]
    assert all(v[n]["logits_finite"] and v[n]["all_trials_finite"] for n in v), v
    assert v["nonorm"]["rms_norm_modules"] == 0, v["nonorm"]
    gpu = {n: v[n]["dispatches_per_token_gpu_model"] for n in v}
    assert gpu["flashnorm"] < gpu["nonorm"] < gpu["stock"], gpu


def test_converted_checkpoint_loads_and_matches(source, tmp_path):
    out = tmp_path / "folded"
    convert(source, out, progress=False)
    folded = read_source(str(out))
    assert fold.is_folded(folded.config)
    x = mx.array([PROMPT])
    ours, _ = build_model(folded, FLASHNORM, dtype=mx.float32)
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    rel = (mx.abs(ours(x) - ref(x)).max() / mx.abs(ref(x)).max()).item()
    assert rel < tiny.f32_tol(), rel


def test_convert_quantized_runs(source, tmp_path):
    out = tmp_path / "q4"
    convert(source, out, quantize=(4, 32), progress=False, q_method="gptq")
    model, _ = build_model(read_source(str(out)), FLASHNORM)
    logits = model(mx.array([PROMPT]))
    assert mx.isfinite(logits).all().item()


def test_perplexity_agrees_in_float32(source):
    r = perplexity(
        source, text=default_text()[:3000], seq_len=32, num_seqs=2, dtype=mx.float32
    )
    assert abs(r["diff_rel"]) < tiny.f32_tol(), r
