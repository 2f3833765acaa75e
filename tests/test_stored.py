"""Quantized checkpoints run as stored: FlashNorm vs stock mlx-lm on the same files.

Reference: stock mlx-lm's own loader (`mlx_lm.utils.load_model`) on checkpoints
that mlx-lm itself quantized (`mlx_lm.convert`), from tiny random models with
norm gains far from 1. FlashNorm runs the very same stored tensors, the norm
gains applied in its residual kernel (models/blocks.py), nothing requantized.
"""

import contextlib
import io
import json

import mlx.core as mx
import mlx.nn as nn
import pytest
import tiny
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from tiny import PROMPT, rel

from flashnorm_mlx import fold
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK
from flashnorm_mlx.quant import has_norm_gains

STEPS = 32

ARCHS = {
    "llama-gqa-untied": (tiny.make_llama, "gqa_untied"),
    "llama3-rope": (tiny.make_llama, "head_dim_llama3"),
    "llama-tied": (tiny.make_llama, "mha_tied"),
    "mistral-sliding": (tiny.make_llama, "mistral_sliding"),
    "qwen2-bias": (tiny.make_qwen, "qwen2"),
    "qwen3-untied": (tiny.make_qwen, "qwen3_untied"),
    "qwen3-tied": (tiny.make_qwen, "qwen3_tied"),
    "openelm-tied": (tiny.make_openelm, "shared"),
    "openelm-untied": (tiny.make_openelm, "quantizable_untied"),
    "gemma3-tied": (tiny.make_gemma3, "gemma3_tied"),
    "phi3-longrope": (tiny.make_phi3, "phi3_longrope"),
    "smollm3": (tiny.make_smollm3, "smollm3"),
    "llama4_text": (tiny.make_llama4_text, "llama4_text"),
    "llama4": (tiny.make_llama4, "llama4"),
    "ministral3": (tiny.make_ministral3, "ministral3"),
    "mistral3-vision": (tiny.make_mistral3, "mistral3_vision"),
    "qwen3_5": (tiny.make_qwen3_5, "qwen3_5"),
    "qwen3_5_moe-tied": (tiny.make_qwen3_5_moe, "qwen3_5_tied"),
    "qwen3_next": (tiny.make_qwen3_next, "untied"),
    "lfm2-bias": (tiny.make_lfm2, "lfm2_bias"),
    "lfm2_moe": (tiny.make_lfm2_moe, "lfm2_moe"),
    "glm4_moe": (tiny.make_glm4_moe, "glm4_moe"),
    "deepseek_v3": (tiny.make_deepseek_v3, "deepseek_v3"),
    "nemotron_h": (tiny.make_nemotron_h, "nemotron_h_moe"),
    "granitemoehybrid": (tiny.make_granite4, "granitemoehybrid"),
}


def _embedding_affine(path, module):
    # MLX dequantizes an mxfp4 embedding to bfloat16, which would make the whole
    # stock model bfloat16; an affine embedding keeps float32 activations, so
    # the mxfp4 linears are checked at float32's tolerance.
    if isinstance(module, nn.Embedding):
        return {"group_size": 32, "bits": 8, "mode": "affine"}
    return True


