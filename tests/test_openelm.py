"""FlashNorm OpenELM against stock mlx-lm's OpenELM on the same (random) weights.

Tiny models in Apple's layout with per-layer head counts and FFN widths, random
gains in [0.25, 4] on attn_norm, ffn_norm, q_norm, k_norm and the final norm.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from tiny import PROMPT

from flashnorm_mlx import fold, kernels
from flashnorm_mlx.loading import Source, build_model, read_source
from flashnorm_mlx.models import openelm
from flashnorm_mlx.modes import FLASHNORM, STOCK

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


# --- classes and what is left of the norms ---------------------------------------


def test_stock_is_mlx_lm_and_flashnorm_keeps_only_qk_gains(source):
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    assert type(stock).__module__ == "mlx_lm.models.openelm", type(stock)
    assert type(flash).__module__ == "flashnorm_mlx.models.openelm", type(flash)
    shared = source.config["share_input_output_layers"]
    norms = [n for n, m in flash.named_modules() if type(m).__name__ == "RMSNorm"]
    assert norms == (["transformer.norm"] if shared else []), norms
    # QK-norm gains are not folded: they feed the RoPE tables unchanged.
    for i, (sl, fl) in enumerate(zip(stock.layers, flash.layers)):
        for n in ("q_norm", "k_norm"):
            if n not in sl.attn:  # normalize_qk_projections=False: plain RoPE
                assert n not in fl.attn, f"layer {i} has a {n} without QK-norm"
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
    ref_model, _ = build_model(source, STOCK, dtype=mx.float32)
    ref, tokens = _greedy(ref_model, PROMPT, STEPS)
    scale = mx.abs(ref).max(axis=-1)
    err = {}
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(source, mode, dtype=dtype)
        out = _forced(model, PROMPT, tokens)
        assert mx.isfinite(out).all().item(), f"{mode} {dtype}: inf/NaN logits"
        e = mx.abs(out - ref).max(axis=-1) / scale
        err[mode.name] = (e.mean().item(), e.max().item())
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

    Scaling the embedding scales all residuals (each block ignores the scale of
    its input up to eps); a shared head gets the unscaled copy as lm_head.
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
    prescale (docs/design.md section 2g). 8000 overflows fp16 without it."""
    for factor in (1000.0, 8000.0):
        scaled = _scaled_residuals(source, factor)
        finite, outs = {}, {}
        for mode in (STOCK, FLASHNORM):
            model, _ = build_model(scaled, mode, dtype=dtype)
            outs[mode.name] = _forced(model, PROMPT, [9, 200])
            finite[mode.name] = mx.isfinite(outs[mode.name]).all().item()
        print(f"{dtype} x{factor:g}: finite {finite}")
        assert (
            finite["flashnorm"] or not finite["stock"]
        ), f"{dtype} x{factor}: {finite}"
        if dtype == mx.float32:
            rel = _rel(outs["flashnorm"], outs["stock"])
            assert rel < tiny.f32_tol(), f"x{factor}: float32 rel diff {rel:.3e}"


# --- longer contexts, batched (array) offsets, mlx-lm generation ------------------


def test_long_prompt_and_decode_past_256_positions(tmp_path):
    """A 300-token prompt, and 250 + 8 cached decode steps, against stock."""
    src = read_source(str(tiny.make_openelm(tmp_path / "m", "odd_unshared", seed=3)))
    prompt = np.random.default_rng(1).integers(0, tiny.VOCAB, 300).tolist()
    stock, _ = build_model(src, STOCK, dtype=mx.float32)
    flash, _ = build_model(src, FLASHNORM, dtype=mx.float32)
    ref, tokens = _greedy(stock, prompt[:250], 8)
    out = _forced(flash, prompt[:250], tokens)
    rel1 = _rel(out, ref)
    rel2 = _rel(flash(mx.array([prompt])), stock(mx.array([prompt])))
    print(f"rel diff: 250+8 cached {rel1:.2e}, 300 uncached {rel2:.2e}")
    assert rel1 < tiny.f32_tol() and rel2 < tiny.f32_tol(), f"{rel1:.3e} {rel2:.3e}"


def test_batched_cache_with_array_offsets_matches_stock(source):
    """mlx-lm's BatchKVCache: per-sequence mx.array offsets (left padding)."""
    pad = [0, 3]
    seqs = [PROMPT, [0] * pad[1] + PROMPT[: len(PROMPT) - pad[1]]]
    logits = {}
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(source, mode, dtype=mx.float32)
        cache = [BatchKVCache(pad) for _ in model.layers]
        rows = [model(mx.array(seqs), cache=cache)]
        rows.append(model(mx.array([[8], [21]]), cache=cache))
        logits[mode.name] = mx.concatenate(rows, axis=1)
    # Padded positions are masked out: compare the real ones only.
    rel = max(
        _rel(logits["flashnorm"][b, p:], logits["stock"][b, p:])
        for b, p in enumerate(pad)
    )
    print(f"batched rel diff {rel:.2e}")
    assert rel < tiny.f32_tol(), f"batched max rel diff {rel:.3e}"


