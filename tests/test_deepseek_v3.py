"""DeepSeek V3 and Kimi K2 (models/deepseek_v3.py) against mlx-lm's own
`deepseek_v3` class on the same weights.

Tiny random models (tests/tiny.py `make_deepseek_v3`), built with mlx-lm's
class and saved as `mlx_lm.convert` saves them (embed_q / unembed_out,
stacked experts), every norm gain in [0.25, 4] (the latent norms' too),
routers with large weights and a correction bias that changes picks:
- `deepseek_v3`: DeepSeek V3's YaRN (its mscale in the softmax scale), 8
  experts in 2 groups (1 kept per token), one dense layer, a large epsilon;
- `kimi_k2`: Kimi K2's model_type (mlx-lm remaps it), one group, 6 experts,
  experts on layer 2 alone (`moe_layer_freq` 2), plain RoPE.
Every token's experts are compared with stock's at every step.
"""

import family
import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten
from test_glm4_moe import (  # GLM's grouped router, the same
    ROUTER_FLOAT,
    _picks,
    router_after,
)
from tiny import PROMPT, rel

from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.models import deepseek_v3
from flashnorm_mlx.modes import FLASHNORM, STOCK

NAMES = list(tiny.DEEPSEEK_V3_CONFIGS)

# stock_q4: mlx-lm's own `convert -q` (its router left float: MoEGate is no Linear).
folder, source, stock_q4 = family.fixtures(tiny.make_deepseek_v3, NAMES)
_source = family.sources(tiny.make_deepseek_v3)


def test_layers_and_no_norm_gain_left(source):
    """Dense and sparse layers where stock has them (first_k_dense_replace,
    moe_layer_freq); folded, no norm gain is left, the latent norms' neither."""
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    ours = [type(l.mlp).__name__ == "GroupRouted" for l in model.layers]
    theirs = [type(l.mlp).__name__ == "DeepseekV3MoE" for l in stock.layers]
    assert ours == theirs and any(ours) and not all(ours), (ours, theirs)
    norms = [k for k, _ in tree_flatten(model.parameters()) if "norm" in k]
    assert not norms, norms
    assert "lm_head.weight" in dict(tree_flatten(model.parameters()))


def test_verify_float32_on_the_compiled_engine(tmp_path):
    """`verify`: a prompt and 32 cached steps within 1e-4 relative of mlx-lm's
    class in float32 on the compiled engine, on the YaRN config (the eager
    engine, both configs: tests/test_architectures.py; Kimi K2's compiled
    step: tests/test_engine.py; 4-bit as stored: greedy and picks)."""
    source = _source(tmp_path, "deepseek_v3")
    family.verify(source, "compiled")


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock_on_both_engines(
    source, stock_q4, quantized
):
    family.greedy_is_stocks(
        stock_q4 if quantized else source,
        quantized,
        lambda flash: flash.layers[1].self_attn.q_kv_a_proj,
    )


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_every_tokens_experts_are_stocks_at_every_step(source, stock_q4, quantized):
    """The experts each token picks (the correction bias and the groups
    choosing, the sigmoid scores not) equal stock's, prompt and 32 greedy
    steps; they vary with the token, and the bias changes some."""
    src = stock_q4 if quantized else source
    dtype = None if quantized else mx.float32
    ls, lf = (_picks(src, mode, dtype) for mode in (STOCK, FLASHNORM))
    family.picks_are_stocks(ls, lf, source.config["num_experts_per_tok"])
    if not quantized:
        moved = family.differ(ls, _picks(src, STOCK, dtype, unbiased=True))
        assert moved, "the correction bias changes no pick"


def test_what_is_not_folded_runs_as_stock():
    """No q latent, attention biases, a tied head, no shared experts: stock,
    with a note naming what; Kimi K2's model_type is covered."""
    from flashnorm_mlx import models

    assert models.is_covered(tiny.deepseek_v3_config())
    assert models.is_covered(tiny.deepseek_v3_config("kimi_k2"))
    for over, word in (
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(attention_bias=True), "biases"),
        (dict(tie_word_embeddings=True), "tied"),
        (dict(n_shared_experts=None), "shared"),
    ):
        config = tiny.deepseek_v3_config(**over)
        assert not models.is_covered(config), over
        assert word in models.stock_note(config), (over, models.stock_note(config))


def test_the_correction_bias_stays_float32_in_bfloat16_as_stocks(source):
    """mlx-lm keeps `e_score_correction_bias` float32 whatever the dtype: built
    in bfloat16, ours and stock hold it float32, every weight else bfloat16."""
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(source, mode, dtype=mx.bfloat16)
        dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
        bias = {k: d for k, d in dtypes.items() if "e_score" in k}
        rest = {d for k, d in dtypes.items() if "e_score" not in k}
        assert bias and set(bias.values()) == {mx.float32}, (mode, bias)
        assert rest == {mx.bfloat16}, (mode, rest)


