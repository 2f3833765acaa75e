"""Tiny random models in Hugging Face layout, written to disk like real checkpoints.

Norm gains are random in [0.25, 4] (far from 1), so a fold that is wrong shows.
"""

import functools
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

VOCAB = 300  # >= the byte-level tokenizer below (256 bytes + specials)
# The token ids the model tests feed: repeats (7, 7) and ids across the vocabulary.
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 180, 64, 11, 2]


def rel(a, b) -> float:
    """max |a - b| / max |b|, in float32: the tests' relative error against a
    reference `b`."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


LLAMA_BASE = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)

# A spread of Llama shapes: GQA/MHA, tied/untied, odd widths, explicit head_dim,
# llama3 and linear rope scaling, biases, Mistral's sliding window.
LLAMA_CONFIGS = {
    "gqa_untied": {},
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "odd_sizes": dict(
        hidden_size=40,
        num_attention_heads=5,
        num_key_value_heads=1,
        intermediate_size=72,
        num_hidden_layers=3,
    ),
    "head_dim_llama3": dict(
        head_dim=24,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "linear_bias": dict(
        attention_bias=True,
        mlp_bias=True,
        rope_scaling={"type": "linear", "factor": 2.0},
    ),
    # Every other layer attends to the last 5 positions only (RotatingKVCache).
    "mistral_sliding": dict(
        model_type="mistral",
        num_hidden_layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}


def _gain(rng, n):
    return rng.uniform(0.25, 4.0, size=(n,)).astype(np.float32)


def _lin(rng, out, inp):
    return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)


def llama_weights(cfg: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    h = cfg.get("head_dim") or D // hq
    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
        "model.norm.weight": _gain(rng, D),
    }
    if not cfg.get("tie_word_embeddings", True):
        w["lm_head.weight"] = _lin(rng, V, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = _gain(rng, D)
        w[f"{p}.post_attention_layernorm.weight"] = _gain(rng, D)
        for n, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
            w[f"{p}.self_attn.{n}_proj.weight"] = _lin(rng, out, D)
            if cfg.get("attention_bias"):
                w[f"{p}.self_attn.{n}_proj.bias"] = (
                    rng.standard_normal(out).astype(np.float32) * 0.1
                )
        w[f"{p}.self_attn.o_proj.weight"] = _lin(rng, D, hq * h)
        if cfg.get("attention_bias"):
            w[f"{p}.self_attn.o_proj.bias"] = (
                rng.standard_normal(D).astype(np.float32) * 0.1
            )
        for n, (o, i_) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            w[f"{p}.mlp.{n}_proj.weight"] = _lin(rng, o, i_)
            if cfg.get("mlp_bias"):
                w[f"{p}.mlp.{n}_proj.bias"] = (
                    rng.standard_normal(o).astype(np.float32) * 0.1
                )
        # A precomputed rotary buffer, as some HF checkpoints carry; must be ignored.
        w[f"{p}.self_attn.rotary_emb.inv_freq"] = np.ones(h // 2, np.float32)
    return w


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (no merges) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(sorted(byte_vocab))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": template,
            }
        )
    )


def write_model(
    path: Path, config: dict, weights: dict, tokenizer: bool = True
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    if tokenizer:
        write_tokenizer(path)
    return path


def llama_config(name: str) -> dict:
    return {**LLAMA_BASE, **LLAMA_CONFIGS[name]}


def make_llama(
    path: Path, name: str = "gqa_untied", seed: int = 0, tokenizer: bool = True
) -> Path:
    cfg = llama_config(name)
    return write_model(path, cfg, llama_weights(cfg, seed), tokenizer)


# --- Qwen2 (q/k/v biases) and Qwen3 (QK-norm), Llama's weight names -------------

QWEN_CONFIGS = {
    "qwen2": dict(
        model_type="qwen2",
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_window_layers=2,
        use_sliding_window=False,
    ),
    "qwen3_untied": dict(
        model_type="qwen3", head_dim=24, tie_word_embeddings=False, rope_theta=1e6
    ),
    "qwen3_tied": dict(
        model_type="qwen3",
        head_dim=16,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=0.05,  # large: the QK-norm epsilon adjustment must matter
    ),
}


def qwen_config(name: str) -> dict:
    return {**LLAMA_BASE, **QWEN_CONFIGS[name]}


def make_qwen(
    path: Path, name: str = "qwen3_untied", seed: int = 0, tokenizer: bool = True
) -> Path:
    cfg = qwen_config(name)
    w = llama_weights(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = cfg.get("head_dim") or cfg["hidden_size"] // hq
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn"
        if cfg["model_type"] == "qwen2":  # biases far from 0, either sign
            for n, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
                sign = rng.choice([-1.0, 1.0], size=out)
                w[f"{p}.{n}_proj.bias"] = (sign * rng.uniform(0.5, 2.0, out)).astype(
                    np.float32
                )
        else:
            w[f"{p}.q_norm.weight"] = _gain(rng, h)
            w[f"{p}.k_norm.weight"] = _gain(rng, h)
    return write_model(path, cfg, w, tokenizer)


# --- Gemma 3 (gemma3_text): gains 1 + w, sandwich norms, local/global layers -------

GEMMA3_BASE = dict(
    model_type="gemma3_text",
    hidden_size=64,
    num_hidden_layers=6,  # two whole local, local, global patterns
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    query_pre_attn_scalar=24,  # not head_dim: the attention scale must come from it
    sliding_window=6,  # shorter than the tests' prompts and decodes
    sliding_window_pattern=3,
    max_position_embeddings=512,
)

GEMMA3_CONFIGS = {
    # Global layers with linear RoPE scaling, as Gemma 3 1B ships.
    "gemma3_tied": dict(rope_scaling={"rope_type": "linear", "factor": 8.0}),
    # Untied (the final norm folds into the head), a large eps (the post-norm's
    # and QK-norm's epsilon adjustments matter), no rope scaling: null, with
    # the other keys Gemma 3's own configs carry.
    "gemma3_untied": dict(
        tie_word_embeddings=False,
        rms_norm_eps=0.05,
        rope_scaling=None,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        attention_bias=False,
        layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
    ),
}


def _gemma_w(rng, n):
    """Stored w of a gain 1 + w: w far from 0, a few near -1 (gain near 0)."""
    w = rng.uniform(-0.75, 3.0, size=(n,))
    w[rng.choice(n, size=max(1, n // 8), replace=False)] = -0.97
    return w.astype(np.float32)


def gemma3_config(name: str) -> dict:
    return {**GEMMA3_BASE, **GEMMA3_CONFIGS[name]}


def gemma3_weights(cfg: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w = {
        # Stock scales the embedding by sqrt(D): keep the residual near unit RMS.
        "model.embed_tokens.weight": (rng.standard_normal((V, D)) / np.sqrt(D)).astype(
            np.float32
        ),
        "model.norm.weight": _gemma_w(rng, D),
    }
    if not cfg.get("tie_word_embeddings", True):
        w["lm_head.weight"] = _lin(rng, V, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            w[f"{p}.{n}.weight"] = _gemma_w(rng, D)
        for n, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
            w[f"{p}.self_attn.{n}_proj.weight"] = _lin(rng, out, D)
        w[f"{p}.self_attn.q_norm.weight"] = _gemma_w(rng, h)
        w[f"{p}.self_attn.k_norm.weight"] = _gemma_w(rng, h)
        w[f"{p}.self_attn.o_proj.weight"] = _lin(rng, D, hq * h)
        for n, (o, i_) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            w[f"{p}.mlp.{n}_proj.weight"] = _lin(rng, o, i_)
    return w


def make_gemma3(
    path: Path, name: str = "gemma3_tied", seed: int = 0, tokenizer: bool = True
) -> Path:
    cfg = gemma3_config(name)
    return write_model(path, cfg, gemma3_weights(cfg, seed), tokenizer)


# --- OpenELM (Apple's Hugging Face layout, as mlx-lm's openelm reads it) -------

OPENELM_BASE = dict(
    model_type="openelm",
    model_dim=48,
    head_dim=8,
    num_transformer_layers=3,
    num_query_heads=[4, 6, 8],
    num_kv_heads=[1, 2, 2],
    ffn_multipliers=[0.5, 1.25, 2.0],
    ffn_dim_divisor=8,
    ffn_with_glu=True,
    normalize_qk_projections=True,
    share_input_output_layers=True,
    rope_freq_constant=10000,
    rope_max_length=4096,
    vocab_size=VOCAB,
    # Apple's configs carry no rms_norm_eps (mlx-lm defaults to 1e-6).
)

# Per-layer head counts and FFN widths vary in all of them; odd widths, an
# untied head, a large eps (so the QK-norm epsilon adjustment matters), no QK-norm.
OPENELM_CONFIGS = {
    "shared": {},
    "odd_unshared": dict(
        model_dim=40,
        head_dim=10,
        num_query_heads=[5, 3, 4, 2],
        num_kv_heads=[5, 1, 2, 1],
        ffn_multipliers=[0.7, 1.9, 1.1, 3.0],
        num_transformer_layers=4,
        ffn_dim_divisor=4,
        share_input_output_layers=False,
        rope_freq_constant=500000,
    ),
    "big_eps": dict(
        rms_norm_eps=0.1,
        head_dim=12,
        num_query_heads=[2, 4, 6],
        num_kv_heads=[2, 2, 3],
        ffn_multipliers=[1.0, 0.5, 4.0],
    ),
    # Widths that 32- and 64-wide quantization groups divide, untied head.
    "quantizable_untied": dict(
        model_dim=64,
        head_dim=16,
        num_query_heads=[6, 8, 10],
        num_kv_heads=[3, 4, 5],
        ffn_multipliers=[0.5, 2.0, 1.0],
        ffn_dim_divisor=32,
        share_input_output_layers=False,
    ),
    "no_qk_norm": dict(
        normalize_qk_projections=False,
        num_transformer_layers=2,
        num_query_heads=[3, 6],
        num_kv_heads=[1, 3],
        ffn_multipliers=[2, 1],
    ),
}


def openelm_config(name: str) -> dict:
    return {**OPENELM_BASE, **OPENELM_CONFIGS[name]}


def _openelm_ffn_dim(cfg: dict, i: int) -> int:
    from mlx_lm.models.openelm import make_divisible

    return int(
        make_divisible(
            cfg["ffn_multipliers"][i] * cfg["model_dim"], divisor=cfg["ffn_dim_divisor"]
        )
    )


def openelm_weights(cfg: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    D, V, h = cfg["model_dim"], cfg["vocab_size"], cfg["head_dim"]
    w = {
        "transformer.token_embeddings.weight": rng.standard_normal((V, D)).astype(
            np.float32
        ),
        "transformer.norm.weight": _gain(rng, D),
    }
    if not cfg.get("share_input_output_layers", True):
        w["lm_head.weight"] = _lin(rng, V, D)
    for i in range(cfg["num_transformer_layers"]):
        p = f"transformer.layers.{i}"
        hq, hkv, F = (
            cfg["num_query_heads"][i],
            cfg["num_kv_heads"][i],
            _openelm_ffn_dim(cfg, i),
        )
        w[f"{p}.attn_norm.weight"] = _gain(rng, D)
        w[f"{p}.ffn_norm.weight"] = _gain(rng, D)
        w[f"{p}.attn.qkv_proj.weight"] = _lin(rng, (hq + 2 * hkv) * h, D)
        if cfg.get("normalize_qk_projections", True):
            w[f"{p}.attn.q_norm.weight"] = _gain(rng, h)
            w[f"{p}.attn.k_norm.weight"] = _gain(rng, h)
        w[f"{p}.attn.out_proj.weight"] = _lin(rng, D, hq * h)
        w[f"{p}.ffn.proj_1.weight"] = _lin(rng, 2 * F, D)
        w[f"{p}.ffn.proj_2.weight"] = _lin(rng, D, F)
    return w


def make_openelm(
    path: Path, name: str = "shared", seed: int = 0, tokenizer: bool = False
) -> Path:
    """Apple's OpenELM repos ship no tokenizer, so none is written by default."""
    cfg = openelm_config(name)
    return write_model(path, cfg, openelm_weights(cfg, seed), tokenizer)


