"""FlashNorm OpenELM against stock mlx-lm's OpenELM on the same (random) weights.

Tiny models in Apple's layout with per-layer head counts and FFN widths, random
gains in [0.25, 4] on attn_norm, ffn_norm, q_norm, k_norm and the final norm.
"""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from flashnorm_mlx import fold
from flashnorm_mlx.loading import Source, build_model, read_source
from flashnorm_mlx.models import openelm
from flashnorm_mlx.verify import compare

PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 180, 64, 11, 2]
STEPS = 32


@pytest.fixture(scope="module", params=list(tiny.OPENELM_CONFIGS))
def source(request, tmp_path_factory):
    path = tiny.make_openelm(tmp_path_factory.mktemp(request.param), request.param)
    return read_source(str(path))


def _greedy(model, prompt, steps):
    """Logit rows (prompt + `steps` cached decode steps) and the greedy tokens."""
    cache, rows, tokens = make_prompt_cache(model), [], []
    x = mx.array([prompt])
    for _ in range(steps + 1):
        logits = model(x, cache=cache)[0].astype(mx.float32)
        rows.append(logits)
        tokens.append(mx.argmax(logits[-1]).item())
        x = mx.array([[tokens[-1]]])
    return mx.concatenate(rows), tokens[:steps]


def _forced(model, prompt, tokens):
    """Logit rows with the decode steps fed `tokens` (teacher forcing)."""
    cache = make_prompt_cache(model)
    rows = [model(mx.array([prompt]), cache=cache)[0]]
    rows += [model(mx.array([[t]]), cache=cache)[0] for t in tokens]
    return mx.concatenate(rows).astype(mx.float32)


def _rel(a, b):
    return mx.abs(a - b).max().item() / mx.abs(b).max().item()


# --- float32: exact ----------------------------------------------------------


def test_float32_logits_and_greedy_match_stock(source):
    stock, _ = build_model(source, "stock", dtype=mx.float32)
    flash, _ = build_model(source, "flashnorm", dtype=mx.float32)
    ref, tokens = _greedy(stock, PROMPT, STEPS)
    out = _forced(flash, PROMPT, tokens)
    rel = _rel(out, ref)
    # Row len(PROMPT)-1+i predicts decode token i.
    flash_tokens = mx.argmax(out[len(PROMPT) - 1 :], axis=-1).tolist()[:STEPS]
    same = next(
        (i for i, (a, b) in enumerate(zip(flash_tokens, tokens)) if a != b), STEPS
    )
    print(f"{source.name}: float32 max rel logit diff {rel:.2e}, greedy match {same}")
    assert rel < 1e-4, f"max |diff| / max |logit| = {rel:.3e} (limit 1e-4)"
    assert (
        same == STEPS
    ), f"greedy tokens diverge at step {same}: {flash_tokens} vs {tokens}"


def test_verify_compare_reports_openelm_exact(source):
    r = compare(source, PROMPT, horizon=STEPS, dtype=mx.float32)
    print(r)
    assert r["model_type"] == "openelm" and r["dtype"] == "float32", r
    assert r["prompt_tokens"] == len(PROMPT) and not r["quantized"], r
    assert r["max_rel_logit_diff"] < 1e-4, r
    assert r["greedy_match"] == STEPS and r["greedy_horizon"] == STEPS, r
    assert r["stock_finite"] and r["flashnorm_finite"], r
    assert r["kl_max"] < 1e-5, r


def test_stock_is_mlx_lm_and_flashnorm_keeps_only_qk_gains(source):
    stock, _ = build_model(source, "stock", dtype=mx.float32)
    flash, _ = build_model(source, "flashnorm", dtype=mx.float32)
    assert type(stock).__module__ == "mlx_lm.models.openelm", type(stock)
    assert type(flash).__module__ == "flashnorm_mlx.models.openelm", type(flash)
    shared = source.config["share_input_output_layers"]
    norms = [n for n, m in flash.named_modules() if type(m).__name__ == "RMSNorm"]
    assert norms == (["transformer.norm"] if shared else []), norms
    # QK-norm gains are not folded: they feed the RoPE tables unchanged.
    for i, (sl, fl) in enumerate(zip(stock.layers, flash.layers)):
        for n in ("q_norm", "k_norm"):
            if n not in sl.attn:  # normalize_qk_projections=False: plain RoPE
                assert "weight" not in fl.attn[n], f"layer {i} {n} has a gain"
                continue
            d = mx.abs(sl.attn[n].weight - fl.attn[n].weight).max().item()
            assert d == 0, f"layer {i} {n} gain differs by {d}"


# --- low precision -------------------------------------------------------------

