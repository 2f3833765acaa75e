"""Fold-aware quantization (gptq.py) against independent references: MLX's own
round-to-nearest, numpy float64 objectives, and the float stock model."""

import mlx.core as mx
import numpy as np
import pytest
import tiny

from flashnorm_mlx.jobs.likelihood import perplexity
from flashnorm_mlx.loading import Source, build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK
from flashnorm_mlx.quant import gptq
from flashnorm_mlx.texts import calibration_text, default_text

CALIB = gptq.Calibration(num_seqs=8, seq_len=48)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return read_source(str(tiny.make_llama(tmp_path_factory.mktemp("g"), "gqa_untied")))


def _objective(w_ref, w_q, x):
    """||(W - Q) x||^2 summed over inputs, in float64."""
    d = np.asarray(w_ref, np.float64) - np.asarray(w_q, np.float64)
    return float(((np.asarray(x, np.float64) @ d.T) ** 2).sum())


def test_gptq_beats_rtn_on_its_objective_and_packs_as_mlx_does():
    rng = np.random.default_rng(0)
    # Correlated inputs with very different column scales, as folded gains make.
    x = rng.standard_normal((512, 64)) @ rng.standard_normal((64, 64)) * 0.3
    x = (x * rng.uniform(0.25, 4.0, 64)).astype(np.float32)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    H = mx.array(x.T @ x)
    q = gptq.quantize_weight(mx.array(w), H, 4, 32, mx.float32)
    deq = mx.dequantize(q["weight"], q["scales"], q["biases"], group_size=32, bits=4)
    rtn = mx.dequantize(*mx.quantize(mx.array(w), group_size=32, bits=4), 32, 4)
    ours, theirs = _objective(w, deq, x), _objective(w, rtn, x)
    assert ours < 0.7 * theirs, (ours, theirs)
    # Same storage as mx.quantize: uint32 packs, one scale and bias per group.
    ref_w, ref_s, ref_b = mx.quantize(mx.array(w), group_size=32, bits=4)
    assert (q["weight"].dtype, q["weight"].shape) == (ref_w.dtype, ref_w.shape)
    assert q["scales"].shape == ref_s.shape and q["biases"].shape == ref_b.shape


