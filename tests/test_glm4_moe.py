"""GLM-4.5/4.6 (models/glm4_moe.py) against mlx-lm's own `glm4_moe` class on
the same weights.

Tiny random models (tests/tiny.py `make_glm4_moe`) as Hugging Face writes
GLM-4.5: per-expert gate/up/down, a multi-token-prediction layer past the
last, q|k|v biases of either sign and size ~1, every norm gain in [0.25, 4]
(QK-norms' too), routers with large weights and a correction bias that
changes picks:
- `glm4_moe`: QK-norm beside the biases, 8 experts in 2 groups (1 kept per
  token), one dense layer, a large epsilon;
- `glm4_moe_plain`: no QK-norm, one group, 6 experts, two dense layers.
Every token's experts are compared with stock's at every step.
"""

import family
import mlx.core as mx
import mlx.nn as nn
import pytest
import tiny
from mlx.utils import tree_flatten
from tiny import PROMPT, rel

from flashnorm_mlx import kernels
from flashnorm_mlx.loading import build_model
from flashnorm_mlx.models import glm4_moe
from flashnorm_mlx.modes import FLASHNORM, STOCK

NAMES = list(tiny.GLM4_MOE_CONFIGS)
# What mlx-lm's convert -q leaves float (its router: MoEGate is no Linear) and
# quantizes (the experts), in a -q checkpoint of GLM's or DeepSeek V3's.
ROUTER_FLOAT = {
    "model.layers.1.mlp.gate.scales": False,
    "model.layers.1.mlp.switch_mlp.gate_proj.scales": True,
}

# stock_q4: mlx-lm's own `convert -q` (its router left float: MoEGate is no Linear).
folder, source, stock_q4 = family.fixtures(tiny.make_glm4_moe, NAMES)
_source = family.sources(tiny.make_glm4_moe)
greedy = family.greedy


def test_layers_and_no_norm_gain_left(source):
    """Dense and sparse layers where stock has them; folded, no input or
    post-attention gain is left, only the QK-norms' (read by the epilogue)."""
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    ours = [type(l.mlp).__name__ == "GroupRouted" for l in model.layers]
    theirs = [type(l.mlp).__name__ == "MoE" for l in stock.layers]
    assert ours == theirs and any(ours) and not all(ours), (ours, theirs)
    norms = [k for k, _ in tree_flatten(model.parameters()) if "norm" in k]
    qk = source.config["use_qk_norm"]
    assert {k.split(".")[-2] for k in norms} == ({"q_norm", "k_norm"} if qk else set())
    assert "lm_head.weight" in dict(tree_flatten(model.parameters()))


def test_verify_float32_on_the_compiled_engine(source):
    """`verify`: a prompt and 32 cached steps within 1e-4 relative of mlx-lm's
    class in float32 on the compiled engine (the eager one: every config's
    test in tests/test_architectures.py; 4-bit as stored: greedy and picks)."""
    family.verify(source, "compiled")


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock_on_both_engines(
    source, stock_q4, quantized
):
    family.greedy_is_stocks(
        stock_q4 if quantized else source,
        quantized,
        lambda flash: flash.layers[1].self_attn.qkv_proj,
    )


def _picks(src, mode, dtype, unbiased=False):
    model, _ = build_model(src, mode, dtype=dtype, engine="eager")
    if unbiased:  # the correction bias left out of the picks
        for layer in model.layers:
            if "switch_mlp" in layer.mlp:
                bias = layer.mlp.gate.e_score_correction_bias
                layer.mlp.gate.e_score_correction_bias = mx.zeros_like(bias)
    logs = family.record_picks(model, "mlp.switch_mlp")
    greedy(model, 32)
    return logs


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


def test_without_shared_experts_it_runs_as_stock():
    from flashnorm_mlx import models

    assert models.is_covered(tiny.glm4_moe_config())
    config = tiny.glm4_moe_config(n_shared_experts=None)
    assert not models.is_covered(config) and "shared" in models.stock_note(config)


def test_the_correction_bias_stays_float32_in_bfloat16_as_stocks(source):
    """mlx-lm keeps `e_score_correction_bias` float32 whatever the dtype (its
    cast_predicate; rounded to bfloat16 it would move picks): built in
    bfloat16, ours and stock hold it float32, every weight else bfloat16."""
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(source, mode, dtype=mx.bfloat16)
        dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
        bias = {k: d for k, d in dtypes.items() if "e_score" in k}
        rest = {d for k, d in dtypes.items() if "e_score" not in k}
        assert bias and set(bias.values()) == {mx.float32}, (mode, bias)
        assert rest == {mx.bfloat16}, (mode, rest)