QUANTS = {
    "4bit-g64": dict(q_bits=4, q_group_size=64),
    "8bit-g32": dict(q_bits=8, q_group_size=32),
    "mxfp4": dict(
        q_bits=4, q_group_size=32, q_mode="mxfp4", quant_predicate=_embedding_affine
    ),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny float checkpoints in Hugging Face layout, with a tokenizer (mlx-lm's
    convert loads one) and without rotary buffers (mlx-lm's Qwen3 refuses them)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (make, cfg) in ARCHS.items():
        path = make(root / name, cfg, tokenizer=True)
        weights = {
            k: v
            for k, v in mx.load(str(path / "model.safetensors")).items()
            if "rotary_emb" not in k
        }
        mx.save_safetensors(str(path / "model.safetensors"), weights)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def quantized(hf_dirs, tmp_path_factory):
    """(arch, quant) -> a folder quantized by mlx-lm's own convert."""
    from mlx_lm.convert import convert

    root = tmp_path_factory.mktemp("mlxq")
    cache = {}

    def get(arch, quant):
        if (arch, quant) not in cache:
            out = root / f"{arch}-{quant}"
            with contextlib.redirect_stdout(io.StringIO()):
                convert(str(hf_dirs[arch]), str(out), quantize=True, **QUANTS[quant])
            cache[arch, quant] = out
        return cache[arch, quant]

    return get


def _run(models, steps=STEPS):
    """Logits of a prompt and `steps` cached greedy steps (stock's tokens fed to
    every model), float32, per model; plus how many leading steps agree."""
    caches = [make_prompt_cache(m) for m in models]
    x = mx.array([PROMPT])
    rows = [[] for _ in models]
    agree, diverged = 0, False
    for _ in range(steps + 1):
        outs = [m(x, cache=c)[0].astype(mx.float32) for m, c in zip(models, caches)]
        for r, o in zip(rows, outs):
            r.append(o)
        picks = [mx.argmax(o[-1]).item() for o in outs]
        diverged = diverged or len(set(picks)) > 1
        agree += not diverged
        x = mx.array([[picks[0]]])
    return [mx.concatenate(r) for r in rows], min(agree, steps)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_matches_stock_on_the_same_quantized_files(quantized, arch, quant):
    path = quantized(arch, quant)
    if arch == "granitemoehybrid" and quant == "mxfp4":  # design 2r: as stock
        from flashnorm_mlx import models

        config = read_source(str(path), need_tokenizer=False).config
        assert models.run_mode(config) is STOCK, config
        return
    stock, _ = load_model(path)
    source = read_source(str(path), need_tokenizer=False)
    flash, config = build_model(source, FLASHNORM, dtype=mx.float32)
    assert has_norm_gains(config), config.get(fold.MARKER)
    # Nothing requantized or cast: every quantized tensor is the file's own.
    params = dict(tree_flatten(flash.parameters()))
    packed = [k for k in source.weights if k.endswith(".scales")]
    assert packed and all(
        (p := _fused_name(k, params)) is not None
        and params[p].dtype == source.weights[k].dtype
        for k in packed
    ), packed
    (ls, lf), agree = _run([stock, flash])
    err = rel(lf, ls)
    assert err < tiny.f32_tol(), f"{arch} {quant}: rel {err:.3e}"
    assert agree == STEPS, f"{arch} {quant}: greedy {agree}/{STEPS}"


def _fused_name(key, params):
    """The parameter a file's `<linear>.scales` became (q|k|v and gate|up fused)."""
    if key in params:
        return key
    for part, fused in (
        ("self_attn.q_proj", "self_attn.qkv_proj"),
        ("self_attn.k_proj", "self_attn.qkv_proj"),
        ("self_attn.v_proj", "self_attn.qkv_proj"),
        ("mlp.gate_proj", "mlp.gate_up_proj"),
        ("mlp.up_proj", "mlp.gate_up_proj"),
        # Qwen3.5: the DeltaNet's four inputs, the experts' and shared expert's
        # gate|up, the shared gate's row beside the router's.
        *(
            (f"linear_attn.in_proj_{p}", "linear_attn.in_proj")
            for p in "qkv z b a".split()
        ),
        ("linear_attn.in_proj_qkvz", "linear_attn.in_proj"),  # Qwen3-Next's two
        ("linear_attn.in_proj_ba", "linear_attn.in_proj"),
        ("switch_mlp.gate_proj", "switch_mlp.gate_up_proj"),
        ("switch_mlp.up_proj", "switch_mlp.gate_up_proj"),
        ("experts.gate_proj", "experts.gate_up_proj"),  # Llama 4's
        ("experts.up_proj", "experts.gate_up_proj"),
        ("shared_expert.gate_proj", "shared_expert.gate_up_proj"),
        ("shared_expert.up_proj", "shared_expert.gate_up_proj"),
        ("shared_experts.gate_proj", "shared_experts.gate_up_proj"),  # GLM's
        ("shared_experts.up_proj", "shared_experts.gate_up_proj"),
        ("self_attn.q_a_proj", "self_attn.q_kv_a_proj"),  # DeepSeek V3's latents
        ("self_attn.kv_a_proj_with_mqa", "self_attn.q_kv_a_proj"),
        ("mlp.shared_expert_gate", "mlp.gate"),
        # LFM2's names (models/lfm2.py `_OURS`): w1|w3 fused, w2 and out_proj renamed.
        ("feed_forward.w1", "feed_forward.gate_up_proj"),
        ("feed_forward.w3", "feed_forward.gate_up_proj"),
        ("feed_forward.w2", "feed_forward.down_proj"),
        ("feed_forward.gate_proj", "feed_forward.gate_up_proj"),
        ("feed_forward.up_proj", "feed_forward.gate_up_proj"),
        ("self_attn.out_proj", "self_attn.o_proj"),
        # Granite 4's shared GLU, inside our MoE block (gate|up as stored).
        ("shared_mlp.input_linear", "block_sparse_moe.shared_mlp.gate_up_proj"),
        ("shared_mlp.output_linear", "block_sparse_moe.shared_mlp.down_proj"),
        # Nemotron-H's attention: q|k|v fused under its `mixer`.
        *((f"mixer.{p}_proj", "mixer.qkv_proj") for p in "qkv"),
    ):
        if part in key and key.replace(part, fused) in params:
            return key.replace(part, fused)
    return None


# Stated tolerances, max |logit diff| / max |logit| against stock float32 on the
# same files (as tests/test_llama.py for float weights).
LOW_PRECISION_TOL = {mx.float16: 0.03, mx.bfloat16: 0.12}


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("arch", ["llama-gqa-untied", "qwen3-tied", "openelm-untied"])
def test_low_precision_close_to_float32_stock(quantized, arch, dtype):
    source = read_source(str(quantized(arch, "4bit-g64")), need_tokenizer=False)
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=dtype)
    flash, _ = build_model(source, FLASHNORM, dtype=dtype)
    x = mx.array([PROMPT])
    r = ref(x)
    err_s = rel(stock(x).astype(mx.float32), r)
    lf = flash(x).astype(mx.float32)
    err_f = rel(lf, r)
    assert mx.isfinite(lf).all().item(), arch
    assert err_f < LOW_PRECISION_TOL[dtype], f"flashnorm {err_f:.3e}, stock {err_s:.3e}"


def test_float16_survives_residuals_x1000(quantized):
    """fp16 range: with embeddings 1000x larger, x @ W would overflow; the
    power-of-two prescale rides with the gain in xs."""
    source = read_source(
        str(quantized("llama-gqa-untied", "8bit-g32")), need_tokenizer=False
    )
    w = dict(source.weights)
    emb = "model.embed_tokens"
    for s in ("scales", "biases"):  # affine: w = scale * q + bias, so x1000 exactly
        w[f"{emb}.{s}"] = w[f"{emb}.{s}"] * 1000
    big = type(source)(source.name, source.config, w)
    flash, _ = build_model(big, FLASHNORM, dtype=mx.float16)
    ref, _ = build_model(big, STOCK, dtype=mx.float32)
    (lf, lr), _ = _run([flash, ref], steps=4)
    assert mx.isfinite(lf).all().item()
    assert rel(lf, lr) < LOW_PRECISION_TOL[mx.float16], rel(lf, lr)


def test_same_bytes_and_the_gains_are_the_checkpoints(quantized):
    """FlashNorm holds what stock holds: the same parameter bytes, the norm gains
    under their checkpoint names (applied in the kernels, never folded)."""
    path = quantized("llama-gqa-untied", "4bit-g64")
    source = read_source(str(path), need_tokenizer=False)
    stock, _ = build_model(source, STOCK)
    flash, _ = build_model(source, FLASHNORM)
    nbytes = lambda m: sum(v.nbytes for _, v in tree_flatten(m.parameters()))
    assert nbytes(flash) == nbytes(stock), (nbytes(flash), nbytes(stock))
    g = flash.model.layers[1].input_layernorm.weight
    assert mx.array_equal(g, source.weights["model.layers.1.input_layernorm.weight"])
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4


def test_the_gain_in_the_kernel_is_what_makes_it_exact(quantized, monkeypatch):
    """Break it on purpose: a residual that drops the gain is off by far more
    than the tolerance (the gains are random in [0.25, 4])."""
    from flashnorm_mlx import kernels

    source = read_source(
        str(quantized("llama-gqa-untied", "4bit-g64")), need_tokenizer=False
    )
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    real = kernels.block_residual.residual_ops
    monkeypatch.setattr(
        kernels.block_residual,
        "residual_ops",
        lambda h, y, ms_y, eps, gain=None: real(h, y, ms_y, eps),
    )
    x = mx.array([PROMPT])
    assert rel(flash(x), stock(x)) > 1e-2


def test_perplexity_runs_both_on_the_stored_weights(quantized):
    """perplexity's default on a quantized checkpoint: the same stored weights on
    both sides, so equal bits per weight and the same perplexity."""
    from flashnorm_mlx.jobs.likelihood import perplexity
    from flashnorm_mlx.texts import default_text

    source = read_source(str(quantized("qwen3-tied", "4bit-g64")))
    r = perplexity(
        source, text=default_text()[:2000], seq_len=32, num_seqs=4, dtype=mx.float32
    )
    assert r["stock_method"] == r["flashnorm_method"] == "stored", r
    assert r["stock_bits_per_weight"] == r["flashnorm_bits_per_weight"], r
    assert abs(r["diff_rel"]) < 1e-5, r


def test_quantize_as_mlx_lm_script_makes_a_stored_checkpoint(hf_dirs, tmp_path):
    """scripts/quantize-as-mlx-lm.py (gpu-bench's 4-bit rows): mlx-lm's own
    quantization, which FlashNorm then runs as stored, equal to stock."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "quantize-as-mlx-lm.py"
    out = tmp_path / "q"
    r = subprocess.run(
        [sys.executable, str(script), str(hf_dirs["llama-gqa-untied"]), str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    source = read_source(str(out))
    assert source.config["quantization"]["bits"] == 4, source.config
    stock, _ = load_model(out)
    flash, config = build_model(source, FLASHNORM, dtype=mx.float32)
    assert has_norm_gains(config)
    (ls, lf), agree = _run([stock, flash], steps=4)
    assert rel(lf, ls) < tiny.f32_tol() and agree == 4