def test_hessian_of_a_norm_fed_linear_is_in_the_folded_basis(source):
    """Layer 0's q_proj reads RMSNorm(embedding) * g in stock; the folded weight
    reads the embedding over its RMS: H = sum of those outer products (numpy)."""
    data = mx.array(np.arange(40, dtype=np.int32).reshape(2, 20) % 256)
    hess = gptq.hessians(source.weights, source.config, data)
    emb = np.asarray(source.weights["model.embed_tokens.weight"], np.float64)
    x = emb[np.asarray(data).ravel()]
    eps = source.config["rms_norm_eps"]
    xhat = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
    want = xhat.T @ xhat
    got = np.asarray(hess["model.layers.0.self_attn.q_proj"], np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    # o_proj is not norm-fed: its Hessian is stock's own (no gain divided out).
    assert "model.layers.0.self_attn.o_proj" in hess


def _logit_error(model, ref, tokens):
    out, want = model(tokens), ref(tokens)
    return (mx.abs(out - want).max() / mx.abs(want).max()).item()


def _gptq_model(source, **kw):
    """FlashNorm 4-bit g32 by GPTQ: the checkpoint convert writes, in memory."""
    from flashnorm_mlx.loading.recipe import fold_checkpoint

    weights, config = fold_checkpoint(
        source,
        dict(source.weights),
        (4, 32),
        mx.float32,
        q_method="gptq",
        calibration=CALIB,
        **kw,
    )
    converted = Source(source.name, config, weights, source.tokenizer)
    return build_model(converted, FLASHNORM, dtype=mx.float32)[0]


def test_fold_aware_gptq_closer_to_float_than_rtn(source):
    """FlashNorm 4-bit g32 by GPTQ vs by RTN, both against the float stock model
    on text the calibration never saw."""
    tokens = mx.array([source.tokenizer.encode(default_text()[:400])[:64]])
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    rtn, _ = build_model(source, FLASHNORM, dtype=mx.float32, quantize=(4, 32))
    model = _gptq_model(source)
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert "QuantizedLinear" in kinds and "Linear" not in kinds, kinds
    e_gptq, e_rtn = _logit_error(model, ref, tokens), _logit_error(rtn, ref, tokens)
    assert e_gptq < e_rtn, (e_gptq, e_rtn)


def test_calibration_is_deterministic_and_apart_from_evaluation(source):
    a = gptq.calibration_data(source.tokenizer, CALIB)
    b = gptq.calibration_data(source.tokenizer, CALIB)
    assert mx.array_equal(a, b).item() and a.shape == (8, 48)
    other = gptq.calibration_data(
        source.tokenizer, gptq.Calibration(num_seqs=8, seq_len=48, seed=1)
    )
    assert not mx.array_equal(a, other).item()
    # Calibration and evaluation take alternate pydoc topics: both large, and no
    # topic in both (some topics quote the same paragraphs, so compare topics).
    from pydoc_data.topics import topics

    cal, ev = calibration_text(), default_text()
    assert len(cal) > 100_000 and len(ev) > 100_000
    both = [k for k, t in topics.items() if len(t) > 2000 and t in cal and t in ev]
    assert not both, both


def test_perplexity_reports_methods_bits_and_an_interval(source):
    r = perplexity(
        source,
        seq_len=32,
        num_seqs=4,
        dtype=mx.float32,
        quantize=(4, 32),
        q_method="gptq",
        calibration=CALIB,
    )
    assert (r["stock_method"], r["flashnorm_method"]) == ("rtn", "gptq"), r
    assert abs(r["stock_bits_per_weight"] - r["flashnorm_bits_per_weight"]) < 0.2, r
    lo, hi = r["diff_rel_ci95"]
    assert lo <= r["diff_rel"] <= hi or abs(r["diff_rel"] - (lo + hi) / 2) < 1, r
    r = perplexity(
        source,
        seq_len=32,
        num_seqs=4,
        dtype=mx.float32,
        q_method="rtn",
        quantize=(4, 32),
    )
    assert r["flashnorm_method"] == "rtn", r
    r = perplexity(source, seq_len=32, num_seqs=4, dtype=mx.float32)
    assert r["stock_method"] == r["flashnorm_method"] == "float", r


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def test_convert_gptq_is_recorded_deterministic_and_runs_in_stock_mlx_lm(
    source, tmp_path
):
    import json

    from mlx_lm.utils import load_model

    from flashnorm_mlx.jobs.checkpoint import convert

    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        convert(
            source,
            out,
            quantize=(4, 32),
            compat=True,
            progress=False,
            q_method="gptq",
            calibration=CALIB,
        )
    marker = json.loads((a / "config.json").read_text())["flashnorm"]
    assert marker["quantization_method"]["method"] == "gptq", marker
    assert marker["quantization_method"]["calibration"]["num_seqs"] == CALIB.num_seqs
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    assert all(mx.array_equal(ta[k], tb[k]).item() for k in ta), "not deterministic"
    # --compat: stock mlx-lm loads the GPTQ checkpoint and computes what ours does.
    x = mx.array([[5, 17, 99, 3, 250, 42]])
    stock, _ = load_model(a)
    ours, _ = build_model(read_source(str(a)), FLASHNORM, dtype=mx.float32)
    rel = (mx.abs(stock(x) - ours(x)).max() / mx.abs(ours(x)).max()).item()
    assert rel < tiny.f32_tol(1e-5), rel


def test_gptq_in_row_chunks_equals_whole_weights(source):
    """GPTQ rows are independent: a weight computed in row chunks (convert's
    bounded memory) is the weight computed whole, bit for bit."""
    whole = _gptq_model(source)
    chunked = _gptq_model(source, chunk_elements=1000)
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        m1 = dict(whole.named_modules())[f"model.layers.1.{name}"]
        m2 = dict(chunked.named_modules())[f"model.layers.1.{name}"]
        for p in ("weight", "scales", "biases"):
            assert mx.array_equal(m1[p], m2[p]).item(), (name, p)


def test_convert_gptq_without_a_tokenizer_is_one_clear_error(tmp_path):
    from flashnorm_mlx.jobs.checkpoint import convert
    from flashnorm_mlx.loading import LoadError

    src = read_source(str(tiny.make_openelm(tmp_path / "e", tokenizer=False)))
    with pytest.raises(LoadError, match="--q-method rtn"):
        convert(src, tmp_path / "out", (4, 32), progress=False, q_method="gptq")
    assert not (tmp_path / "out").exists()


def test_bits_gptq_cannot_write_fail_before_any_work(source, tmp_path):
    """3-bit weights (mlx-lm's GPTQ packer writes 2, 4 and 8): one LoadError from
    the weights plan, before perplexity builds stock and before convert writes
    anything; round-to-nearest takes the same flags."""
    from flashnorm_mlx.jobs.checkpoint import convert
    from flashnorm_mlx.loading import LoadError

    stages = []
    with pytest.raises(LoadError, match="not 3-bit"):
        perplexity(
            source,
            seq_len=16,
            num_seqs=1,
            quantize=(3, 32),
            q_method="gptq",
            on_stage=stages.append,
        )
    assert stages == [], stages  # nothing was built, so nothing was scored
    with pytest.raises(LoadError, match="not 3-bit"):
        convert(source, tmp_path / "out", (3, 32), progress=False, q_method="gptq")
    assert list(tmp_path.iterdir()) == [], "convert left files behind"
    r = perplexity(source, seq_len=16, num_seqs=1, quantize=(3, 32), q_method="rtn")
    assert r["flashnorm_method"] == "rtn", r


def test_a_linear_no_group_divides_stays_float_beside_gptq(tmp_path):
    """down_proj reads 72 columns, which no 32-wide group divides: calibration
    measures it like every linear, but it stays float, as round-to-nearest
    leaves it (the reference), and the checkpoint builds."""
    from flashnorm_mlx.loading.recipe import fold_checkpoint

    cfg = {**tiny.llama_config("gqa_untied"), "intermediate_size": 72}
    src = read_source(str(tiny.write_model(tmp_path, cfg, tiny.llama_weights(cfg))))
    out = {
        how: fold_checkpoint(
            src, dict(src.weights), (4, 32), mx.float32, q_method=how, calibration=CALIB
        )
        for how in ("gptq", "rtn")
    }
    name = "model.layers.0.mlp.down_proj"
    (gw, gc), (rw, _) = out["gptq"], out["rtn"]
    assert f"{name}.scales" not in gw and gw[f"{name}.weight"].dtype == mx.float32
    assert mx.array_equal(gw[f"{name}.weight"], rw[f"{name}.weight"]).item()
    assert "model.layers.0.mlp.up_proj.scales" in gw  # the others are quantized
    build_model(Source("gptq", gc, gw, src.tokenizer), FLASHNORM, dtype=mx.float32)