# Stated tolerance, per logit row e = max|logit - ref| / max|ref| against the
# float32 stock model (teacher-forced on its greedy tokens, prompt + 32 steps):
#  - mean over rows of FlashNorm's e <= 1.25 x stock's own mean e in that dtype.
#    Measured on these configs (4 seeds each): FlashNorm/stock = 0.5-1.1 (bf16),
#    0.6-1.0 (fp16); stock's mean e is 2-8% (bf16), 0.25-0.8% (fp16).
#  - max over rows: bf16 <= 0.6, fp16 <= 0.06. These tiny random models with
#    gains up to 4 amplify single roundings: stock's own max reaches 0.38 (bf16).
LOW_PRECISION_MAX = {mx.bfloat16: 0.6, mx.float16: 0.06}


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_no_worse_than_stock(source, dtype):
    ref_model, _ = build_model(source, "stock", dtype=mx.float32)
    ref, tokens = _greedy(ref_model, PROMPT, STEPS)
    scale = mx.abs(ref).max(axis=-1)
    err = {}
    for mode in ("stock", "flashnorm"):
        model, _ = build_model(source, mode, dtype=dtype)
        out = _forced(model, PROMPT, tokens)
        assert mx.isfinite(out).all().item(), f"{mode} {dtype}: inf/NaN logits"
        e = mx.abs(out - ref).max(axis=-1) / scale
        err[mode] = (e.mean().item(), e.max().item())
    msg = (
        f"{dtype} rel err vs float32 (mean, max): stock {err['stock'][0]:.4f}, "
        f"{err['stock'][1]:.4f}; flashnorm {err['flashnorm'][0]:.4f}, "
        f"{err['flashnorm'][1]:.4f}"
    )
    print(msg)
    assert err["flashnorm"][0] <= 1.25 * err["stock"][0], msg
    assert err["flashnorm"][1] <= LOW_PRECISION_MAX[dtype], msg


def _scaled_residuals(source: Source, factor: float) -> Source:
    """The same function with every residual `factor` times larger.

    Scaling the embedding scales all residuals (each block is scale-invariant
    in its input up to eps); a shared head gets the unscaled copy as lm_head.
    """
    cfg, w = dict(source.config), dict(source.weights)
    key = "transformer.token_embeddings.weight"
    if cfg["share_input_output_layers"]:
        cfg["share_input_output_layers"] = False
        w["lm_head.weight"] = w[key]
    w[key] = w[key] * factor
    return Source(f"{source.name} x{factor:g}", cfg, w)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_no_inf_nan_with_scaled_residuals(source, dtype):
    """x @ W* sees the unnormalized residual: fp16 needs the power-of-two
    prescale (DESIGN.md section 2). 8000 overflows fp16 without it."""
    for factor in (1000.0, 8000.0):
        scaled = _scaled_residuals(source, factor)
        finite, outs = {}, {}
        for mode in ("stock", "flashnorm"):
            model, _ = build_model(scaled, mode, dtype=dtype)
            outs[mode] = _forced(model, PROMPT, [9, 200])
            finite[mode] = mx.isfinite(outs[mode]).all().item()
        print(f"{dtype} x{factor:g}: finite {finite}")
        assert (
            finite["flashnorm"] or not finite["stock"]
        ), f"{dtype} x{factor}: {finite}"
        if dtype == mx.float32:
            rel = _rel(outs["flashnorm"], outs["stock"])
            assert rel < 1e-4, f"x{factor}: float32 rel diff {rel:.3e}"


# --- longer contexts, batched (array) offsets, mlx-lm generation ------------------


def test_long_prompt_crosses_rope_table_growth(tmp_path):
    """A 300-token prompt and decode past the first table size (256 positions)."""
    src = read_source(str(tiny.make_openelm(tmp_path / "m", "odd_unshared", seed=3)))
    prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, 300).tolist()
    stock, _ = build_model(src, "stock", dtype=mx.float32)
    flash, _ = build_model(src, "flashnorm", dtype=mx.float32)
    ref, tokens = _greedy(stock, prompt[:250], 8)
    out = _forced(flash, prompt[:250], tokens)
    rel1 = _rel(out, ref)
    rel2 = _rel(flash(mx.array([prompt])), stock(mx.array([prompt])))
    sizes = {fl.attn.q_norm._cos.shape[0] for fl in flash.layers}
    print(f"rel diff: 250+8 cached {rel1:.2e}, 300 uncached {rel2:.2e}, tables {sizes}")
    assert rel1 < 1e-4 and rel2 < 1e-4, f"{rel1:.3e} {rel2:.3e}"
    assert sizes == {512}, f"table sizes {sizes}: expected one doubling 256 -> 512"