def test_mlx_lm_stream_generate_runs_flashnorm(tmp_path):
    from mlx_lm import stream_generate

    path = tiny.make_openelm(tmp_path / "m", "shared", tokenizer=True)
    src = read_source(str(path))
    texts = {}
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(src, mode, dtype=mx.float32)
        responses = list(stream_generate(model, src.tokenizer, PROMPT, max_tokens=12))
        texts[mode.name] = [r.token for r in responses]
    assert texts["flashnorm"] == texts["stock"], texts


# --- the attention epilogue, unit level ------------------------------------------


def _rope_tol(offset: int) -> float:
    """Relative tolerance: 1e-6 on CPU, where the angles use mx.fast.rope's own
    float32 formula. Metal and CUDA compute the frequencies another way (exp2,
    fast cos): there allow 1e-5 plus the float32 rounding of an angle near
    `offset` radians."""
    if mx.default_device() == mx.cpu:
        return 1e-6
    return 1e-5 + 4 * offset * 2**-24


def _max_rel(out, ref):
    """max |out - ref| / max |ref| of one output (q', k' or v')."""
    return mx.abs(out - ref).max().item() / mx.abs(ref).max().item()


def _attention(head_dim, base, eps, hq=3, hkv=1, qk_norm=True, seed=0):
    cfg = dict(tiny.OPENELM_BASE, head_dim=head_dim, rope_freq_constant=base)
    cfg.update(rms_norm_eps=eps, num_query_heads=[hq], num_kv_heads=[hkv])
    cfg.update(normalize_qk_projections=qk_norm)
    attn = openelm.Attention(openelm.ModelArgs.from_dict(cfg), 0)
    if qk_norm:
        k = mx.random.split(mx.random.key(seed))
        attn.q_norm.weight = mx.random.uniform(0.25, 4.0, (head_dim,), key=k[0])
        attn.k_norm.weight = mx.random.uniform(0.25, 4.0, (head_dim,), key=k[1])
    return attn


def _epilogue(attn, qkv, ms, offset):
    """The model's epilogue call (Attention.__call__ minus the matmul and sdpa)."""
    return kernels.qkv_epilogue(qkv, ms, offset, attn.epilogue_args())


def _stock_qkv(attn, qkv, ms, offset: int, base):
    """Stock OpenELM on the normalized input: split, rms_norm, mx.fast.rope, and
    1/sqrt(h) (stock's sdpa scale) on q; x@W* times s is the normalized x @ W."""
    B, L, _ = qkv.shape
    hq, hkv, h = attn.n_heads, attn.n_kv_heads, attn.head_dim
    x = (qkv * mx.rsqrt(ms)).reshape(B, L, hq + 2 * hkv, h).transpose(0, 2, 1, 3)
    q, k, v = mx.split(x, [hq, hq + hkv], axis=1)
    if "q_norm" in attn:
        q = mx.fast.rms_norm(q, attn.q_norm.weight, attn.eps)
        k = mx.fast.rms_norm(k, attn.k_norm.weight, attn.eps)

    def rope(y):
        return mx.fast.rope(
            y, h, traditional=False, base=base, scale=1.0, offset=offset
        )

    return rope(q) * h**-0.5, rope(k), v


@pytest.mark.parametrize("head_dim,base", [(16, 10000.0), (10, 500000.0), (64, 1e4)])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_qk_norm"])
def test_attention_epilogue_equals_stock_norm_then_fast_rope(head_dim, base, qk_norm):
    """What Attention hands the epilogue (angles, gains with 1/sqrt(h), eps, or
    Llama's scale without QK-norm) reproduces stock's rms_norm of the
    normalized projections and mx.fast.rope, for int, scalar-array and per-batch
    offsets up to 20000. eps = 0.5 and ms over 1e-3..1e3, so the
    epsilon adjustment shows: dropping it (ms = 1) is visibly wrong."""
    eps, B, L = 0.5, 2, 5
    attn = _attention(head_dim, base, eps, qk_norm=qk_norm, seed=head_dim)
    half = head_dim // 2
    want_inv = mx.exp(mx.arange(half, dtype=mx.float32) * (-math.log(base) / half))
    assert mx.array_equal(attn._angles.inv_freq, want_inv), "not mx.fast.rope's formula"
    k = mx.random.split(mx.random.key(head_dim + qk_norm))
    qkv = mx.random.normal((B, L, 5 * head_dim), key=k[0]) * 3
    ms = mx.array(10.0 ** np.linspace(-3, 3, B * L, dtype=np.float32))
    ms = ms.reshape(B, L, 1)
    errs = {}
    for offset in (0, 1, 7, 255, 300, 4093, 20000):
        want = _stock_qkv(attn, qkv, ms, offset, base)
        tol = _rope_tol(offset)
        for kind, off in (
            ("int", offset),
            ("array", mx.array(offset)),
            ("batch", mx.array([offset] * B)),
        ):
            got = _epilogue(attn, qkv, ms, off)
            err = max(_max_rel(g, w) for g, w in zip(got, want))
            errs[(offset, kind)] = err
            assert err <= tol, f"offset {offset} ({kind}): {err:.2e} > {tol:.2e}"
        # Distinct per-sequence offsets: row b at offset + 3b.
        got = _epilogue(attn, qkv, ms, mx.array([offset, offset + 3]))
        want1 = _stock_qkv(attn, qkv, ms, offset + 3, base)
        err = max(
            max(_max_rel(g[0], w0[0]), _max_rel(g[1], w1[1]))
            for g, w0, w1 in zip(got, want, want1)
        )
        assert err <= tol, f"offsets [{offset}, {offset + 3}]: {err:.2e} > {tol:.2e}"
    print(
        f"h={head_dim} base={base} {qk_norm=}: max rel error {max(errs.values()):.2e}"
    )
    if qk_norm:  # the eliminated 1/RMS only enters through eps * ms
        naive = _epilogue(attn, qkv, mx.ones_like(ms), 7)[0]
        err = _max_rel(naive, _stock_qkv(attn, qkv, ms, 7, base)[0])
        assert err > 1e-2, f"dropping the eps adjustment should show: {err:.2e}"


