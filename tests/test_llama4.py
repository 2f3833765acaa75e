"""Llama 4's dense text model (models/llama4_text.py) against mlx-lm's own
`llama4_text` class on the same weights.

Tiny random models (tests/tiny.py `make_llama4_text`), every norm gain in
[0.25, 4]:
- `llama4_text`: a weightless QK-norm on every layer with a large epsilon
  (its eps * ms adjustment shows), the fourth layer without RoPE, untied
  (`output`);
- `llama4_text_tied`: no QK-norm, the first layer without RoPE, tied.
The `llama4` wrapper (experts, chunked attention) runs as stock
(docs/design.md section 2q).
"""

import dataclasses

import family
import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten
from tiny import PROMPT

from flashnorm_mlx import fold, kernels
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.models import llama4_text
from flashnorm_mlx.modes import FLASHNORM, STOCK

NAMES = list(tiny.LLAMA4_TEXT_CONFIGS)


folder, source = family.fixtures(tiny.make_llama4_text, NAMES)[:2]
_source = family.sources(tiny.make_llama4_text)
greedy = family.greedy


def test_nope_layers_and_no_norm_gain_left(source):
    """RoPE where stock's `no_rope_layers` says; folded, no block norm gain is
    left (the final one only where the head is tied), the head `output`."""
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    got = [int(l.self_attn._angles.inv_freq.any().item()) for l in model.layers]
    assert got == source.config["no_rope_layers"], got
    names = {k for k, _ in tree_flatten(model.parameters())}
    left = {k for k in names if "norm" in k}
    tied = source.config["tie_word_embeddings"]
    assert left == ({"model.norm.weight"} if tied else set()), left
    assert ("output.weight" in names) == (not tied), names


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_verify_float32(source, engine):
    """`verify`: a prompt and 32 cached steps within 1e-4 relative of mlx-lm's
    class in float32 (compiled: the QK-norm config only)."""
    if engine == "compiled" and not source.config["use_qk_norm"]:
        pytest.skip("the compiled engine on one config")
    family.verify(source, engine)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock(source, tmp_path, quantized):
    """Float32, and mlx-lm's own `convert -q` run as stored (4-bit; untied
    only: stock's tied head multiplies by the embedding's packed weight)."""
    if quantized and source.config["tie_word_embeddings"]:
        pytest.skip("mlx-lm's llama4_text cannot run its own 4-bit tied head")
    family.greedy_is_stocks(
        tiny.mlx_q4(source.folder, tmp_path / "q4") if quantized else source,
        quantized,
        lambda flash: flash.layers[1].self_attn.qkv_proj,
        engines=("eager",),
    )


def test_the_reference_sees_what_llama4_text_must_get_right(tmp_path, monkeypatch):
    """Each break, made on purpose, moves the logits far past the tolerance:
    RoPE on the NoPE layers, stock's interleaved RoPE read half-split without
    q's and k's rows reordered, and the QK-norm's epsilon left eps where the
    deferred s needs eps * ms (2d)."""
    src = _source(tmp_path, "llama4_text")
    err = family.breaker(monkeypatch, src, mx.array([PROMPT * 2]))
    A = llama4_text.Attention

    real_init, real_epilogue = A.__init__, kernels.qkv_epilogue

    def rope_everywhere(self, args, use_rope):
        real_init(self, args, True)

    def eps_kept(qkv, ms, offset, e):  # QK-norm's eps * 1 in place of eps * ms
        q, k, _ = real_epilogue(qkv, mx.ones_like(ms), offset, e)
        return q, k, real_epilogue(qkv, ms, offset, e)[2]

    errs = {
        "RoPE on a NoPE layer": err(
            lambda m: m.setattr(A, "__init__", rope_everywhere)
        ),
        "interleaved RoPE, rows not reordered": err(
            lambda m: m.setattr(llama4_text, "half_split", lambda w, heads: w)
        ),
        "QK-norm eps not adjusted": err(
            lambda m: m.setattr(kernels, "qkv_epilogue", eps_kept)
        ),
    }
    family.far_off(errs)


def test_fold_twice_and_convert_q_rtn_and_gptq_load_in_mlx_lm(tmp_path):
    """Fold is idempotent; `convert --compat` (float, and -q at 8 bits by RTN
    and GPTQ) loads in mlx-lm, whose logits there equal ours."""
    source = _source(tmp_path, "llama4_text")
    once = family.fold_once(source)
    assert not [k for k in once if k.endswith("layernorm.weight")]
    family.compat_loads_in_mlx_lm(source, tmp_path)