# --- Phi-3 (fused qkv_proj, gate_up_proj) and SmolLM3 (NoPE layers), Llama's shape --

# Phi-3: untied with plain RoPE (the fused epilogue); tied, 3/4 of the head
# rotated, longrope past its original length; full-rotary su past it too
# (SuScaledRoPE scales its input there): the model's own RoPE module, both.
_LONG = [1.0, 1.5, 2.0, 3.5, 5.0, 8.0, 13.0, 21.0]
PHI3_CONFIGS = {
    "phi3": dict(model_type="phi3", num_key_value_heads=2),
    "phi3_longrope": dict(
        model_type="phi3",
        partial_rotary_factor=0.75,  # head 16: 12 dims rotated, 6 factors
        rope_scaling=dict(
            type="longrope", short_factor=[1.0] * 6, long_factor=_LONG[:6]
        ),
        max_position_embeddings=4096,
        original_max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "phi3_su_full": dict(
        model_type="phi3",
        rope_scaling=dict(type="su", short_factor=[1.0] * 8, long_factor=_LONG),
        max_position_embeddings=2048,
        original_max_position_embeddings=128,
    ),
}
# SmolLM3: 4 layers, the last without RoPE (every 4th, stock's default); and
# an explicit no_rope_layers list, tied.
SMOLLM3_CONFIGS = {
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4),
    "smollm3_listed": dict(
        model_type="smollm3",
        num_hidden_layers=3,
        no_rope_layers=[0, 1, 0],
        tie_word_embeddings=True,
    ),
}