def test_batched_cache_with_array_offsets_matches_stock(source):
    """mlx-lm's BatchKVCache: per-sequence mx.array offsets (left padding)."""
    pad = [0, 3]
    seqs = [PROMPT, [0] * pad[1] + PROMPT[: len(PROMPT) - pad[1]]]
    logits = {}
    for mode in ("stock", "flashnorm"):
        model, _ = build_model(source, mode, dtype=mx.float32)
        cache = [BatchKVCache(pad) for _ in model.layers]
        rows = [model(mx.array(seqs), cache=cache)]
        rows.append(model(mx.array([[8], [21]]), cache=cache))
        logits[mode] = mx.concatenate(rows, axis=1)
    # Padded positions are masked out: compare the real ones only.
    rel = max(
        _rel(logits["flashnorm"][b, p:], logits["stock"][b, p:])
        for b, p in enumerate(pad)
    )
    print(f"batched rel diff {rel:.2e}")
    assert rel < 1e-4, f"batched max rel diff {rel:.3e}"


def test_mlx_lm_stream_generate_runs_flashnorm(tmp_path):
    from mlx_lm import stream_generate

    path = tiny.make_openelm(tmp_path / "m", "shared", tokenizer=True)
    src = read_source(str(path))
    texts = {}
    for mode in ("stock", "flashnorm"):
        model, _ = build_model(src, mode, dtype=mx.float32)
        responses = list(stream_generate(model, src.tokenizer, PROMPT, max_tokens=12))
        texts[mode] = [r.token for r in responses]
    assert texts["flashnorm"] == texts["stock"], texts


# --- the two identities, unit level ---------------------------------------------


def _rope_tol(offset: int, magnitude: float) -> float:
    """1e-5 on CPU, where the tables use mx.fast.rope's own float32 formula.

    Metal and CUDA compute the frequencies another way (exp2, fast cos), so
    there add the float32 rounding of an angle near `offset` radians.
    """
    if mx.default_device() == mx.cpu:
        return 1e-5
    return 1e-5 + 4 * offset * 2**-24 * magnitude


@pytest.mark.parametrize("head_dim,base", [(16, 10000.0), (10, 500000.0), (64, 1e4)])
def test_rope_tables_equal_gain_then_fast_rope(head_dim, base):
    mx.random.seed(head_dim)
    gain = mx.random.uniform(0.25, 4.0, (head_dim,))
    y = mx.random.normal((2, 3, 5, head_dim))
    scale = head_dim**-0.5
    errs, tols = [], []
    for offset in (0, 1, 7, 255, 300, 4093, 20000):
        cos_t, sin_t = openelm.rope_tables(
            gain, head_dim, base, mx.arange(offset, offset + 5), scale
        )
        got = openelm.apply_rope_tables(y, cos_t, sin_t)
        want = mx.fast.rope(
            y * gain, head_dim, traditional=False, base=base, scale=1.0, offset=offset
        )
        errs.append(mx.abs(got - want * scale).max().item())
        tols.append(_rope_tol(offset, mx.abs(want * scale).max().item()))
    print(f"h={head_dim} base={base}: max errors by offset {errs}")
    assert all(e <= t for e, t in zip(errs, tols)), f"errors {errs}, limits {tols}"


