"""Every architecture, every tiny config and RoPE kind its stock class supports:
one float32 check against stock mlx-lm, written once.

Reference: stock mlx-lm's own class for the config's model_type on the same
weights (`verify.compare`: a prompt, then cached greedy decode steps with
stock's tokens fed to both). Plain, Llama-3 and YaRN RoPE (which also scales its
input) take the fused epilogue; interleaved (traditional) pairs take the
unfused one, the model's own RoPE module, so both paths are compared with stock
here, for Llama (with biases too), Qwen2, Qwen3 and OpenELM.
"""

import mlx.core as mx
import pytest
import tiny
from tiny import PROMPT

from flashnorm_mlx import kernels, models
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK, STOCK_FUSED

STEPS = 12

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = tiny.LLAMA_CONFIGS["head_dim_llama3"]["rope_scaling"]
ROPES = {
    "plain": {},
    "llama3": dict(rope_scaling=LLAMA3),
    "yarn": dict(rope_scaling=YARN),
    "traditional": dict(rope_traditional=True),
}
# (builder, tiny config, RoPE kinds mlx-lm's class for it reads)
ARCHS = {
    "llama": (tiny.make_llama, "gqa_untied", ROPES),
    "llama-bias": (tiny.make_llama, "linear_bias", ["plain", "yarn", "traditional"]),
    "qwen2": (tiny.make_qwen, "qwen2", ROPES),
    # mlx-lm's Qwen3 has no traditional RoPE; eps 0.05 makes eps * ms matter.
    "qwen3": (tiny.make_qwen, "qwen3_tied", ["plain", "llama3", "yarn"]),
    "openelm": (tiny.make_openelm, "big_eps", ["plain"]),  # fixed half-split RoPE
}
CASES = [
    pytest.param(arch, rope, id=f"{arch}-{rope}")
    for arch, (_, _, ropes) in ARCHS.items()
    for rope in ropes
]


def _source(tmp_path, arch, rope):
    make, cfg, _ = ARCHS[arch]
    path = make(tmp_path, cfg, tokenizer=False)
    if ROPES[rope]:  # the same weights, the RoPE kind in the config
        import json

        config = json.loads((path / "config.json").read_text())
        config.update(ROPES[rope])
        (path / "config.json").write_text(json.dumps(config))
    return read_source(str(path))


# Every tiny config of every family as written (tests/tiny.py FAMILIES): shapes,
# heads, ties, biases, sliding windows, QK-norm epsilons; prompt plus 32 cached steps.
# Not the families whose own file verifies every config so, on both engines
# (test_dense.py, test_ministral3.py): their checks here were the same runs again.
OWN_VERIFY = ("phi3", "smollm3", "ministral3", "mistral3")


@pytest.mark.parametrize(
    "make,cfg", tiny.every_config(*(f for f in tiny.FAMILIES if f not in OWN_VERIFY))
)
def test_every_config_float32_matches_stock_over_32_decode_steps(tmp_path, make, cfg):
    source = read_source(str(make(tmp_path, cfg, tokenizer=False)))
    r = compare(source, PROMPT, horizon=32, dtype=mx.float32)
    print(f"{cfg}: rel {r['max_rel_logit_diff']:.2e}, KL max {r['kl_max']:.1e}")
    assert r["max_rel_logit_diff"] < tiny.f32_tol(), r
    assert r["greedy_match"] == 32, r
    assert r["stock_finite"] and r["flashnorm_finite"], r
    # KL grows as the square of the logit error: scaled with the float32 tolerance.
    assert r["kl_max"] < 1e-5 * (tiny.f32_tol() / 1e-4) ** 2, r


@pytest.mark.parametrize("arch,rope", CASES)
def test_float32_matches_stock(tmp_path, arch, rope, monkeypatch):
    source = _source(tmp_path, arch, rope)
    paths = []
    real = kernels.qkv_epilogue
    monkeypatch.setattr(
        kernels,
        "qkv_epilogue",
        lambda *a: paths.append(a[-1].inv_freq is None) or real(*a),
    )
    r = compare(source, PROMPT, horizon=STEPS, dtype=mx.float32)
    assert r["max_rel_logit_diff"] < tiny.f32_tol(), (arch, rope, r)
    assert r["greedy_match"] == STEPS, (arch, rope, r)
    # The path this case is meant to take, every layer, every step.
    unfused = rope == "traditional"
    assert paths and set(paths) == {unfused}, (arch, rope, set(paths))