def test_epilogue_gains_are_built_once_per_weight():
    """The gains (q's with 1/sqrt(h)) are float32 arrays made at first use and
    reused, not multiplied per token; new weights (load_weights, set_dtype)
    rebuild them."""
    h = 16
    attn = _attention(h, 10000.0, 1e-6)
    first = attn.epilogue_args()
    assert attn.epilogue_args().q_gain is first.q_gain
    assert first.q_gain.dtype == mx.float32 and first.k_gain.dtype == mx.float32
    assert mx.array_equal(first.q_gain, attn.q_norm.weight * h**-0.5)
    assert mx.array_equal(first.k_gain, attn.k_norm.weight)
    assert first.eps_q == first.eps_k == 1e-6 and first.scale is None
    attn.load_weights([("q_norm.weight", attn.q_norm.weight * 2)], strict=False)
    second = attn.epilogue_args()
    assert second.q_gain is not first.q_gain
    assert attn.epilogue_args().q_gain is second.q_gain
    assert mx.array_equal(second.q_gain, first.q_gain * 2)
    assert mx.array_equal(second.k_gain, first.k_gain)
    attn.set_dtype(mx.bfloat16)
    third = attn.epilogue_args()
    assert third.q_gain is not second.q_gain and third.q_gain.dtype == mx.float32
    want = attn.q_norm.weight.astype(mx.float32) * h**-0.5
    assert mx.array_equal(third.q_gain, want)
    # Without QK-norm: Llama mode, 1/sqrt(h) on q' (stock's sdpa scale).
    plain = _attention(h, 10000.0, 1e-6, qk_norm=False).epilogue_args()
    assert plain.scale == h**-0.5 and plain.q_gain is None and plain.bias is None


def test_model_calls_the_qkv_epilogue_once_per_layer(source, monkeypatch):
    """Attention = qkv matmul -> one kernels.qkv_epilogue call -> cache -> sdpa."""
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    calls = []
    real = kernels.qkv_epilogue

    def counting(qkv, ms, offset, e):
        mode = ["gains"] if e.q_gain is not None else ["scale"] * (e.scale is not None)
        calls.append((qkv.shape, e.n_heads, e.n_kv_heads, mode))
        return real(qkv, ms, offset, e)

    monkeypatch.setattr(kernels, "qkv_epilogue", counting)
    cache = make_prompt_cache(flash)
    out = [flash(mx.array([PROMPT]), cache=cache), flash(mx.array([[9]]), cache=cache)]
    cfg = source.config
    n = cfg["num_transformer_layers"]
    assert len(calls) == 2 * n, f"{len(calls)} epilogue calls for {n} layers x 2"
    mode = ["gains"] if cfg["normalize_qk_projections"] else ["scale"]
    for i, (shape, hq, hkv, kw) in enumerate(calls):
        layer = i % n
        assert (hq, hkv) == (cfg["num_query_heads"][layer], cfg["num_kv_heads"][layer])
        assert shape[-1] == (hq + 2 * hkv) * cfg["head_dim"], shape
        assert kw == mode, kw
    ref_cache = make_prompt_cache(stock)
    ref = [
        stock(mx.array([PROMPT]), cache=ref_cache),
        stock(mx.array([[9]]), cache=ref_cache),
    ]
    rel = _rel(mx.concatenate(out, axis=1), mx.concatenate(ref, axis=1))
    assert rel < tiny.f32_tol(), f"rel diff {rel:.3e}"


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