def test_bench_counts_fewer_launches(tmp_path):
    tiny.bench_launches(_source(tmp_path, "llama4_text"))


def test_two_rank_tensor_parallel_matches_one_process(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of both configs and
    FlashNorm's 4-bit: each as one process gives it, greedy tokens identical."""
    import test_distributed

    make = tiny.make_llama4_text
    paths = {n: make(tmp_path / n, n, tokenizer=False) for n in NAMES}
    cases = family.main_cases(paths, NAMES[0], ())
    test_distributed.ranks_match_one_process(cases, tmp_path)


def test_load_peak_is_stocks(tmp_path):
    """Reading and building FlashNorm peaks within 3% of stock on the same
    12-layer folder (tests/test_load_memory.py's measure)."""
    over = dict(hidden_size=128, num_hidden_layers=12, vocab_size=2048)
    over["no_rope_layers"] = [1, 1, 1, 0] * 3
    family.load_peak_is_stocks(tmp_path, tiny.make_llama4_text, False, **over)


# --- the llama4 wrapper: top-1 sigmoid experts, chunked attention --------------------
# (tests/tiny.py `make_llama4`: every layer MoE with QK-norm; MoE every other
# layer, dense between, llama3 RoPE; chunks of 8, so the prompt crosses one;
# the fourth layer without RoPE, its query temperature moving every 4 tokens.)

MOE_NAMES = list(tiny.LLAMA4_CONFIGS)


@pytest.fixture(scope="module", params=MOE_NAMES)
def moe_source(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return read_source(str(tiny.make_llama4(path, request.param)))


_moe_source = family.sources(tiny.make_llama4)


def test_moe_layers_and_no_norm_gain_left(moe_source):
    model, _ = build_model(moe_source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(moe_source, STOCK, dtype=mx.float32)
    ours = [type(l.feed_forward).__name__ == "Routed" for l in model.layers]
    theirs = [type(l.feed_forward).__name__ == "MoE" for l in stock.layers]
    assert ours == theirs and any(ours), (ours, theirs)
    names = {k for k, _ in tree_flatten(model.parameters())}
    assert not {k for k in names if "norm" in k}, names
    assert "language_model.lm_head.weight" in names


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_moe_verify_float32(moe_source, engine):
    """A prompt crossing a chunk and 32 cached steps within 1e-4 relative of
    mlx-lm's llama4 class in float32 (compiled: the every-layer-MoE config)."""
    if engine == "compiled" and moe_source.config["interleave_moe_layer_step"] > 1:
        pytest.skip("the compiled engine on one config")
    family.verify(moe_source, engine)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_moe_64_greedy_tokens_and_every_pick_are_stocks(
    moe_source, tmp_path, quantized
):
    """Float32 and mlx-lm's own `convert -q` as stored: 64 greedy tokens, and
    each token's expert at every step (prompt and 32 steps), as stock's."""
    stock, flash = family.greedy_is_stocks(
        tiny.mlx_q4(moe_source.folder, tmp_path / "q4") if quantized else moe_source,
        quantized,
        lambda flash: flash.layers[1].self_attn.qkv_proj,
        engines=("eager",),
    )
    ls = family.record_picks(stock, "feed_forward.experts")
    lf = family.record_picks(flash, "feed_forward.experts")
    greedy(stock, 32), greedy(flash, 32)
    family.picks_are_stocks(ls, lf, 1)  # top-1


def test_the_reference_sees_what_llama4_must_get_right(tmp_path, monkeypatch):
    """Each break, made on purpose, moves the logits far past the tolerance:
    the router's s after the sigmoid, the score on the expert's output in
    place of its input, RoPE on the NoPE layer, the QK-norm's eps not eps * ms."""
    from flashnorm_mlx.models import llama4

    # Embeddings of RMS ~1e-3 and a tiny rms_norm_eps: the first layer's
    # QK-norm then sees rows whose mean square is near stock's eps of 1e-6.
    path = tiny.make_llama4(tmp_path / "m", "llama4", rms_norm_eps=1e-9)
    src = read_source(str(path))
    emb = "language_model.model.embed_tokens.weight"
    src = dataclasses.replace(
        src, folder=None, weights={**src.weights, emb: src.weights[emb] * 1e-3}
    )
    err = family.breaker(monkeypatch, src, mx.array([PROMPT * 2]))
    R = llama4.Routed

    def routed(score_of, on_output):
        def call(self, xs, ms):
            z = self.router(xs)
            inds = mx.argpartition(-z, kth=0, axis=-1)[..., :1]
            score = score_of(mx.take_along_axis(z, inds, axis=-1), ms)
            if on_output:
                y = self.experts(xs, ms, inds).squeeze(-2) * score
            else:
                y = self.experts(xs * score, ms, inds).squeeze(-2)
            return y + self.shared_expert(xs, ms)[0], ms

        return call

    right = lambda z, ms: mx.sigmoid(kernels.scaled(z, ms))  # noqa: E731
    after = lambda z, ms: mx.sigmoid(z) * kernels.deferred_scale(  # noqa: E731
        ms, z.dtype
    )
    real_epilogue = kernels.qkv_epilogue

    def eps_kept(qkv, ms, offset, e):  # QK-norm's eps * 1 in place of eps * ms
        if e.q_gain is None:  # the NoPE layer: s on q and k, no QK-norm
            return real_epilogue(qkv, ms, offset, e)
        q, k, _ = real_epilogue(qkv, mx.ones_like(ms), offset, e)
        return q, k, real_epilogue(qkv, ms, offset, e)[2]

    errs = {
        "the reference itself": err(
            lambda m: m.setattr(R, "__call__", routed(right, False))
        ),
        "the router's s after the sigmoid": err(
            lambda m: m.setattr(R, "__call__", routed(after, False))
        ),
        "the score on the expert's output": err(
            lambda m: m.setattr(R, "__call__", routed(right, True))
        ),
        "RoPE on a NoPE layer": err(
            lambda m: m.setattr(llama4, "uses_rope", lambda i: True)
        ),
        "QK-norm eps not adjusted": err(
            lambda m: m.setattr(kernels, "qkv_epilogue", eps_kept)
        ),
    }
    print(errs)
    assert errs.pop("the reference itself") < tiny.f32_tol(), errs
    assert all(e > 10 * tiny.f32_tol() for e in errs.values()), errs


def test_moe_convert_q_rtn_and_gptq_load_in_mlx_lm(tmp_path):
    """--compat (float) and -q at 8 bits by RTN and GPTQ: each checkpoint
    loads in mlx-lm (its llama4 wrapper class), whose logits equal ours."""
    source = _moe_source(tmp_path, "llama4_interleaved")
    once, c1 = fold.fold_norms(source.weights, source.config)
    assert fold.fold_norms(once, c1)[0] is once
    family.compat_loads_in_mlx_lm(
        source, tmp_path, "experts.gate_proj.scales", "mlx_lm.models.llama4"
    )


def test_moe_bench_counts_fewer_launches(tmp_path):
    tiny.bench_launches(_moe_source(tmp_path, "llama4"))


def test_moe_two_rank_tensor_parallel_matches_one_process(tmp_path):
    """A 2-rank launch of both configs, stock and FlashNorm's 4-bit on the
    every-layer-MoE one: each as one process gives it."""
    import test_distributed

    paths = {n: tiny.make_llama4(tmp_path / n, n, tokenizer=False) for n in MOE_NAMES}
    cases = family.main_cases(paths, "llama4")
    test_distributed.ranks_match_one_process(cases, tmp_path)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4_as_stored"])
def test_moe_load_peak_is_stocks(tmp_path, quantized):
    over = dict(hidden_size=128, num_hidden_layers=12, vocab_size=2048)
    over["no_rope_layers"] = [1, 1, 1, 0] * 3
    family.load_peak_is_stocks(
        tmp_path, tiny.make_llama4, quantized, name="llama4", **over
    )


def test_what_no_llama4_checkpoint_has_runs_as_stock():
    """Attention biases, a tied head, two experts a token: the wrapper is read
    as it is (mlx-lm's own class), with a note of why."""
    from flashnorm_mlx import models
    from flashnorm_mlx.loading import wrappers

    config = wrappers.text_config(tiny.llama4_config(), "config.json")
    assert config["model_type"] == "llama4" and models.is_covered(config)
    for over in (
        dict(attention_bias=True),
        dict(tie_word_embeddings=True),
        dict(num_experts_per_tok=2),
    ):
        wrapper = tiny.llama4_config(**over)
        assert wrappers.text_config(wrapper, "config.json") is None, over
        flat = {**wrapper["text_config"], "model_type": "llama4"}
        assert "llama4" in models.uncovered_why(flat), over