def test_hugging_face_files_read_as_mlx_lm_reads_them(source):
    """The tiny folders are Hugging Face's layout (per-expert files, an MTP
    layer): ours and our stock against mlx-lm's own `load_model`."""
    from mlx_lm.utils import load_model

    theirs, _ = load_model(source.folder)
    x = mx.array([PROMPT])
    errs = {
        mode.name: rel(build_model(source, mode, dtype=mx.float32)[0](x), theirs(x))
        for mode in (STOCK, FLASHNORM)
    }
    print(errs)
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_fold_twice_equals_fold_once_and_compat_loads_in_mlx_lm(source, tmp_path):
    once = family.fold_once(source)
    left = [k for k in once if k.endswith("layernorm.weight")]
    assert not left, left
    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    print(errs)
    assert max(errs.values()) < tiny.f32_tol(), errs


def router_after(self, xs, ms):
    """GroupRouted.route (GLM's and DeepSeek V3's, one group) broken on
    purpose: sigmoid(z) * s in place of sigmoid(s z)."""
    w = mx.sigmoid(self.gate(xs)) * kernels.deferred_scale(ms, xs.dtype)
    pick = w + self.gate.e_score_correction_bias  # one group: no group step
    inds = mx.argpartition(-pick, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
    scores = mx.take_along_axis(w, inds, axis=-1)
    scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores * self.routed_scaling_factor


def test_the_reference_sees_what_glm_must_get_right(tmp_path, monkeypatch):
    """Each break, made on purpose, moves the logits far past the tolerance:
    the router's s applied after the sigmoid, the correction bias in the
    experts' weights, the shared experts run without s, the partial
    rotary's pass-through dims rotated, and the bias before the QK-norm added
    as b where the QK-norm form needs b / s."""
    x = mx.array([PROMPT * 2])
    breaks = {n: family.breaker(monkeypatch, _source(tmp_path, n), x) for n in NAMES}
    G = glm4_moe.GroupRouted

    def err(name, patch):
        return breaks[name](patch)

    real_route = G.route

    def biased_weights(self, xs, ms):
        inds, scores = real_route(self, xs, ms)
        bias = self.gate.e_score_correction_bias[inds]
        return inds, scores + bias * self.routed_scaling_factor

    def shared_without_s(self, xs, ms):
        return self.shared_experts(xs, mx.ones_like(ms))[0]

    def full_rotary(self, args, h):
        return nn.RoPE(h, traditional=False, base=args.rope_theta)

    A = glm4_moe.Attention

    def plain_bias(qkv, ms, bias):
        return qkv + bias

    errs = {
        "the router's s after the sigmoid": err(
            "glm4_moe_plain", lambda m: m.setattr(G, "route", router_after)
        ),
        "correction bias in the weights": err(
            "glm4_moe", lambda m: m.setattr(G, "route", biased_weights)
        ),
        "shared experts without s": err(
            "glm4_moe", lambda m: m.setattr(G, "shared", shared_without_s)
        ),
        "pass-through dims rotated": err(
            "glm4_moe", lambda m: m.setattr(A, "make_rope", full_rotary)
        ),
        "bias before the QK-norm without 1/s": err(
            "glm4_moe", lambda m: m.setattr(glm4_moe, "bias_over_s", plain_bias)
        ),
    }
    family.far_off(errs)


def test_convert_q_rtn_and_gptq_load_in_mlx_lm(tmp_path):
    """-q, both methods, on the QK-norm config: projections and experts
    quantized, the router left float as mlx-lm's -q leaves it; each --compat
    checkpoint loads in mlx-lm, whose logits there equal ours. At 8 bits; no
    ratio to stock's error is asserted (tiny random models: chaotic)."""
    family.convert_q_loads_in_mlx_lm(
        _source(tmp_path, "glm4_moe"),
        tmp_path,
        "model.layers.1.self_attn.q_proj.weight",
        stored=ROUTER_FLOAT,
        stock8=True,
    )


def test_bench_counts_fewer_launches(tmp_path):
    tiny.bench_launches(_source(tmp_path, "glm4_moe"))


def test_two_rank_tensor_parallel_matches_one_process_and_stock(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of FlashNorm on both
    configs and stock on the QK-norm one (attention by GQA groups, GLUs,
    experts and shared experts by hidden columns; float32 and FlashNorm's
    4-bit): each as one process gives it, greedy tokens identical."""
    import test_distributed

    paths = {n: tiny.make_glm4_moe(tmp_path / n, n, tokenizer=False) for n in NAMES}
    cases = family.main_cases(paths, "glm4_moe")
    test_distributed.ranks_match_one_process(cases, tmp_path)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4_as_stored"])
def test_load_peak_is_stocks(tmp_path, quantized):
    """Reading and building FlashNorm peaks within 3% of stock on the same
    12-layer folder, float32 and mlx-lm's 4-bit as stored
    (tests/test_load_memory.py's measure)."""
    over = dict(hidden_size=128, num_hidden_layers=12, vocab_size=2048)
    family.load_peak_is_stocks(tmp_path, tiny.make_glm4_moe, quantized, **over)