def make_phi3(path: Path, name: str = "phi3", seed: int = 0, tokenizer: bool = True):
    """Llama's tiny weights with q|k|v and gate|up stored fused, as Phi-3 ships."""
    cfg = {**LLAMA_BASE, **PHI3_CONFIGS[name]}
    w = llama_weights(cfg, seed)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for fused, parts in (
            (
                "self_attn.qkv_proj",
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ),
            ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            w[f"{p}.{fused}.weight"] = np.concatenate(
                [w.pop(f"{p}.{n}.weight") for n in parts]
            )
        w.pop(f"{p}.self_attn.rotary_emb.inv_freq")
    return write_model(path, cfg, w, tokenizer)


def make_smollm3(
    path: Path, name: str = "smollm3", seed: int = 0, tokenizer: bool = True
):
    cfg = {**LLAMA_BASE, **SMOLLM3_CONFIGS[name]}
    return write_model(path, cfg, llama_weights(cfg, seed), tokenizer)


# --- a quantized checkpoint, as mlx-lm or a GGUF stores it --------------------------


def quantized(source, bits: int = 4, group_size: int = 32):
    """`source` (a loading.Source) stored pre-quantized: every 2-D weight whose
    width the group size divides as (weight, scales, biases), but a router
    mlx-lm keeps float (GLM's), the config with its quantization block."""
    from flashnorm_mlx import models
    from flashnorm_mlx.loading import Source

    moe = (
        models.architecture(source.config).moe
        if models.is_covered(source.config)
        else None
    )
    kept = f".{moe.router}.weight" if moe and moe.router_float else None
    w = {}
    for k, v in source.weights.items():
        if kept and k.endswith(kept):
            w[k] = v
        elif k.endswith(".weight") and v.ndim == 2 and v.shape[-1] % group_size == 0:
            m = k[: -len(".weight")]
            w[k], w[f"{m}.scales"], w[f"{m}.biases"] = mx.quantize(
                mx.array(v), group_size=group_size, bits=bits
            )
        else:
            w[k] = v
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    return Source(source.name, {**source.config, "quantization": q}, w)


def mlx_q4(folder, out: Path):
    """mlx-lm's own `convert -q` (4 bits, groups of 32; a family's
    quant_predicate, e.g. an 8-bit router, as it says) of `folder` into `out`,
    read back as a checkpoint: the quantized source "as stored" tests take."""
    from mlx_lm.convert import convert as mlx_convert

    from flashnorm_mlx.loading import read_source

    mlx_convert(str(folder), str(out), quantize=True, q_group_size=32, q_bits=4)
    return read_source(str(out))


def compat_errors(source, out: Path, prompt) -> dict:
    """`convert --compat` of `source` into `out`, then the relative logit error
    on `prompt` against stock on `source` of mlx-lm's own `load_model` and of
    ours on that checkpoint: {who: error}."""
    from mlx_lm.utils import load_model

    from flashnorm_mlx.jobs.checkpoint import convert
    from flashnorm_mlx.loading import build_model, read_source
    from flashnorm_mlx.modes import FLASHNORM, STOCK

    convert(source, out, compat=True, progress=False)
    stock_on_compat, _ = load_model(out)
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    ours, _ = build_model(read_source(str(out)), FLASHNORM, dtype=mx.float32)
    x = mx.array([prompt])
    return {
        "mlx-lm on --compat": rel(stock_on_compat(x), ref(x)),
        "flashnorm on --compat": rel(ours(x), ref(x)),
    }


# --- float32 tolerance on this device ---------------------------------------------


@functools.cache
def stock_float32_error() -> float:
    """Stock mlx-lm's own float32 error on this device: max |logit difference| /
    max |logit| of a tiny random Llama run on the default device against the same
    model on the CPU stream (IEEE float32 matmuls). 0 on a CPU-only build; on
    CUDA, MLX's float32 matmuls may run in TF32 and this is how much that costs."""
    if mx.default_device() == mx.cpu:
        return 0.0
    import tempfile

    from mlx_lm.utils import load_model

    path = make_llama(Path(tempfile.mkdtemp(prefix="f32ref-")), tokenizer=False)
    model, _ = load_model(path)
    tokens = mx.array([[5, 17, 99, 3, 250, 42, 7, 7, 180, 64, 11, 2]])
    here = model(tokens)
    with mx.stream(mx.cpu):
        ref = model(tokens)
    return (mx.abs(here - ref).max() / mx.abs(ref).max()).item()


def bench_launches(source, label: str = "") -> dict:
    """bench's quickest run on `source` (6 prompt tokens, 3 decoded, one round),
    as every family's test runs it: every row's logits finite, and FlashNorm
    launching fewer kernels a decode step (the GPU model: each mx.fast op and
    kernel one launch) than stock and stock_fused. Returns bench's result."""
    from flashnorm_mlx.jobs import speed

    r = speed.run_bench(source, prompt_tokens=6, gen_tokens=3, trials=1)
    v = r["variants"]
    assert all(v[n]["logits_finite"] and v[n]["all_trials_finite"] for n in v), v
    gpu = {n: v[n]["dispatches_per_token_gpu_model"] for n in v}
    print(label, "launches per decode step:", gpu)
    assert gpu["flashnorm"] < min(gpu["stock"], gpu["stock_fused"]), gpu
    return r


def shard_tol() -> float:
    """Two ranks against one process, float32: each rank's matmuls are half as
    wide, and an optimized BLAS (OpenBLAS, blas.py) blocks them otherwise, so
    they agree to rounding (1.2e-5 seen; under 1e-5 on the reference BLAS). A
    wrong cut is off by far more."""
    return f32_tol(5e-5)


def f32_tol(base: float = 1e-4) -> float:
    """Relative float32 tolerance for FlashNorm vs stock: `base` where float32 is
    IEEE float32 (CPU, Metal); where the device's float32 matmuls are less exact,
    4x stock's own measured error, since FlashNorm's matmuls have the same sizes
    and both sides carry their own error."""
    return max(base, 4 * stock_float32_error())


# --- Qwen3-MoE (mixture of experts): Hugging Face's per-expert weight names ---------

QWEN3_MOE = dict(
    model_type="qwen3_moe",
    head_dim=16,
    num_hidden_layers=3,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=64,  # two groups of 32: a 4-bit down splits over 2 ranks
    decoder_sparse_step=1,
    mlp_only_layers=[1],  # a dense layer between two sparse ones
    norm_topk_prob=True,
    rope_theta=1e6,
    tie_word_embeddings=False,
)


def qwen3_moe_config(**over) -> dict:
    return {**LLAMA_BASE, **QWEN3_MOE, **over}


def make_qwen3_moe(path: Path, seed: int = 0, tokenizer: bool = True, **over) -> Path:
    """Routers with large weights (logits far apart, so routing visibly depends
    on the token), expert weights of their own scale, the dense layer's MLP
    on `intermediate_size`."""
    cfg = qwen3_moe_config(**over)
    w = llama_weights(cfg, seed)
    rng = np.random.default_rng(seed + 2)
    D, E, F = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    h = cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        del w[f"{p}.self_attn.rotary_emb.inv_freq"]  # mlx-lm's sanitize keeps it
        w[f"{p}.self_attn.q_norm.weight"] = _gain(rng, h)
        w[f"{p}.self_attn.k_norm.weight"] = _gain(rng, h)
        if i in cfg["mlp_only_layers"] or (i + 1) % cfg["decoder_sparse_step"]:
            continue
        for n in ("gate", "up", "down"):
            del w[f"{p}.mlp.{n}_proj.weight"]
        w[f"{p}.mlp.gate.weight"] = 4 * _lin(rng, E, D)
        for e in range(E):
            for n, (o, i_) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
                w[f"{p}.mlp.experts.{e}.{n}_proj.weight"] = _lin(rng, o, i_)
    return write_model(path, cfg, w, tokenizer)


# --- Mixtral (experts in every layer, `block_sparse_moe`, w1/w3/w2 per expert) -------

MIXTRAL = dict(
    model_type="mixtral",
    num_local_experts=5,
    num_experts_per_tok=2,
    intermediate_size=64,
    rope_theta=1e6,
    tie_word_embeddings=False,
)


def mixtral_config(**over) -> dict:
    return {**LLAMA_BASE, **MIXTRAL, **over}


def make_mixtral(path: Path, seed: int = 0, tokenizer: bool = True, **over) -> Path:
    """Routers with large weights (routing visibly depends on the token),
    Hugging Face's per-expert names (w1 gate, w3 up, w2 down)."""
    cfg = mixtral_config(**over)
    w = llama_weights(cfg, seed)
    rng = np.random.default_rng(seed + 3)
    D, E, F = cfg["hidden_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        del w[f"{p}.self_attn.rotary_emb.inv_freq"]  # mlx-lm's sanitize keeps it
        for n in ("gate", "up", "down"):
            del w[f"{p}.mlp.{n}_proj.weight"]
        m = f"{p}.block_sparse_moe"
        w[f"{m}.gate.weight"] = 4 * _lin(rng, E, D)
        for e in range(E):
            for n, (o, i_) in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
                w[f"{m}.experts.{e}.{n}.weight"] = _lin(rng, o, i_)
    return write_model(path, cfg, w, tokenizer)


# --- gpt-oss: biases everywhere, sinks, alternating windows, clamped SwiGLU ----------

GPT_OSS = dict(
    model_type="gpt_oss",
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=64,
    head_dim=16,
    sliding_window=5,  # shorter than the tests' prompts
    rope_theta=150000,  # an int, as mlx-lm's ModelArgs types it
    layer_types=["sliding_attention", "full_attention"],
)


def gpt_oss_config(**over) -> dict:
    cfg = {**LLAMA_BASE, **GPT_OSS, **over}
    cfg.pop("tie_word_embeddings")  # gpt-oss configs have none: untied
    return cfg


def make_gpt_oss(path: Path, seed: int = 0, tokenizer: bool = True, **over) -> Path:
    """mlx-lm's sanitized layout (as mlx-community checkpoints hold it): stacked
    experts' gate/up/down with biases, router with bias, q/k/v/o biases,
    sinks; biases of either sign and size ~1, so they matter."""
    cfg = gpt_oss_config(**over)
    rng = np.random.default_rng(seed)
    D, V, E = cfg["hidden_size"], cfg["vocab_size"], cfg["num_local_experts"]
    F, h = cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def bias(*shape):
        return rng.uniform(-1.0, 1.0, shape).astype(np.float32)

    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
        "model.norm.weight": _gain(rng, D),
        "lm_head.weight": _lin(rng, V, D),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = _gain(rng, D)
        w[f"{p}.post_attention_layernorm.weight"] = _gain(rng, D)
        a = f"{p}.self_attn"
        for n, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
            w[f"{a}.{n}_proj.weight"] = _lin(rng, out, D)
            w[f"{a}.{n}_proj.bias"] = bias(out)
        w[f"{a}.o_proj.weight"] = _lin(rng, D, hq * h)
        w[f"{a}.o_proj.bias"] = bias(D)
        w[f"{a}.sinks"] = rng.uniform(-2.0, 2.0, hq).astype(np.float32)
        w[f"{p}.mlp.router.weight"] = 4 * _lin(rng, E, D)
        w[f"{p}.mlp.router.bias"] = bias(E)
        x = f"{p}.mlp.experts"
        for n, (o, i_) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            w[f"{x}.{n}_proj.weight"] = np.stack([_lin(rng, o, i_) for _ in range(E)])
            w[f"{x}.{n}_proj.bias"] = bias(E, o)
    return write_model(path, cfg, w, tokenizer)


# --- Qwen3.5: gated DeltaNet and gated attention layers (mlx-lm's qwen3_5) ----------

QWEN3_5 = dict(
    model_type="qwen3_5",
    hidden_size=64,
    num_hidden_layers=4,  # DeltaNet, DeltaNet, DeltaNet, attention
    full_attention_interval=4,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
    },
)
QWEN3_5_CONFIGS = {
    "qwen3_5": {},
    # Tied head, an attention layer between two DeltaNets, the last recurrent.
    "qwen3_5_tied": dict(
        num_hidden_layers=3, full_attention_interval=2, tie_word_embeddings=True
    ),
}


def qwen3_5_config(name: str = "qwen3_5", **over) -> dict:
    return {**QWEN3_5, **QWEN3_5_CONFIGS[name], **over}


def qwen3_5_weights(cfg: dict, seed: int = 0, hf: bool = False) -> dict:
    """mlx-lm's saved layout (`language_model.` names, Conv1d (C, K, 1), norm
    gains as such); `hf`: Hugging Face's own files (`model.language_model.`,
    Conv1d (C, 1, K), norms storing w of 1 + w, a vision tower and an MTP head
    that mlx-lm drops). Gated-norm gains in [0.25, 4] like every other."""
    rng = np.random.default_rng(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    K = cfg["linear_conv_kernel_dim"]
    conv = 2 * nk * dk + nv * dv

    def gain(n):  # the 1 + w norms store w in Hugging Face's files
        g = _gain(rng, n)
        return g - 1.0 if hf else g

    top = "model.language_model." if hf else "language_model.model."
    w = {
        f"{top}embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
        f"{top}norm.weight": gain(D),
    }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight" if hf else "language_model.lm_head.weight"] = _lin(rng, V, D)
    interval = cfg["full_attention_interval"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"{top}layers.{i}"
        w[f"{p}.input_layernorm.weight"] = gain(D)
        w[f"{p}.post_attention_layernorm.weight"] = gain(D)
        if (i + 1) % interval:
            a = f"{p}.linear_attn"
            for n, out in (("qkv", conv), ("z", nv * dv), ("b", nv), ("a", nv)):
                w[f"{a}.in_proj_{n}.weight"] = _lin(rng, out, D)
            c = (rng.standard_normal((conv, K)) / np.sqrt(K)).astype(np.float32)
            w[f"{a}.conv1d.weight"] = c[:, None, :] if hf else c[:, :, None]
            w[f"{a}.dt_bias"] = rng.uniform(-1, 1, nv).astype(np.float32)
            w[f"{a}.A_log"] = np.log(rng.uniform(0.5, 8, nv)).astype(np.float32)
            w[f"{a}.norm.weight"] = _gain(rng, dv)  # a plain gain in both forms
            w[f"{a}.out_proj.weight"] = _lin(rng, D, nv * dv)
        else:
            a = f"{p}.self_attn"
            w[f"{a}.q_proj.weight"] = _lin(rng, 2 * hq * h, D)  # per head [q | gate]
            w[f"{a}.k_proj.weight"] = _lin(rng, hkv * h, D)
            w[f"{a}.v_proj.weight"] = _lin(rng, hkv * h, D)
            w[f"{a}.o_proj.weight"] = _lin(rng, D, hq * h)
            w[f"{a}.q_norm.weight"] = gain(h)
            w[f"{a}.k_norm.weight"] = gain(h)
        for n, (o, i_) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            w[f"{p}.mlp.{n}_proj.weight"] = _lin(rng, o, i_)
    if hf:
        w["model.visual.patch_embed.proj.weight"] = _lin(rng, 8, 8)
        w["mtp.fc.weight"] = _lin(rng, D, 2 * D)
    return w


def make_qwen3_5(
    path: Path,
    name: str = "qwen3_5",
    seed: int = 0,
    tokenizer: bool = True,
    hf: bool = False,
    wrapped: bool = False,
    **over,
) -> Path:
    """`wrapped`: the multimodal wrapper's config, as Qwen3.5 ships it (the
    text model's under text_config, model_type qwen3_5_text, a vision_config)."""
    cfg = qwen3_5_config(name, **over)
    weights = qwen3_5_weights(cfg, seed, hf)
    if wrapped:
        text = {**cfg, "model_type": "qwen3_5_text"}
        cfg = {"model_type": "qwen3_5", "text_config": text, "vision_config": {}}
        cfg["tie_word_embeddings"] = text["tie_word_embeddings"]
    return write_model(path, cfg, weights, tokenizer)


# --- Ministral 3 (YaRN rope_parameters, Llama 4's query scale) and its Mistral 3
# multimodal wrapper -------------------------------------------------------------

_MINISTRAL3_ROPE = dict(
    rope_type="yarn",
    type="yarn",
    rope_theta=1000000.0,
    factor=16.0,
    beta_fast=32.0,
    beta_slow=1.0,
    # Tiny, so the prompt plus 32 steps crosses it five times: the query
    # scale 1 + beta * log(1 + floor(pos / 8)) changes within every test.
    original_max_position_embeddings=8,
    llama_4_scaling_beta=0.3,
)
MINISTRAL3_BASE = {k: v for k, v in LLAMA_BASE.items() if k != "rope_theta"}
MINISTRAL3_CONFIGS = {
    # As Ministral 3 ships: mscale == mscale_all_dim, so YaRN's input scale is
    # 1 (the fused epilogue can take it); no tie key: tied, stock's default.
    "ministral3": dict(
        model_type="ministral3",
        head_dim=16,
        rope_parameters=dict(_MINISTRAL3_ROPE, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=4096,
        tie_word_embeddings=None,  # removed below: absent from the config
    ),
    # YaRN with an input scale (mscale 1, mscale_all_dim 0: 1 + 0.1 ln 16),
    # untied, sliding-window layers shorter than the prompt.
    "ministral3_mscale_sliding": dict(
        model_type="ministral3",
        num_hidden_layers=3,
        rope_parameters=dict(_MINISTRAL3_ROPE, mscale=1.0, mscale_all_dim=0.0),
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=False,
    ),
}


def ministral3_config(name: str) -> dict:
    cfg = {**MINISTRAL3_BASE, **MINISTRAL3_CONFIGS[name]}
    return {k: v for k, v in cfg.items() if v is not None}


def make_ministral3(
    path: Path, name: str = "ministral3", seed: int = 0, tokenizer: bool = True
) -> Path:
    cfg = ministral3_config(name)
    w = llama_weights(cfg, seed)
    return write_model(path, cfg, w, tokenizer)


# Mistral 3 wrappers: the text model under `language_model.` (as mlx-lm's
# convert writes it) or `model.language_model.` (transformers' newer layout),
# a vision tower and projector that must be dropped, the text config without
# tie_word_embeddings (the wrapper's default: untied).
MISTRAL3_WRAPPERS = {
    "mistral3": dict(text="ministral3", prefix="language_model.", vision=False),
    "mistral3_vision": dict(
        text="ministral3_mscale_sliding", prefix="model.language_model.", vision=True
    ),
    # Mistral Small 3.1's shape: a Mistral (Llama) text model, which mlx-lm's
    # wrapper runs as Llama.
    "mistral3_mistral": dict(text="mistral", prefix="language_model.", vision=True),
}


def mistral3_config(name: str) -> dict:
    spec = MISTRAL3_WRAPPERS[name]
    if spec["text"] == "mistral":
        text = {**LLAMA_BASE, "model_type": "mistral", "head_dim": 16}
    else:
        text = ministral3_config(spec["text"])
    text.pop("tie_word_embeddings", None)
    return {
        "model_type": "mistral3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "pixtral", "hidden_size": 8},
        "image_token_index": 10,
    }


def make_mistral3(
    path: Path, name: str = "mistral3", seed: int = 0, tokenizer: bool = True
) -> Path:
    spec = MISTRAL3_WRAPPERS[name]
    cfg = mistral3_config(name)
    text = {**cfg["text_config"], "tie_word_embeddings": False}
    w = {}
    for k, v in llama_weights(text, seed).items():
        if spec["prefix"] == "model.language_model." and k.startswith("model."):
            w["model.language_model." + k[len("model.") :]] = v
        elif spec["prefix"] == "model.language_model.":
            w[k] = v  # lm_head.weight stays at the top, as transformers writes it
        else:
            w[spec["prefix"] + k] = v
    if spec["vision"]:  # shapes no text module has: taken, they would not load
        rng = np.random.default_rng(seed + 5)
        top = "model." if spec["prefix"].startswith("model.") else ""
        w[f"{top}vision_tower.patch_conv.weight"] = _lin(rng, 7, 3)
        w[f"{top}vision_tower.ln_pre.weight"] = _gain(rng, 7)
        w[f"{top}multi_modal_projector.linear_1.weight"] = _lin(rng, 5, 7)
        w[f"{top}multi_modal_projector.norm.weight"] = _gain(rng, 7)
    return write_model(path, cfg, w, tokenizer)


QWEN3_5_MOE = dict(
    model_type="qwen3_5_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,  # two groups of 32: a 4-bit down splits over 2 ranks
    shared_expert_intermediate_size=64,
    norm_topk_prob=True,
)


def make_qwen3_5_moe(
    path: Path,
    name: str = "qwen3_5",
    seed: int = 0,
    tokenizer: bool = True,
    hf: bool = False,
    wrapped: bool = False,
    **over,
) -> Path:
    """`make_qwen3_5`'s layers with experts in every one: a router with large
    weights (routing visibly depends on the token), stacked experts (mlx-lm's
    switch_mlp; Hugging Face's fused gate_up_proj with `hf`), a shared expert
    and its sigmoid gate."""
    cfg = qwen3_5_config(name, **{**QWEN3_5_MOE, **over})
    w = qwen3_5_weights(cfg, seed, hf)
    rng = np.random.default_rng(seed + 5)
    D, E, F = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    S = cfg["shared_expert_intermediate_size"]
    top = "model.language_model." if hf else "language_model.model."
    for i in range(cfg["num_hidden_layers"]):
        m = f"{top}layers.{i}.mlp"
        for n in ("gate", "up", "down"):
            del w[f"{m}.{n}_proj.weight"]
        w[f"{m}.gate.weight"] = 4 * _lin(rng, E, D)
        experts = {
            n: np.stack([_lin(rng, *shape) for _ in range(E)])
            for n, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))
        }
        if hf:
            gate_up = np.concatenate([experts["gate"], experts["up"]], axis=1)
            w[f"{m}.experts.gate_up_proj"] = gate_up
            w[f"{m}.experts.down_proj"] = experts["down"]
        else:
            for n, v in experts.items():
                w[f"{m}.switch_mlp.{n}_proj.weight"] = v
        for n, (o, i_) in (("gate", (S, D)), ("up", (S, D)), ("down", (D, S))):
            w[f"{m}.shared_expert.{n}_proj.weight"] = _lin(rng, o, i_)
        w[f"{m}.shared_expert_gate.weight"] = 2 * _lin(rng, 1, D)
    if wrapped:
        text = {**cfg, "model_type": "qwen3_5_moe_text"}
        cfg = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {}}
    return write_model(path, cfg, w, tokenizer)


# --- Qwen3-Next: Qwen3.5's layers, the DeltaNet inputs in two per-key-head linears --

QWEN3_NEXT = dict(
    model_type="qwen3_next",
    num_hidden_layers=4,  # DeltaNet (MoE), DeltaNet (dense), DeltaNet, attention
    full_attention_interval=4,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    norm_topk_prob=True,
    rope_theta=1e6,
    partial_rotary_factor=0.25,
)


def make_qwen3_next(
    path: Path,
    name: str = "untied",
    seed: int = 0,
    tokenizer: bool = True,
    hf: bool = False,
) -> Path:
    """mlx-lm's saved layout (stacked experts, gains, Conv1d (C, K, 1)) or,
    with `hf`, Hugging Face's (per-expert weights, 1 + w norms, Conv1d
    (C, 1, K), an MTP head); `name` "tied" ties the head."""
    cfg = {k: v for k, v in QWEN3_5.items() if k != "rope_parameters"}
    cfg.update(QWEN3_NEXT, tie_word_embeddings=name == "tied")
    w = qwen3_5_weights({**cfg, "full_attention_interval": 4}, seed, hf)
    rng = np.random.default_rng(seed + 7)
    D, E, F = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    S = cfg["shared_expert_intermediate_size"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    out = {}
    for k, v in w.items():  # Qwen3.5's names -> Qwen3-Next's
        k = k.replace("model.language_model.", "model.")
        k = k.replace("language_model.model.", "model.").replace("language_model.", "")
        out[k] = v
    w = out
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.linear_attn"
        if f"{a}.in_proj_qkv.weight" in w:  # rows per key head: [q k v z], [b a]
            qkv, z = w.pop(f"{a}.in_proj_qkv.weight"), w.pop(f"{a}.in_proj_z.weight")
            q, k_, v = np.split(qkv, [nk * dk, 2 * nk * dk])
            per = [q.reshape(nk, dk, D), k_.reshape(nk, dk, D)]
            per += [v.reshape(nk, r * dv, D), z.reshape(nk, r * dv, D)]
            w[f"{a}.in_proj_qkvz.weight"] = np.concatenate(per, 1).reshape(-1, D)
            b, a_ = w.pop(f"{a}.in_proj_b.weight"), w.pop(f"{a}.in_proj_a.weight")
            ba = [b.reshape(nk, r, D), a_.reshape(nk, r, D)]
            w[f"{a}.in_proj_ba.weight"] = np.concatenate(ba, 1).reshape(-1, D)
        if i in cfg["mlp_only_layers"]:
            continue
        m = f"{p}.mlp"
        for n in ("gate", "up", "down"):
            del w[f"{m}.{n}_proj.weight"]
        w[f"{m}.gate.weight"] = 4 * _lin(rng, E, D)
        for n, (o, i_) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            experts = [_lin(rng, o, i_) for _ in range(E)]
            if hf:
                for e, x in enumerate(experts):
                    w[f"{m}.experts.{e}.{n}_proj.weight"] = x
            else:
                w[f"{m}.switch_mlp.{n}_proj.weight"] = np.stack(experts)
        for n, (o, i_) in (("gate", (S, D)), ("up", (S, D)), ("down", (D, S))):
            w[f"{m}.shared_expert.{n}_proj.weight"] = _lin(rng, o, i_)
        w[f"{m}.shared_expert_gate.weight"] = 2 * _lin(rng, 1, D)
    w = {k: v for k, v in w.items() if "visual" not in k}
    return write_model(path, cfg, w, tokenizer)


# --- LFM2: short gated convolutions beside attention (mlx-lm's lfm2, lfm2_moe) -------

LFM2 = dict(
    model_type="lfm2",
    vocab_size=VOCAB,
    hidden_size=64,
    block_dim=64,
    num_hidden_layers=4,  # conv, attention, conv, conv
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    norm_eps=1e-5,
    conv_bias=False,
    conv_L_cache=3,
    block_ff_dim=144,  # auto-adjusted: int(2 * 144 / 3) = 96, a multiple of 32
    block_multiple_of=32,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=True,
    rope_theta=1e6,
    layer_types=["conv", "full_attention", "conv", "conv"],
)
LFM2_CONFIGS = {
    "lfm2": {},
    # Biases on the conv's linears and convolution, attention first and last
    # (full_attn_idxs), an odd ff_dim rounded up by block_multiple_of.
    "lfm2_bias": dict(
        conv_bias=True,
        num_hidden_layers=3,
        layer_types=None,
        full_attn_idxs=[0, 2],
        block_ff_dim=100,
        block_ffn_dim_multiplier=1.5,
    ),
}


def lfm2_config(name: str = "lfm2", **over) -> dict:
    cfg = {**LFM2, **LFM2_CONFIGS[name], **over}
    return {k: v for k, v in cfg.items() if v is not None}


def _lfm2_ff_dim(cfg: dict) -> int:
    dim = cfg["block_ff_dim"]
    if cfg["block_auto_adjust_ff_dim"]:
        dim = int(cfg["block_ffn_dim_multiplier"] * int(2 * dim / 3))
        m = cfg["block_multiple_of"]
        dim = m * ((dim + m - 1) // m)
    return dim


def lfm2_attends(cfg: dict, i: int) -> bool:
    if cfg.get("full_attn_idxs") is not None:
        return i in cfg["full_attn_idxs"]
    return cfg["layer_types"][i] == "full_attention"


def lfm2_weights(cfg: dict, seed: int = 0, ffn=None) -> dict:
    """Hugging Face's layout (Conv1d (C, 1, K), which mlx-lm's sanitize moves),
    every norm gain in [0.25, 4] (QK-norms' too), biases of size ~1 where
    `conv_bias`; `ffn(w, prefix, i)`: layer i's feed-forward (default LFM2's
    w1/w3/w2 GLU)."""
    rng = np.random.default_rng(seed)
    D, V, K = cfg["hidden_size"], cfg["vocab_size"], cfg["conv_L_cache"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = D // hq
    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
        "model.embedding_norm.weight": _gain(rng, D),
    }

    def bias(n):
        return rng.uniform(-1.0, 1.0, n).astype(np.float32)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.operator_norm.weight"] = _gain(rng, D)
        w[f"{p}.ffn_norm.weight"] = _gain(rng, D)
        if lfm2_attends(cfg, i):
            a = f"{p}.self_attn"
            for n, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
                w[f"{a}.{n}_proj.weight"] = _lin(rng, out, D)
            w[f"{a}.out_proj.weight"] = _lin(rng, D, hq * h)
            w[f"{a}.q_layernorm.weight"] = _gain(rng, h)
            w[f"{a}.k_layernorm.weight"] = _gain(rng, h)
        else:
            c = f"{p}.conv"
            w[f"{c}.in_proj.weight"] = _lin(rng, 3 * D, D)
            w[f"{c}.out_proj.weight"] = _lin(rng, D, D)
            conv = rng.standard_normal((D, 1, K)) / np.sqrt(K)
            w[f"{c}.conv.weight"] = conv.astype(np.float32)
            if cfg["conv_bias"]:
                w[f"{c}.in_proj.bias"] = bias(3 * D)
                w[f"{c}.out_proj.bias"] = bias(D)
                w[f"{c}.conv.bias"] = bias(D)
        if ffn is not None:
            ffn(w, p, i)
        else:
            F = _lfm2_ff_dim(cfg)
            for n, (o, i_) in (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F))):
                w[f"{p}.feed_forward.{n}.weight"] = _lin(rng, o, i_)
    return w


def make_lfm2(
    path: Path, name: str = "lfm2", seed: int = 0, tokenizer: bool = True, **over
) -> Path:
    cfg = lfm2_config(name, **over)
    return write_model(path, cfg, lfm2_weights(cfg, seed), tokenizer)


LFM2_MOE = dict(
    model_type="lfm2_moe",
    intermediate_size=96,
    moe_intermediate_size=64,  # two groups of 32: a 4-bit down splits over 2 ranks
    num_experts=6,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    use_expert_bias=True,
    num_dense_layers=1,
    routed_scaling_factor=1.5,
)
LFM2_MOE_CONFIGS = {
    "lfm2_moe": {},
    # No expert bias, raw top-k weights, attention first, two dense layers.
    "lfm2_moe_plain": dict(
        use_expert_bias=False,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        num_dense_layers=2,
        layer_types=["full_attention", "conv", "conv", "full_attention"],
    ),
}


def lfm2_moe_config(name: str = "lfm2_moe", **over) -> dict:
    cfg = {**LFM2, **LFM2_MOE, **LFM2_MOE_CONFIGS[name], **over}
    for k in ("block_dim", "block_ff_dim", "block_multiple_of"):
        cfg.pop(k)
    for k in ("block_ffn_dim_multiplier", "block_auto_adjust_ff_dim"):
        cfg.pop(k)
    return cfg


def make_lfm2_moe(
    path: Path, name: str = "lfm2_moe", seed: int = 0, tokenizer: bool = True, **over
) -> Path:
    """Hugging Face's per-expert w1/w3/w2 names, routers with large weights
    (routing visibly depends on the token), an expert bias of the sigmoid
    weights' own size (so it changes picks), dense layers first."""
    cfg = lfm2_moe_config(name, **over)
    rng = np.random.default_rng(seed + 5)
    D, E = cfg["hidden_size"], cfg["num_experts"]
    F, Fd = cfg["moe_intermediate_size"], cfg["intermediate_size"]

    def ffn(w, p, i):
        f = f"{p}.feed_forward"
        glu = (("w1", (F, D)), ("w3", (F, D)), ("w2", (D, F)))
        if i < cfg["num_dense_layers"]:
            glu = (("w1", (Fd, D)), ("w3", (Fd, D)), ("w2", (D, Fd)))
            for n, (o, i_) in glu:
                w[f"{f}.{n}.weight"] = _lin(rng, o, i_)
            return
        w[f"{f}.gate.weight"] = 4 * _lin(rng, E, D)
        if cfg["use_expert_bias"]:
            w[f"{f}.expert_bias"] = rng.uniform(-0.3, 0.3, E).astype(np.float32)
        for e in range(E):
            for n, (o, i_) in glu:
                w[f"{f}.experts.{e}.{n}.weight"] = _lin(rng, o, i_)

    return write_model(path, cfg, lfm2_weights(cfg, seed, ffn), tokenizer)


# --- Gemma 4 (gemma4_text): plain gains w, v renormalized, partial RoPE --------

GEMMA4_BASE = dict(
    model_type="gemma4_text",
    hidden_size=64,
    num_hidden_layers=6,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,  # global layers: wider heads, a quarter of them rotated
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    vocab_size_per_layer_input=VOCAB,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    sliding_window=6,
    layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
    rope_parameters={
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    max_position_embeddings=512,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)

GEMMA4_CONFIGS = {
    "gemma4_tied": {},
    # Untied (the final norm folds into the head), a large eps (the epsilon
    # adjustments of the q, k and v norms matter), a tighter softcap.
    "gemma4_untied": dict(
        tie_word_embeddings=False, rms_norm_eps=0.05, final_logit_softcapping=5.0
    ),
}


# Gemma 4's other parts, tested in test_gemma4.py alone (the cross-family
# files run GEMMA4_CONFIGS: the suite's time budget).
GEMMA4_PARTS = {
    # The small Gemma 4s' shape (E2B, E4B): per-layer inputs, the last three
    # layers KV-shared (double-wide MLPs; sliding 3 and 4 read layer 1, global
    # 5 reads 2), and K = V on the global layer that has its own keys (one
    # global KV head, the 31B's); a large eps (the norms' epsilons matter).
    "gemma4_e": dict(
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=3,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        rms_norm_eps=0.05,
    ),
    # The 26B-A4B's shape: a MoE block beside each dense MLP (4 experts, top
    # 2, per-expert scales), K = V global layers with one KV head.
    "gemma4_moe": dict(
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
    ),
}


def gemma4_config(name: str) -> dict:
    return {**GEMMA4_BASE, **{**GEMMA4_CONFIGS, **GEMMA4_PARTS}[name]}


def gemma4_weights(cfg: dict, seed: int = 0) -> dict:
    """As Hugging Face's checkpoints hold them: KV-shared layers keep k_proj,
    v_proj and k_norm (stock's sanitize drops them), K = V layers have no
    v_proj, per-layer inputs their embedding, projections and norms."""
    rng = np.random.default_rng(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    N, P = cfg["num_hidden_layers"], cfg.get("hidden_size_per_layer_input", 0)
    shared_from = N - cfg.get("num_kv_shared_layers", 0)
    w = {
        "model.embed_tokens.weight": (rng.standard_normal((V, D)) / np.sqrt(D)).astype(
            np.float32
        ),
        "model.norm.weight": _gain(rng, D),
    }
    if not cfg.get("tie_word_embeddings", True):
        w["lm_head.weight"] = _lin(rng, V, D)
    if P:
        w["model.embed_tokens_per_layer.weight"] = rng.standard_normal(
            (cfg["vocab_size_per_layer_input"], N * P)
        ).astype(np.float32) / np.sqrt(P)
        w["model.per_layer_model_projection.weight"] = _lin(rng, N * P, D)
        w["model.per_layer_projection_norm.weight"] = _gain(rng, P)
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        full = kind != "sliding_attention"
        h = cfg["global_head_dim"] if full else cfg["head_dim"]
        k_eq_v = full and cfg.get("attention_k_eq_v") and i < shared_from
        kv = cfg.get("num_global_key_value_heads") or hkv if k_eq_v else hkv
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            w[f"{p}.{n}.weight"] = _gain(rng, D)
        for n, out in (("q", hq * h), ("k", kv * h), ("v", kv * h)):
            if not (n == "v" and k_eq_v):
                w[f"{p}.self_attn.{n}_proj.weight"] = _lin(rng, out, D)
        # Attention's scale is 1: QK gains far below 1 keep its logits in the
        # range a trained model has (gains of 0.25 to 4 made stock itself
        # move 2e-4 for a 1e-7 change of its weights).
        for n in ("q_norm", "k_norm"):
            w[f"{p}.self_attn.{n}.weight"] = rng.uniform(0.05, 0.4, h).astype(
                np.float32
            )
        w[f"{p}.self_attn.o_proj.weight"] = _lin(rng, D, hq * h)
        wide = cfg.get("use_double_wide_mlp", True) and i >= shared_from > 0
        Fi = 2 * F if wide else F
        for n, (o, i_) in (("gate", (Fi, D)), ("up", (Fi, D)), ("down", (D, Fi))):
            w[f"{p}.mlp.{n}_proj.weight"] = _lin(rng, o, i_)
        if cfg.get("enable_moe_block"):  # Hugging Face's fused 3-D experts
            E, Fm = cfg["num_experts"], cfg["moe_intermediate_size"]
            # A strong router: the experts picked depend on the token.
            w[f"{p}.router.proj.weight"] = 8 * _lin(rng, E, D)
            w[f"{p}.router.scale"] = _gain(rng, D)
            w[f"{p}.router.per_expert_scale"] = _gain(rng, E)
            gu = np.stack([_lin(rng, 2 * Fm, D) for _ in range(E)])
            w[f"{p}.experts.gate_up_proj"] = gu
            w[f"{p}.experts.down_proj"] = np.stack([_lin(rng, D, Fm) for _ in range(E)])
            for n in (
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
            ):
                w[f"{p}.{n}.weight"] = _gain(rng, D)
        if P:
            w[f"{p}.per_layer_input_gate.weight"] = _lin(rng, P, D)
            w[f"{p}.per_layer_projection.weight"] = _lin(rng, D, P)
            w[f"{p}.post_per_layer_input_norm.weight"] = _gain(rng, D)
        w[f"{p}.layer_scalar"] = rng.uniform(0.5, 2.0, size=(1,)).astype(np.float32)
    return w


def make_gemma4(
    path: Path, name: str = "gemma4_tied", seed: int = 0, tokenizer: bool = True, **over
) -> Path:
    cfg = {**gemma4_config(name), **over}
    return write_model(path, cfg, gemma4_weights(cfg, seed), tokenizer)


def make_gemma4_wrapped(
    path: Path, seed: int = 0, vision: bool = True, tokenizer: bool = True
) -> Path:
    """Gemma 4's multimodal wrapper as Hugging Face writes it: {"model_type":
    "gemma4", "text_config": gemma4_text's}, the text weights under
    `model.language_model.`, a vision tower and its embedder beside them."""
    text = gemma4_config("gemma4_tied")
    cfg = {
        "model_type": "gemma4",
        "vocab_size": text["vocab_size"],
        "text_config": {k: v for k, v in text.items() if k != "vocab_size"},
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 7},
    }
    w = {
        "model.language_model." + k[len("model.") :]: v
        for k, v in gemma4_weights(text, seed).items()
    }
    if vision:  # shapes no text module has: taken, they would not load
        rng = np.random.default_rng(seed + 5)
        w["model.vision_tower.patch_embedder.weight"] = _lin(rng, 7, 3)
        w["model.embed_vision.embedding_projection.weight"] = _lin(rng, 64, 7)
    return write_model(path, cfg, w, tokenizer)


# --- Gemma 4 with every part llama.cpp's gemma4 files hold (tests/test_gemma4.py's
# GGUF block): per-layer inputs, KV-shared layers (double-wide MLP), K = V
# global layers with their own KV heads, the MoE block --------------------------

GEMMA4_GGUF_CONFIGS = {
    "gemma4_tied": {},
    "gemma4_untied": GEMMA4_CONFIGS["gemma4_untied"],
    # Layers 3..5 share 1's (sliding) and 2's (global) KV, as llama.cpp reuses.
    "gemma4_every_part": dict(
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
}


# --- GLM-4.5/4.6 (glm4_moe): biases, QK-norm, partial RoPE, grouped sigmoid experts ---

GLM4_MOE = dict(
    model_type="glm4_moe",
    architectures=["Glm4MoeForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=64,  # two groups of 32: a 4-bit down splits over 2 ranks
    max_position_embeddings=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,  # half of each head rotated, as GLM-4.5
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
    rms_norm_eps=0.05,  # large: the QK-norm epsilon adjustment must matter
    rope_theta=1e6,
    rope_scaling=None,
    tie_word_embeddings=False,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
)
GLM4_MOE_CONFIGS = {
    # QK-norm beside the q|k|v bias, experts in two groups (one kept per token),
    # a dense first layer.
    "glm4_moe": {},
    # No QK-norm, one group, 6 experts, two dense layers, wider heads.
    "glm4_moe_plain": dict(
        use_qk_norm=False,
        n_group=1,
        n_routed_experts=6,
        first_k_dense_replace=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        routed_scaling_factor=1.0,
    ),
}


# --- Nemotron-H / Nemotron 3 (nemotron_h): Mamba-2, attention, ReLU², experts ------

NEMOTRON_H = dict(
    model_type="nemotron_h",
    architectures=["NemotronHForCausalLM"],
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    layer_norm_epsilon=1e-5,
    mamba_num_heads=8,
    mamba_head_dim=8,
    ssm_state_size=16,
    conv_kernel=4,
    n_groups=2,  # the gated norm's 1/RMS per group of 32
    expand=2,
    chunk_size=128,
    mamba_hidden_act="silu",
    mlp_hidden_act="relu2",
    use_bias=False,
    use_conv_bias=True,
    # As checkpoints write them: a string pattern, [0.0, Infinity].
    time_step_limit=[0.0, float("inf")],
    time_step_min=0.001,
    time_step_max=0.1,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=258,
)
NEMOTRON_H_CONFIGS = {
    # Dense, every block kind, a bias wherever the config has one.
    "nemotron_h": dict(
        hybrid_override_pattern="M*-M-",
        num_hidden_layers=5,
        attention_bias=True,
        mamba_proj_bias=True,
        mlp_bias=True,
    ),
    # Nemotron 3: sigmoid-routed experts with a correction bias, group routing,
    # a shared expert; no biases (as shipped).
    "nemotron_h_moe": dict(
        hybrid_override_pattern="ME*ME",
        num_hidden_layers=5,
        attention_bias=False,
        mamba_proj_bias=False,
        mlp_bias=False,
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
    ),
}


def gemma4_gguf_config(name: str) -> dict:
    cfg = {**GEMMA4_BASE, **GEMMA4_GGUF_CONFIGS[name]}
    cfg.setdefault("use_double_wide_mlp", False)
    return cfg


def gemma4_hf_weights(cfg: dict, seed: int = 0) -> dict:
    """Random Hugging Face-named weights for any Gemma 4 config, shaped by
    mlx-lm's own class: gains 0.25..4 (QK gains 0.05..0.4), layer scalars
    0.5..2; experts as Hugging Face stores them (gate|up in one (E, 2F, D)),
    KV-shared layers with the k, v and k_norm Hugging Face keeps (unused)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma4_text

    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(cfg))
    rng = np.random.default_rng(seed)
    w = {}
    for k, v in tree_flatten(model.parameters()):
        shape = tuple(v.shape)
        if k.endswith(("q_norm.weight", "k_norm.weight")):
            w[k] = rng.uniform(0.05, 0.4, shape).astype(np.float32)
        elif k.endswith(("layer_scalar", "per_expert_scale")):
            w[k] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
        elif "norm" in k or k.endswith("router.scale"):
            w[k] = rng.uniform(0.25, 4.0, shape).astype(np.float32)
        else:
            w[k] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    first_shared = cfg["num_hidden_layers"] - cfg.get("num_kv_shared_layers", 0)
    for i in range(first_shared, cfg["num_hidden_layers"]):
        p, kind = f"model.layers.{i}.self_attn", cfg["layer_types"][i]
        h = cfg["head_dim"] if kind == "sliding_attention" else cfg["global_head_dim"]
        for n in ("k_proj", "v_proj"):
            w[f"{p}.{n}.weight"] = _lin(
                rng, cfg["num_key_value_heads"] * h, cfg["hidden_size"]
            )
        w[f"{p}.k_norm.weight"] = _gain(rng, h)
    for k in [k for k in w if ".experts.switch_glu.gate_proj" in k]:
        base = k.split(".switch_glu.")[0]
        gate = w.pop(k)
        up = w.pop(f"{base}.switch_glu.up_proj.weight")
        w[f"{base}.gate_up_proj"] = np.concatenate([gate, up], axis=-2)
        w[f"{base}.down_proj"] = w.pop(f"{base}.switch_glu.down_proj.weight")
    return w


def make_gemma4_gguf_source(path: Path, name: str, seed: int = 0) -> Path:
    cfg = gemma4_gguf_config(name)
    return write_model(path, cfg, gemma4_hf_weights(cfg, seed), tokenizer=False)


def glm4_moe_config(name: str = "glm4_moe", **over) -> dict:
    return {**GLM4_MOE, **GLM4_MOE_CONFIGS[name], **over}


def make_glm4_moe(
    path: Path, name: str = "glm4_moe", seed: int = 0, tokenizer: bool = True, **over
) -> Path:
    """As GLM-4.5's Hugging Face files: per-expert gate/up/down (mlx-lm's
    sanitize stacks them), `mlp.gate.e_score_correction_bias` of the sigmoid
    scores' own size (so it changes picks), q|k|v biases of either sign and
    size ~1, a multi-token-prediction layer at index num_hidden_layers (stock
    drops it), every norm gain in [0.25, 4] (QK-norms' too), routers with
    large weights (routing visibly depends on the token)."""
    cfg = glm4_moe_config(name, **over)
    rng = np.random.default_rng(seed + 7)
    D, V, h = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    hq, hkv, E = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["n_routed_experts"],
    )
    F, Fd = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    Fs = F * cfg["n_shared_experts"]
    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
        "model.norm.weight": _gain(rng, D),
        "lm_head.weight": _lin(rng, V, D),
    }

    def glu(m, hidden):
        for n, (o, i_) in (
            ("gate", (hidden, D)),
            ("up", (hidden, D)),
            ("down", (D, hidden)),
        ):
            w[f"{m}.{n}_proj.weight"] = _lin(rng, o, i_)

    n = cfg["num_hidden_layers"]
    for i in range(n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = _gain(rng, D)
        w[f"{p}.post_attention_layernorm.weight"] = _gain(rng, D)
        a = f"{p}.self_attn"
        for proj, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
            w[f"{a}.{proj}_proj.weight"] = _lin(rng, out, D)
            sign = rng.choice([-1.0, 1.0], size=out)
            w[f"{a}.{proj}_proj.bias"] = (sign * rng.uniform(0.5, 2.0, out)).astype(
                np.float32
            )
        w[f"{a}.o_proj.weight"] = _lin(rng, D, hq * h)
        if cfg["use_qk_norm"]:
            w[f"{a}.q_norm.weight"] = _gain(rng, h)
            w[f"{a}.k_norm.weight"] = _gain(rng, h)
        if i < cfg["first_k_dense_replace"]:
            glu(f"{p}.mlp", Fd)
            continue
        w[f"{p}.mlp.gate.weight"] = 4 * _lin(rng, E, D)
        bias = rng.uniform(-0.3, 0.3, E).astype(np.float32)
        w[f"{p}.mlp.gate.e_score_correction_bias"] = bias
        for e in range(E):
            glu(f"{p}.mlp.experts.{e}", F)
        glu(f"{p}.mlp.shared_experts", Fs)
        if i == n:  # the MTP layer's own tensors
            w[f"{p}.eh_proj.weight"] = _lin(rng, D, 2 * D)
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                w[f"{p}.{norm}.weight"] = _gain(rng, D)
    return write_model(path, cfg, w, tokenizer)


def nemotron_h_config(name: str = "nemotron_h", **over) -> dict:
    return {**NEMOTRON_H, **NEMOTRON_H_CONFIGS[name], **over}


def nemotron_h_weights(cfg: dict, seed: int = 0) -> dict:
    """Hugging Face's names and layout (Conv1d (C, 1, K), per-expert up/down),
    every norm gain in [0.25, 4] (the grouped gated norms' too), biases where
    the config has them, embeddings of RMS 4 (s far from 1), routers with
    large weights and a correction bias that changes picks."""
    rng = np.random.default_rng(seed)
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H, P = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
    I, N, K = H * P, cfg["n_groups"] * cfg["ssm_state_size"], cfg["conv_kernel"]
    hq, hkv, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w = {
        "backbone.embeddings.weight": 4 * rng.standard_normal((V, D)),
        "backbone.norm_f.weight": _gain(rng, D),
        "lm_head.weight": _lin(rng, V, D),
    }

    def bias(n):
        return rng.uniform(-0.5, 0.5, n)

    def linear(name, out, inp, has_bias):
        w[f"{name}.weight"] = _lin(rng, out, inp)
        if has_bias:
            w[f"{name}.bias"] = bias(out)

    for i, kind in enumerate(cfg["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}"
        m = f"{p}.mixer"
        w[f"{p}.norm.weight"] = _gain(rng, D)
        if kind == "M":
            proj_bias = cfg["mamba_proj_bias"]
            linear(f"{m}.in_proj", 2 * I + 2 * N + H, D, proj_bias)
            w[f"{m}.conv1d.weight"] = rng.standard_normal((I + 2 * N, 1, K)) / 2
            if cfg["use_conv_bias"]:
                w[f"{m}.conv1d.bias"] = bias(I + 2 * N)
            w[f"{m}.dt_bias"] = rng.uniform(-3.0, 0.0, H)
            w[f"{m}.A_log"] = np.log(rng.uniform(1.0, 8.0, H))
            w[f"{m}.D"] = rng.uniform(0.5, 1.5, H)
            w[f"{m}.norm.weight"] = _gain(rng, I)
            linear(f"{m}.out_proj", D, I, proj_bias)
        elif kind == "*":
            for n, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
                linear(f"{m}.{n}_proj", out, D, cfg["attention_bias"])
            linear(f"{m}.o_proj", D, hq * h, cfg["attention_bias"])
        elif kind == "-":
            linear(f"{m}.up_proj", F, D, cfg["mlp_bias"])
            linear(f"{m}.down_proj", D, F, cfg["mlp_bias"])
        else:
            E, Fe = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
            Dl = cfg.get("moe_latent_size") or D
            w[f"{m}.gate.weight"] = 4 * _lin(rng, E, D)
            w[f"{m}.gate.e_score_correction_bias"] = rng.uniform(-0.3, 0.3, E)
            for e in range(E):
                linear(f"{m}.experts.{e}.up_proj", Fe, Dl, False)
                linear(f"{m}.experts.{e}.down_proj", Dl, Fe, False)
            Fs = cfg["moe_shared_expert_intermediate_size"]
            linear(f"{m}.shared_experts.up_proj", Fs, D, cfg["mlp_bias"])
            linear(f"{m}.shared_experts.down_proj", D, Fs, cfg["mlp_bias"])
            if cfg.get("moe_latent_size"):
                linear(f"{m}.fc1_latent_proj", Dl, D, cfg["mlp_bias"])
                linear(f"{m}.fc2_latent_proj", D, Dl, cfg["mlp_bias"])
    return {k: np.asarray(v, np.float32) for k, v in w.items()}


def make_nemotron_h(
    path: Path, name: str = "nemotron_h", seed: int = 0, tokenizer: bool = True, **over
) -> Path:
    cfg = nemotron_h_config(name, **over)
    return write_model(path, cfg, nemotron_h_weights(cfg, seed), tokenizer)


# --- Llama 4's dense text model (llama4_text, MobileLLM-R1's): NoPE layers, QK-norm ---

# mlx-lm's llama4_text: `no_rope_layers` (0: no RoPE), a weightless QK-norm on
# every layer (eps rms_norm_eps, large so its adjustment shows), the GLU
# `intermediate_size_mlp` wide; untied with QK-norm, and tied without.
LLAMA4_TEXT_CONFIGS = {
    "llama4_text": dict(
        num_hidden_layers=4,
        no_rope_layers=[1, 1, 1, 0],
        use_qk_norm=True,
        rms_norm_eps=0.05,
    ),
    "llama4_text_tied": dict(
        num_hidden_layers=3,
        no_rope_layers=[0, 1, 1],
        use_qk_norm=False,
        tie_word_embeddings=True,
    ),
}


def llama4_text_config(name: str = "llama4_text", **over) -> dict:
    base = {**LLAMA_BASE, "model_type": "llama4_text", "head_dim": 16}
    base.update(intermediate_size=96, intermediate_size_mlp=80, rope_theta=5e5)
    return {**base, **LLAMA4_TEXT_CONFIGS[name], **over}


def make_llama4_text(
    path: Path, name: str = "llama4_text", seed: int = 0, tokenizer: bool = True, **over
) -> Path:
    """Llama's tiny weights under stock's names: the GLU (intermediate_size_mlp
    wide) under `feed_forward`, the untied head `output`."""
    cfg = llama4_text_config(name, **over)
    w = llama_weights({**cfg, "intermediate_size": cfg["intermediate_size_mlp"]}, seed)
    # No rotary buffer: stock's class has no sanitize to drop one.
    w = {
        k.replace(".mlp.", ".feed_forward."): v
        for k, v in w.items()
        if "rotary_emb" not in k
    }
    if "lm_head.weight" in w:
        w["output.weight"] = w.pop("lm_head.weight")
    return write_model(path, cfg, w, tokenizer)


# --- Llama 4 (the llama4 wrapper): top-1 sigmoid experts, chunked attention ---

LLAMA4_TEXT = dict(
    model_type="llama4_text",
    attention_bias=False,
    attention_chunk_size=8,  # the 12-token prompt crosses a chunk
    head_dim=16,
    hidden_size=64,
    interleave_moe_layer_step=1,
    intermediate_size=64,  # two groups of 32: a 4-bit down splits over 2 ranks
    intermediate_size_mlp=96,
    max_position_embeddings=512,
    num_attention_heads=4,
    num_experts_per_tok=1,
    num_hidden_layers=4,
    num_key_value_heads=2,
    num_local_experts=4,
    rms_norm_eps=1e-5,
    rope_scaling=None,
    rope_theta=5e5,
    use_qk_norm=True,
    vocab_size=VOCAB,
    attn_temperature_tuning=True,
    floor_scale=4,  # small: the NoPE layer's query temperature moves here
    attn_scale=0.1,
    no_rope_layers=[1, 1, 1, 0],
    tie_word_embeddings=False,
)
# Every layer MoE with QK-norm; MoE every other layer (dense between), no
# QK-norm, llama3 RoPE scaling.
LLAMA4_CONFIGS = {
    "llama4": {},
    "llama4_interleaved": dict(
        interleave_moe_layer_step=2,
        use_qk_norm=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


# --- Granite 4 (granitemoehybrid): Mamba-2 and attention, experts, µP -------------

GRANITE4 = dict(
    model_type="granitemoehybrid",
    architectures=["GraniteMoeHybridForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=48,  # each expert's (the dense GLU's without experts)
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # µP multipliers far from 1 (Granite 4's own are 12, 1/128, 0.22, 6-8).
    embedding_multiplier=6.0,
    attention_multiplier=0.4,
    residual_multiplier=0.3,
    logits_scaling=5.0,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_n_groups=1,  # as shipped: one group, the gated norm over all of it
    mamba_expand=1,
    mamba_chunk_size=256,
    mamba_conv_bias=True,
    attention_bias=False,
    mlp_bias=False,
    rope_theta=10000.0,
    bos_token_id=None,
    eos_token_id=258,
)
GRANITE4_CONFIGS = {
    # Granite 4.0-H: experts beside a shared GLU, RoPE, untied head.
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_hidden_layers=4,
        num_local_experts=6,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        position_embedding_type="rope",
        tie_word_embeddings=False,
        mamba_proj_bias=False,
    ),
    # Granite 4.0-H-Micro: a dense GLU, no RoPE, tied head, in_proj and
    # out_proj biases.
    "granitemoehybrid_dense": dict(
        layer_types=["mamba", "attention", "mamba"],
        num_hidden_layers=3,
        num_local_experts=0,
        num_experts_per_tok=0,
        intermediate_size=96,  # stock's dense GLU: the shared one's width
        shared_intermediate_size=96,
        position_embedding_type="nope",
        tie_word_embeddings=True,
        # Multipliers the other side of 1 (a tied head with a loud embedding
        # repeats one token): embedding rows of RMS 1/4, so s is near 4.
        embedding_multiplier=0.25,
        residual_multiplier=2.5,
        mamba_proj_bias=True,
    ),
}


def llama4_config(name: str = "llama4", **over) -> dict:
    text = {**LLAMA4_TEXT, **LLAMA4_CONFIGS[name], **over}
    return dict(
        model_type="llama4",
        architectures=["Llama4ForConditionalGeneration"],
        text_config=text,
        vision_config=dict(model_type="llama4_vision_model", hidden_size=8),
    )


def make_llama4(
    path: Path, name: str = "llama4", seed: int = 0, tokenizer: bool = True, **over
) -> Path:
    """As Llama 4's Hugging Face files: the text model under `language_model.`,
    experts stored as gate_up_proj (E, D, 2F) and down_proj (E, F, D) (stock's
    sanitize splits and transposes them), a vision tower beside it (dropped),
    every norm gain in [0.25, 4], routers with large weights."""
    cfg = llama4_config(name, **over)
    t = cfg["text_config"]
    rng = np.random.default_rng(seed + 11)
    D, V, h = t["hidden_size"], t["vocab_size"], t["head_dim"]
    hq, hkv = t["num_attention_heads"], t["num_key_value_heads"]
    E, F, Fd = (
        t["num_local_experts"],
        t["intermediate_size"],
        t["intermediate_size_mlp"],
    )
    m = "language_model.model"
    w = {
        f"{m}.embed_tokens.weight": rng.standard_normal((V, D)).astype(np.float32),
        f"{m}.norm.weight": _gain(rng, D),
        "language_model.lm_head.weight": _lin(rng, V, D),
        "vision_model.patch_embedding.linear.weight": _lin(rng, 8, 8),
        "multi_modal_projector.linear_1.weight": _lin(rng, D, 8),
    }

    def glu(p, hidden):
        for n, (o, i_) in (
            ("gate", (hidden, D)),
            ("up", (hidden, D)),
            ("down", (D, hidden)),
        ):
            w[f"{p}.{n}_proj.weight"] = _lin(rng, o, i_)

    step = t["interleave_moe_layer_step"]
    for i in range(t["num_hidden_layers"]):
        p = f"{m}.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = _gain(rng, D)
        w[f"{p}.post_attention_layernorm.weight"] = _gain(rng, D)
        for proj, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
            w[f"{p}.self_attn.{proj}_proj.weight"] = _lin(rng, out, D)
        w[f"{p}.self_attn.o_proj.weight"] = _lin(rng, D, hq * h)
        f = f"{p}.feed_forward"
        if i % step != step - 1:
            glu(f, Fd)
            continue
        w[f"{f}.router.weight"] = 4 * _lin(rng, E, D)
        gate_up = rng.standard_normal((E, D, 2 * F)) / np.sqrt(D)
        w[f"{f}.experts.gate_up_proj"] = gate_up.astype(np.float32)
        down = rng.standard_normal((E, F, D)) / np.sqrt(F)
        w[f"{f}.experts.down_proj"] = down.astype(np.float32)
        glu(f"{f}.shared_expert", F)
    return write_model(path, cfg, w, tokenizer)


def granite4_config(name: str = "granitemoehybrid", **over) -> dict:
    return {**GRANITE4, **GRANITE4_CONFIGS[name], **over}


def granite4_weights(cfg: dict, seed: int = 0) -> dict:
    """Hugging Face's names and layout (Conv1d (C, 1, K); experts' gate|up in
    one (E, 2F, D) input_linear; the dense GLU as shared_mlp), every norm
    gain in [0.25, 4] (the gated norms' too), routers with large weights."""
    rng = np.random.default_rng(seed)
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, P = cfg["mamba_n_heads"], cfg["mamba_d_head"]
    I, N, K = H * P, cfg["mamba_n_groups"] * cfg["mamba_d_state"], cfg["mamba_d_conv"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = D // hq
    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, D)),
        "model.norm.weight": _gain(rng, D),
    }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = _lin(rng, V, D)

    def linear(name, out, inp, has_bias):
        w[f"{name}.weight"] = _lin(rng, out, inp)
        if has_bias:
            w[f"{name}.bias"] = rng.uniform(-0.5, 0.5, out)

    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = _gain(rng, D)
        w[f"{p}.post_attention_layernorm.weight"] = _gain(rng, D)
        if kind == "mamba":
            m, bias = f"{p}.mamba", cfg["mamba_proj_bias"]
            linear(f"{m}.in_proj", 2 * I + 2 * N + H, D, bias)
            w[f"{m}.conv1d.weight"] = rng.standard_normal((I + 2 * N, 1, K)) / 2
            w[f"{m}.conv1d.bias"] = rng.uniform(-0.5, 0.5, I + 2 * N)
            w[f"{m}.dt_bias"] = rng.uniform(-3.0, 0.0, H)
            w[f"{m}.A_log"] = np.log(rng.uniform(1.0, 8.0, H))
            w[f"{m}.D"] = rng.uniform(0.5, 1.5, H)
            w[f"{m}.norm.weight"] = _gain(rng, I)
            linear(f"{m}.out_proj", D, I, bias)
        else:
            a = f"{p}.self_attn"
            for n, out in (("q", hq * h), ("k", hkv * h), ("v", hkv * h)):
                linear(f"{a}.{n}_proj", out, D, cfg["attention_bias"])
            linear(f"{a}.o_proj", D, hq * h, cfg["attention_bias"])
        Fs = cfg["shared_intermediate_size"]
        linear(f"{p}.shared_mlp.input_linear", 2 * Fs, D, False)
        linear(f"{p}.shared_mlp.output_linear", D, Fs, False)
        E, F = cfg["num_local_experts"], cfg["intermediate_size"]
        if E:
            moe = f"{p}.block_sparse_moe"
            w[f"{moe}.router.layer.weight"] = 4 * _lin(rng, E, D)
            w[f"{moe}.input_linear.weight"] = np.stack(
                [_lin(rng, 2 * F, D) for _ in range(E)]
            )
            w[f"{moe}.output_linear.weight"] = np.stack(
                [_lin(rng, D, F) for _ in range(E)]
            )
    return {k: np.asarray(v, np.float32) for k, v in w.items()}


def make_granite4(
    path: Path, name: str = "granitemoehybrid", seed: int = 0, tokenizer=True, **over
) -> Path:
    cfg = granite4_config(name, **over)
    return write_model(path, cfg, granite4_weights(cfg, seed), tokenizer)


# --- DeepSeek V3 / Kimi K2 (deepseek_v3): MLA, grouped sigmoid experts ---------------

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=64,  # two groups of 32: a 4-bit down splits over 2 ranks
    max_position_embeddings=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=32,  # embed_q's input: 4-bit groups of 32, as stored
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    rms_norm_eps=0.05,
    rope_theta=10000.0,
    # DeepSeek V3's YaRN (its mscale_all_dim moves the softmax scale), shrunk.
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        original_max_position_embeddings=128,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    attention_bias=False,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
)
DEEPSEEK_V3_CONFIGS = {
    # YaRN, 8 experts in two groups (one kept per token), a dense first layer.
    "deepseek_v3": {},
    # Kimi K2's model_type (mlx-lm remaps it): one group, 6 experts, plain
    # RoPE, experts on even layers past the first (moe_layer_freq 2): layer 2.
    "kimi_k2": dict(
        model_type="kimi_k2",
        n_group=1,
        n_routed_experts=6,
        first_k_dense_replace=1,
        moe_layer_freq=2,
        rope_scaling=None,
        rms_norm_eps=1e-5,
        routed_scaling_factor=1.0,
    ),
}


def deepseek_v3_config(name: str = "deepseek_v3", **over) -> dict:
    return {**DEEPSEEK_V3, **DEEPSEEK_V3_CONFIGS[name], **over}


def make_deepseek_v3(
    path: Path, name: str = "deepseek_v3", seed: int = 0, tokenizer: bool = True, **over
) -> Path:
    """Built with mlx-lm's own class and saved as `mlx_lm.convert` saves it
    (embed_q / unembed_out, stacked experts): every norm gain in [0.25, 4],
    the latent norms' too; routers with large weights and a correction bias
    that changes picks."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v3

    cfg = deepseek_v3_config(name, **over)
    args = deepseek_v3.ModelArgs.from_dict({**cfg, "model_type": "deepseek_v3"})
    rng = np.random.default_rng(seed + 11)
    w = {}
    for k, v in tree_flatten(deepseek_v3.Model(args).parameters()):
        shape = tuple(v.shape)
        if "norm" in k:
            w[k] = _gain(rng, shape[0])
        elif k.endswith("e_score_correction_bias"):
            w[k] = rng.uniform(-0.3, 0.3, shape).astype(np.float32)
        elif k.endswith("mlp.gate.weight"):
            w[k] = 4 * _lin(rng, *shape)
        elif k == "model.embed_tokens.weight":
            w[k] = rng.standard_normal(shape).astype(np.float32)
        else:
            w[k] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return write_model(path, cfg, w, tokenizer)


# --- the families -------------------------------------------------------------


def _one_config(make, only: str):
    """A family with one config of its own (its builder takes no name)."""

    def made(path: Path, name: str = only, seed: int = 0, tokenizer: bool = True):
        assert name == only, name
        return make(path, seed=seed, tokenizer=tokenizer)

    made.__name__ = make.__name__
    return made


# Every family FlashNorm folds, by mlx-lm model_type: (builder, its tiny
# configs); a builder takes (path, config name, seed=0, tokenizer=True). The
# tests that run every family read this table (a new family is one row here).
FAMILIES = {
    "llama": (make_llama, tuple(LLAMA_CONFIGS)),
    "qwen": (make_qwen, tuple(QWEN_CONFIGS)),
    "openelm": (make_openelm, tuple(OPENELM_CONFIGS)),
    "gemma3": (make_gemma3, tuple(GEMMA3_CONFIGS)),
    "phi3": (make_phi3, tuple(PHI3_CONFIGS)),
    "smollm3": (make_smollm3, tuple(SMOLLM3_CONFIGS)),
    "llama4_text": (make_llama4_text, tuple(LLAMA4_TEXT_CONFIGS)),
    "llama4": (make_llama4, tuple(LLAMA4_CONFIGS)),
    "ministral3": (make_ministral3, tuple(MINISTRAL3_CONFIGS)),
    "mistral3": (make_mistral3, tuple(MISTRAL3_WRAPPERS)),
    "qwen3_5": (make_qwen3_5, tuple(QWEN3_5_CONFIGS)),
    "qwen3_5_moe": (make_qwen3_5_moe, tuple(QWEN3_5_CONFIGS)),
    "qwen3_next": (make_qwen3_next, ("untied", "tied")),
    "lfm2": (make_lfm2, tuple(LFM2_CONFIGS)),
    "lfm2_moe": (make_lfm2_moe, tuple(LFM2_MOE_CONFIGS)),
    "glm4_moe": (make_glm4_moe, tuple(GLM4_MOE_CONFIGS)),
    "deepseek_v3": (make_deepseek_v3, tuple(DEEPSEEK_V3_CONFIGS)),
    "nemotron_h": (make_nemotron_h, tuple(NEMOTRON_H_CONFIGS)),
    "granitemoehybrid": (make_granite4, tuple(GRANITE4_CONFIGS)),
    "gemma4_text": (make_gemma4, tuple(GEMMA4_CONFIGS)),
    "qwen3_moe": (_one_config(make_qwen3_moe, "qwen3_moe"), ("qwen3_moe",)),
    "mixtral": (_one_config(make_mixtral, "mixtral"), ("mixtral",)),
    "gpt_oss": (_one_config(make_gpt_oss, "gpt_oss"), ("gpt_oss",)),
}


def every_config(*families):
    """pytest params (make, cfg), id "family-config", of every config of
    `families` (all of FAMILIES if none named)."""
    import pytest

    return [
        pytest.param(make, cfg, id=f"{family}-{cfg}")
        for family in families or FAMILIES
        for make, configs in [FAMILIES[family]]
        for cfg in configs
    ]