def test_rope_tables_identity_written_with_rotate_half():
    """sin_t = swap_halves(g) * sin * [-1, 1]: the DESIGN.md form, sign moved."""
    h = 12
    gain = mx.random.uniform(0.25, 4.0, (h,))
    y = mx.random.normal((4, h))
    pos = mx.arange(4)
    cos_1, sin_1 = openelm.rope_tables(None, h, 10000.0, pos)  # plain [cos|cos], ...
    sin_plain = mx.concatenate([sin_1[:, h // 2 :], sin_1[:, h // 2 :]], -1)
    rotate_half = mx.concatenate([-y[:, h // 2 :], y[:, : h // 2]], -1)
    design = y * (gain * cos_1) + rotate_half * (openelm.swap_halves(gain) * sin_plain)
    cos_t, sin_t = openelm.rope_tables(gain, h, 10000.0, pos)
    err = mx.abs(openelm.apply_rope_tables(y, cos_t, sin_t) - design).max().item()
    assert err <= 1e-6, f"table form vs rotate_half form: {err:.2e}"


def test_qk_norm_rope_module_matches_stock_norm_then_rope():
    """QKNormRope (tables, int and array offsets, growth) vs nn.RMSNorm + nn.RoPE."""
    h, eps, base = 16, 0.3, 10000.0
    mod = openelm.QKNormRope(h, base, eps, h**-0.5, normalize=True)
    mod.weight = mx.random.uniform(0.25, 4.0, (h,))
    B, H, L = 2, 3, 4
    errs = {}
    for offset in (0, 5, 254, 600):  # 254 + 4 and 600 grow the table 256 -> 1024
        q = mx.random.normal((B, H, L, h)) * 3
        ms = mx.random.uniform(0.01, 100.0, (B, 1, L, 1))
        stock = mx.fast.rms_norm(q * mx.rsqrt(ms), mod.weight, eps)
        want = mx.fast.rope(
            stock, h, traditional=False, base=base, scale=1.0, offset=offset
        )
        want = want * h**-0.5
        for kind, off in (
            ("int", offset),
            ("array", mx.array(offset)),
            ("batch", mx.array([offset] * B)),
        ):
            err = mx.abs(mod(q, ms, off) - want).max().item()
            errs[(offset, kind)] = err
            tol = _rope_tol(offset, mx.abs(want).max().item())
            assert err <= tol, f"offset {offset} ({kind}): {err:.2e} > {tol:.2e}"
    print(errs, "table size", mod._cos.shape[0])
    assert mod._cos.shape[0] == 1024, mod._cos.shape
    mod.weight = mod.weight * 2  # new weights rebuild the tables
    q = mx.random.normal((1, 1, 1, h))
    ms = mx.ones((1, 1, 1, 1))
    normed = mx.fast.rms_norm(q, mod.weight, eps)
    want = mx.fast.rope(normed, h, traditional=False, base=base, scale=1.0, offset=3)
    err = mx.abs(mod(q, ms, 3) - want * h**-0.5).max().item()
    assert err <= 1e-5, f"after a weight update: {err:.2e}"


def test_eps_adjustment_makes_the_eliminated_rms_exact():
    """rms_norm(s*q, eps) == q * rsqrt(mean(q^2) + eps*ms); dropping s is not."""
    eps = 0.5
    q = mx.random.normal((2, 4, 6, 32))
    s = mx.array(np.logspace(-1.5, 1.5, 12, dtype=np.float32).reshape(2, 1, 6, 1))
    ms = 1.0 / (s * s)  # s = rsqrt(ms): ms from 0.001 to 1000
    stock = mx.fast.rms_norm(q * s, None, eps)
    adjusted = openelm.qk_norm_adjusted(q, eps * ms)
    naive = openelm.qk_norm_adjusted(q, mx.array(eps))
    err_adj = mx.abs(adjusted - stock).max().item()
    err_naive = mx.abs(naive - stock).max().item()
    print(f"eps={eps}: adjusted error {err_adj:.2e}, naive drop error {err_naive:.2e}")
    assert (
        err_adj <= 1e-6
    ), f"adjusted {err_adj:.2e} (limit 1e-6), naive {err_naive:.2e}"
    assert err_naive > 1e-2, f"naive drop {err_naive:.2e} should be visibly wrong"


# --- folding ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["shared", "odd_unshared"])
def test_fold_twice_equals_fold_once(name):
    cfg = tiny.openelm_config(name)
    w = {k: mx.array(v) for k, v in tiny.openelm_weights(cfg).items()}
    once_w, once_c = fold.fold_norms(w, cfg)
    twice_w, twice_c = fold.fold_norms(once_w, once_c)
    assert twice_c == once_c and sorted(twice_w) == sorted(once_w)
    diffs = {k: mx.abs(twice_w[k] - once_w[k]).max().item() for k in once_w}
    assert max(diffs.values()) == 0, {k: d for k, d in diffs.items() if d}
    # What fold did: attn/ffn norms gone, QK-norm gains kept, W* = W diag(g).
    assert not any(k.endswith(("attn_norm.weight", "ffn_norm.weight")) for k in once_w)
    n_layers = cfg["num_transformer_layers"]
    for i in range(n_layers):
        p = f"transformer.layers.{i}"
        assert (
            f"{p}.attn.q_norm.weight" in once_w and f"{p}.attn.k_norm.weight" in once_w
        )
        want = w[f"{p}.attn.qkv_proj.weight"] * w[f"{p}.attn_norm.weight"][None]
        d = mx.abs(once_w[f"{p}.attn.qkv_proj.weight"] - want).max().item()
        assert d == 0, f"layer {i} qkv_proj fold off by {d}"
    shared = cfg["share_input_output_layers"]
    assert ("transformer.norm.weight" in once_w) == shared, sorted(once_w)
    assert once_c["flashnorm"]["final_norm_folded"] == (not shared), once_c
    if not shared:
        want = w["lm_head.weight"] * w["transformer.norm.weight"][None]
        d = mx.abs(once_w["lm_head.weight"] - want).max().item()
        assert d == 0, f"lm_head fold off by {d}"