def test_hugging_face_kv_b_proj_and_per_expert_files(tmp_path):
    """Hugging Face's layout (kv_b_proj whole, one module per expert) read as
    mlx-lm's sanitize reads it: mlx-lm's `load_model` and ours (its
    `canonical` split) on those files give stock's logits on the saved layout."""
    import numpy as np

    folder = tiny.make_deepseek_v3(tmp_path / "mlx", tokenizer=False)
    src = read_source(str(folder))
    cfg = src.config
    w = dict(src.weights)
    for k in [k for k in w if k.endswith("embed_q.weight") and "un" not in k]:
        p = k[: -len(".embed_q.weight")]
        wk = w.pop(k).swapaxes(-1, -2)  # (H, nope, r)
        wv = w.pop(f"{p}.unembed_out.weight")  # (H, v, r)
        w[f"{p}.kv_b_proj.weight"] = mx.concatenate([wk, wv], axis=1).reshape(
            -1, cfg["kv_lora_rank"]
        )
    for k in [k for k in w if ".switch_mlp." in k]:
        stacked, head = w.pop(k), k.replace(".switch_mlp.", ".experts.{e}.")
        for e in range(stacked.shape[0]):
            w[head.format(e=e)] = stacked[e]
    w = {k: np.array(v) for k, v in w.items()}
    path = tiny.write_model(tmp_path / "hf", cfg, w, tokenizer=False)
    stored = mx.load(str(path / "model.safetensors"))
    assert "model.layers.1.self_attn.kv_b_proj.weight" in stored, list(stored)
    hf = read_source(str(path))  # its canonical form: kv_b_proj split
    x = mx.array([PROMPT])
    want = build_model(src, STOCK, dtype=mx.float32)[0](x)
    from mlx_lm.utils import load_model

    errs = {
        "mlx-lm's load_model": rel(load_model(path)[0](x), want),
        "flashnorm": rel(build_model(hf, FLASHNORM, dtype=mx.float32)[0](x), want),
    }
    print(errs)
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_fold_twice_equals_fold_once_and_compat_loads_in_mlx_lm(source, tmp_path):
    once = family.fold_once(source)
    left = [k for k in once if k.endswith("norm.weight")]
    assert not left, left
    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    print(errs)
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_the_reference_sees_what_mla_must_get_right(tmp_path, monkeypatch):
    """Each break, made on purpose, moves the logits far past the tolerance:
    s left on the kv latent past its norm (where the norm cancels it), s
    missing from the rotary key part, the router's s after the sigmoid."""
    x = mx.array([PROMPT * 2])
    breaks = {n: family.breaker(monkeypatch, _source(tmp_path, n), x) for n in NAMES}
    A, G = deepseek_v3.Attention, deepseek_v3.GroupRouted

    def err(name, patch):
        return breaks[name](patch)

    real_latents = A.latents

    def s_kept(self, xs, ms):  # s left on the kv latent after its norm
        q, latent, k_pe = real_latents(self, xs, ms)
        return q, (latent * mx.rsqrt(ms)[:, None]).astype(latent.dtype), k_pe

    def k_pe_without_s(self, xs, ms):
        q, latent, k_pe = real_latents(self, xs, ms)
        return q, latent, (k_pe * mx.sqrt(ms)[:, None]).astype(k_pe.dtype)

    errs = {
        "s on the latents": err(
            "deepseek_v3",
            lambda m: m.setattr(A, "latents", s_kept),
        ),
        "no s on k_pe": err(
            "deepseek_v3", lambda m: m.setattr(A, "latents", k_pe_without_s)
        ),
        "the router's s after the sigmoid": err(
            "kimi_k2", lambda m: m.setattr(G, "route", router_after)
        ),
    }
    family.far_off(errs)


def test_convert_q_rtn_and_gptq_load_in_mlx_lm(tmp_path):
    """-q, both methods, on the YaRN config: projections and experts
    quantized, the router left float as mlx-lm's -q leaves it; each --compat
    checkpoint loads in mlx-lm, whose logits there equal ours. At 8 bits; no
    ratio to stock's error is asserted (tiny random models: chaotic)."""
    family.convert_q_loads_in_mlx_lm(
        _source(tmp_path, "deepseek_v3"),
        tmp_path,
        "model.layers.1.self_attn.q_b_proj.weight",
        stored=ROUTER_FLOAT,
        stock8=True,
    )


def test_bench_counts_fewer_launches(tmp_path):
    tiny.bench_launches(_source(tmp_path, "deepseek_v3"))


def test_two_rank_tensor_parallel_matches_one_process_and_stock(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of FlashNorm on both
    configs and stock on the YaRN one (MLA by heads, GLUs, experts and shared
    experts by hidden columns; float32 and FlashNorm's 4-bit): each as one
    process gives it, greedy tokens identical."""
    import test_distributed

    paths = {n: tiny.make_deepseek_v3(tmp_path / n, n, tokenizer=False) for n in NAMES}
    cases = family.main_cases(paths, "deepseek_v3")
    test_distributed.ranks_match_one_process(cases, tmp_path)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4_as_stored"])
def test_load_peak_is_stocks(tmp_path, quantized):
    """Reading and building FlashNorm peaks within 3% of stock on the same
    12-layer folder, float32 and mlx-lm's 4-bit as stored
    (tests/test_load_memory.py's measure)."""
    over = dict(hidden_size=128, num_hidden_layers=12, vocab_size=2048)
    family.load_peak_is_stocks(tmp_path, tiny.make_deepseek_v3, quantized, **over)