@pytest.mark.parametrize(
    "arch,rope", [("llama", "yarn"), ("qwen3", "yarn"), ("llama", "traditional")]
)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_scaled_and_unfused_rope_low_precision_close_to_float32_stock(
    tmp_path, arch, rope, dtype
):
    """YaRN's input factor through the fused epilogue, interleaved RoPE through
    the model's own module: float16 and bfloat16 near float32 stock."""
    source = _source(tmp_path, arch, rope)
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=dtype)
    x = mx.array([PROMPT])
    r, f = ref(x), flash(x).astype(mx.float32)
    err = (mx.abs(f - r).max() / mx.abs(r).max()).item()
    assert mx.isfinite(f).all().item() and err < {mx.float16: 0.03}.get(dtype, 0.12)


@pytest.mark.parametrize(
    "make,cfg,quantized",
    [
        (tiny.make_llama, "gqa_untied", False),
        (tiny.make_llama, "linear_bias", False),
        (tiny.make_llama, "mistral_sliding", False),
        (tiny.make_qwen, "qwen3_tied", False),
        (tiny.make_openelm, "shared", False),
        (tiny.make_llama, "gqa_untied", True),
        (tiny.make_phi3, "phi3", False),
        (tiny.make_smollm3, "smollm3", False),
        (tiny.make_llama4_text, "llama4_text", False),
        (tiny.make_ministral3, "ministral3_mscale_sliding", False),
        (tiny.make_qwen3_5_moe, "qwen3_5", False),
        (tiny.make_qwen3_next, "untied", False),
        (tiny.make_lfm2, "lfm2", False),
        (tiny.make_lfm2_moe, "lfm2_moe", False),
        (tiny.make_glm4_moe, "glm4_moe", False),
        (tiny.make_deepseek_v3, "deepseek_v3", False),
        (tiny.make_nemotron_h, "nemotron_h", False),
        (tiny.make_granite4, "granitemoehybrid", False),
    ],
    ids=[
        "llama",
        "llama-bias",
        "mistral",
        "qwen3",
        "openelm",
        "llama-4bit",
        "phi3",
        "smollm3",
        "llama4_text",
        "ministral3",
        "qwen3_5_moe",
        "qwen3_next",
        "lfm2",
        "lfm2_moe",
        "glm4_moe",
        "deepseek_v3",
        "nemotron_h",
        "granitemoehybrid",
    ],
)
def test_stock_fused_is_stocks_function(tmp_path, make, cfg, quantized):
    """bench's stock_fused: q|k|v and gate|up stacked, the rest stock's: the
    same logits (float32, and on stored 4-bit weights), the same bytes."""
    from mlx.utils import tree_flatten

    source = read_source(str(make(tmp_path, cfg, tokenizer=False)))
    if quantized:
        source = tiny.quantized(source)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    fused, _ = build_model(source, STOCK_FUSED, dtype=mx.float32)
    x = mx.array([PROMPT])
    a, b = stock(x), fused(x)
    rel = (mx.abs(a - b).max() / mx.abs(a).max()).item()
    # OpenBLAS (blas.py) blocks a stacked matmul unlike its parts: float32
    # rounding (up to 1.1e-5 seen), where a wrong stack is off by O(1).
    assert rel < tiny.f32_tol(), rel
    nbytes = lambda m: sum(v.nbytes for _, v in tree_flatten(m.parameters()))
    assert nbytes(fused) == nbytes(stock)
    stacked = [n for n, m in fused.named_modules() if type(m).__name__ == "Stacked"]
    # Each layer's pairs of more than one part (OpenELM's, Phi-3's: fused
    # already; a hybrid layer's by its mixer; an MoE layer's experts' gate|up).
    arch, config = models.architecture(source.config), source.config
    want = sum(
        len([p for p in arch.layer_pairs(config, i) if len(p.parts) > 1])
        for i in range(len(stock.layers))
    )
    # Beside its pairs, an MoE layer stacks its experts' and shared experts' gate|up.
    moe = {tiny.make_qwen3_5_moe: 12, tiny.make_qwen3_next: 11, tiny.make_glm4_moe: 8}
    moe[tiny.make_deepseek_v3] = 8  # q_a|kv_a; a dense layer, two of experts
    want = moe.get(make, want)
    assert len(stacked) == want, stacked
