"""FlashNorm Gemma 3 (gemma3_text) against mlx-lm's own class on the same weights.

Tiny random models (tests/tiny.py): stored norm weights w of gains 1 + w far
from 0 and some near -1, six layers (two local, local, global patterns), a
sliding window of 6 (shorter than every prompt plus decode here), QK-norm,
sandwich norms, GELU (tanh), one tied head with linear RoPE scaling on the
global layers and one untied with a large eps.
"""

import io
import re
import sys

import family
import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from tiny import PROMPT, rel

from flashnorm_mlx import fold, kernels
from flashnorm_mlx.jobs import speed
from flashnorm_mlx.jobs.checkpoint import convert
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import Source, build_model, read_source
from flashnorm_mlx.models import gemma3
from flashnorm_mlx.modes import FLASHNORM, STOCK


@pytest.fixture(scope="module", params=list(tiny.GEMMA3_CONFIGS))
def source(request, tmp_path_factory):
    path = tiny.make_gemma3(tmp_path_factory.mktemp(request.param), request.param)
    return read_source(str(path))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = tiny.make_gemma3(tmp_path_factory.mktemp("g3"), "gemma3_tied")
    return read_source(str(path))


def test_classes_and_what_is_left_of_the_norms(source):
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    assert type(stock).__module__ == "mlx_lm.models.gemma3_text"
    assert type(flash).__module__ == "flashnorm_mlx.models.gemma3"
    names = {n for n, _ in flash.named_modules()}
    # Pre-norms folded away; post-norms kept (they cannot fold); the final
    # norm only before a tied head.
    assert not any(
        n.endswith(("input_layernorm", "pre_feedforward_layernorm")) for n in names
    )
    layers = source.config["num_hidden_layers"]
    posts = [
        n
        for n in names
        if n.endswith(("post_attention_layernorm", "post_feedforward_layernorm"))
    ]
    assert len(posts) == 2 * layers, posts
    assert ("model.norm" in names) == source.config.get("tie_word_embeddings", True)
    # mlx-lm's caches: rotating on the local layers, every third layer global.
    caches = flash.make_cache()
    kinds = [type(c) for c in caches]
    assert kinds == [type(c) for c in stock.make_cache()], kinds
    assert kinds == [RotatingKVCache, RotatingKVCache, KVCache] * (layers // 3), kinds


def test_prompt_and_32_cached_steps_across_the_window_match_stock(source):
    """Directly: prefill 12 tokens (window 6), then 32 decode steps on stock's
    greedy tokens; every float32 logit row within 1e-4 relative."""
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    errs, cf = family.cached_errors(stock, flash)
    assert cf[0].offset == len(PROMPT) + 32 > 4 * source.config["sliding_window"]
    assert max(errs) < tiny.f32_tol(), f"max rel logit diff {max(errs):.3e}: {errs}"


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_verify_float32_and_quantized_as_stored(source, engine):
    """`verify`'s comparison: float32, and stock's own 4-bit model as stored
    (the gains then applied in the kernels, 1 + w)."""
    family.verify(source, engine, tiny.quantized(source))


def test_bfloat16_checkpoint_verified_in_float32(tmp_path):
    """Gemma checkpoints ship bfloat16 norm weights w. Run in float32, stock's
    gain is 1 + w in float32; folding 1 + w rounded to bfloat16 instead was
    2.4e-2 off (relative logits). The fold takes the gain at the run's dtype."""
    cfg = tiny.gemma3_config("gemma3_tied")
    w = {
        k: mx.array(v).astype(mx.bfloat16) for k, v in tiny.gemma3_weights(cfg).items()
    }
    src = read_source(str(tiny.write_model(tmp_path / "bf16", cfg, w)))
    r = compare(src, PROMPT, horizon=16, dtype=mx.float32)
    assert r["max_rel_logit_diff"] < tiny.f32_tol() and r["greedy_match"] == 16, r


def test_a_stored_head_is_used_as_stock_uses_it(tied, tmp_path):
    """mlx-lm's Gemma unties its head when the weights hold lm_head.weight,
    whatever the config says; ours does the same (its final norm kept)."""
    w = {k: np.array(v) for k, v in tied.weights.items()}
    w["lm_head.weight"] = (
        np.random.default_rng(5).standard_normal((300, 64)).astype(np.float32)
    )
    src = read_source(str(tiny.write_model(tmp_path / "head", tied.config, w)))
    r = compare(src, PROMPT, horizon=8, dtype=mx.float32)
    assert r["max_rel_logit_diff"] < tiny.f32_tol() and r["greedy_match"] == 8, r


def test_perplexity_agrees_in_float32(source):
    from flashnorm_mlx.jobs.likelihood import default_text, perplexity

    r = perplexity(
        source, text=default_text()[:3000], seq_len=32, num_seqs=2, dtype=mx.float32
    )
    assert abs(r["diff_rel"]) < tiny.f32_tol(), r


def greedy(model, n=64):
    steps = generate_step(mx.array(PROMPT), model, max_tokens=n)
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock(tied, quantized):
    src = tiny.quantized(tied) if quantized else tied
    dtype = None if quantized else mx.float32
    stock, _ = build_model(src, STOCK, dtype=dtype)
    flash, _ = build_model(src, FLASHNORM, dtype=dtype)
    if quantized:
        qkv = flash.layers[0].self_attn.qkv_proj
        assert type(qkv).__name__ == "QuantizedLinear", type(qkv)
        assert "input_layernorm" in flash.layers[0]  # gains kept, applied in kernels
    want = greedy(stock)
    assert len(want) == 64 and greedy(flash) == want


def test_the_reference_sees_what_gemma_must_get_right(source, monkeypatch):
    """Drop the 1 + w offset of the post-norms, the embedding scale, or (with a
    large eps) the post-norm's epsilon adjustment for the FFN's deferred scale,
    and the logits move far beyond the tolerance."""
    from flashnorm_mlx.kernels import post_norm

    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    x = mx.array([PROMPT])
    ref = stock(x)

    def broken(patch):
        with monkeypatch.context() as m:
            patch(m)
            flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
            return rel(flash(x), ref)

    errs = {
        "post gain w, not 1 + w": broken(
            lambda m: m.setattr(
                gemma3.TransformerBlock,
                "post_gain",
                lambda self, i: self[self.POST_NORMS[i]].weight,
            )
        ),
        "no embedding scale": broken(
            lambda m: m.setattr(gemma3.Architecture, "embedding_scale", lambda s, c: 1)
        ),
    }
    if source.config["rms_norm_eps"] >= 0.01:
        real = post_norm.post_norm_sum
        errs["post-norm eps not scaled"] = broken(
            lambda m: m.setattr(
                post_norm,
                "post_norm_sum",
                lambda h, y, ms_y, g, eps: real(h, y, None, g, eps),
            )
        )
    family.far_off(errs)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_finite_and_close(source, dtype):
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    x = mx.array([PROMPT])
    r = ref(x)
    err = {}
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(source, mode, dtype=dtype)
        out = model(x)
        assert mx.isfinite(out).all().item(), mode
        err[mode.name] = rel(out, r)
    tol = {mx.float16: 0.03, mx.bfloat16: 0.12}[dtype]  # as for Llama (test_llama)
    assert err["flashnorm"] < tol, err


def test_float16_large_activations_at_least_as_safe_as_stock(source):
    """mlx-lm's Gemma clips each residual sum to float16's range
    (`clip_residual`); FlashNorm's post-norm residual does the same, so it is
    finite wherever stock is. Here one position's input embedding is 65504 / 8
    in every element: after the sqrt(64) scale the residual is float16's
    largest finite value, so a positive post-norm output overflows it unless
    the sum is clipped (given as embeddings: in a tied head such a row would
    overflow the logits themselves)."""
    e = source.weights["model.embed_tokens.weight"]
    h = mx.array(np.array(e)[[9, 17, 5, 9, 64]])
    h[1] = 65504.0 / 8
    h[3] = h[3] * 1000  # and a large, ordinary row
    h = h[None].astype(mx.float16)
    # Post-norm gains of 1 + 31: outputs well past float16's rounding margin
    # at 65504 (a sum below 65520 would round back to it, clip or not).
    key = "model.layers.0.post_attention_layernorm.weight"
    big = Source(
        source.name, source.config, {**source.weights, key: mx.full((64,), 31.0)}
    )
    finite = {}
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(big, mode, dtype=mx.float16)
        cache = make_prompt_cache(model)
        # A copy each: mlx-lm's Gemma scales its input embeddings in place.
        out = model(None, cache=cache, input_embeddings=mx.array(h))
        finite[mode.name] = mx.isfinite(out).all().item()
    assert finite["stock"], "the case must be one stock survives"
    assert finite["flashnorm"], finite


def test_fold_twice_equals_fold_once_and_compat_writes_unit_gains(tied):
    once_w, once_c = fold.fold_norms(tied.weights, tied.config, compat=True)
    twice_w, twice_c = fold.fold_norms(once_w, once_c)
    assert once_c == twice_c and once_w.keys() == twice_w.keys()
    assert all(mx.array_equal(once_w[k], twice_w[k]).item() for k in once_w)
    # Gemma's unit gain 1 + w is w = 0; the post-norms and QK-norms keep theirs.
    p = "model.layers.0"
    assert not once_w[f"{p}.input_layernorm.weight"].any().item()
    assert not once_w[f"{p}.pre_feedforward_layernorm.weight"].any().item()
    for n in ("post_attention_layernorm", "self_attn.q_norm"):
        assert mx.array_equal(
            once_w[f"{p}.{n}.weight"], tied.weights[f"{p}.{n}.weight"]
        )


def test_convert_compat_loads_in_stock_mlx_lm(source, tmp_path):
    """`convert --compat` loads in stock mlx-lm; without --compat, `--mode
    stock` on the folded checkpoint restores the unit gains (w = 0) itself."""
    family.compat_and_stock_on_folded(
        source, tmp_path, "model.layers.0.input_layernorm.weight"
    )


def test_convert_quantized_runs(tied, tmp_path):
    out = tmp_path / "q4"
    convert(tied, out, quantize=(4, 32), progress=False, q_method="gptq")
    model, _ = build_model(read_source(str(out)), FLASHNORM)
    assert type(model.layers[0].mlp.gate_up_proj).__name__ == "QuantizedLinear"
    assert mx.isfinite(model(mx.array([PROMPT]))).all().item()


def test_bench_runs_every_variant_and_counts_fewer_launches(tied):
    r = speed.run_bench(tied, prompt_tokens=6, gen_tokens=3, trials=1)
    v = r["variants"]
    assert all(v[n]["logits_finite"] and v[n]["all_trials_finite"] for n in v), v
    assert v["nonorm"]["rms_norm_modules"] == 0, v["nonorm"]
    gpu = {n: v[n]["dispatches_per_token_gpu_model"] for n in v}
    print("launches per decode step:", gpu)
    assert gpu["flashnorm"] < gpu["nonorm"] < gpu["stock_fused"] < gpu["stock"], gpu


def test_chat_compare_runs_on_gemma(tied, monkeypatch, capsys):
    from flashnorm_mlx.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/compare\n/quit\n"))
    rc = main(["chat", tied.name, "-m", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    line = re.search(r"^decode tok/s, last reply regenerated.*$", out, re.M)
    assert line and "flashnorm" in line.group(0) and "stock" in line.group(0), out


def test_post_norm_kernel_is_picked_and_its_launch_counted(tied):
    """The post-norm residual runs through the picker, so `bench` counts it as
    one launch per half-block (dispatch.gpu_like)."""
    calls = []

    def choose(op, kernel, ops):
        calls.append(op)
        return ops

    flash, _ = build_model(tied, FLASHNORM, dtype=mx.float32)
    with kernels.picking(choose):
        flash(mx.array([PROMPT]))
    layers = tied.config["num_hidden_layers"]
    assert calls.count("post_residual") == 2 * layers - 1, calls
    assert calls.count("post_residual_norm") == 1, calls
    assert calls.count("deferred_glu") == layers, calls


def test_two_rank_tensor_parallel_matches_one_process_and_stock(tied, tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py): FlashNorm and stock
    Gemma sharded (2:1 query:key/value heads and 48 hidden columns per rank),
    prompt and 16 cached greedy steps across the window. Each as one process
    within 1e-5 (all-sums add in another order), sharded FlashNorm against
    stock in one process within 1e-4, greedy tokens identical."""
    import test_distributed

    cases = [{"name": m, "model": tied.name, "mode": m} for m in ("flashnorm", "stock")]
    got, one, errs, secs = test_distributed.two_ranks_and_one(cases, tmp_path)
    stock = one["stock"][0]
    to_stock = np.abs(got["flashnorm/logits"] - stock).max() / np.abs(stock).max()
    print(f"2 ranks in {secs:.1f} s; vs one process {errs}, vs stock {to_stock:.2e}")
    assert max(errs.values()) < tiny.shard_tol(), errs
    assert to_stock < tiny.f32_tol(), to_stock


def _gguf_names() -> dict:
    """HF module (in a layer) -> llama.cpp's tensor name for Gemma 3 (its
    converter): Llama's names, but for the sandwich norms around the FFN."""
    from test_gguf import HF_TO_GGUF_LAYER

    return {
        **HF_TO_GGUF_LAYER,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }


GGUF_NAMES = _gguf_names()
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
BOTH = (STOCK, FLASHNORM)


def write_gemma3_gguf(path, cfg, weights, shift=1.0, **meta_kw):
    """A gemma3 GGUF as llama.cpp's converter writes one: every norm weight
    stored as w + shift (its `norm_shift`, 1), no Q/K permutation, the
    sliding window in the metadata (a byte-level vocabulary, as test_gguf's)."""
    from test_gguf import tiny_metadata

    tensors = {}
    for k, v in weights.items():
        module, _, suffix = k.rpartition(".")
        if module.endswith("norm"):
            v = v + shift
        if module in GLOBAL_NAMES:
            name = GLOBAL_NAMES[module]
        else:
            _, _, i, rest = module.split(".", 3)
            name = f"blk.{i}.{GGUF_NAMES[rest]}"
        tensors[f"{name}.{suffix}"] = mx.array(v)
    meta = tiny_metadata(cfg, arch="gemma3")
    meta["gemma3.attention.sliding_window"] = mx.array(6, dtype=mx.uint32)
    meta.update({f"gemma3.{k}": v for k, v in meta_kw.items()})
    mx.save_gguf(str(path), tensors, meta)
    return path


def test_llama_cpp_gemma3_gguf_loads_as_its_hf_checkpoint(tmp_path):
    """Twelve layers in llama.cpp's pattern (every 6th global), the attention
    scale it derives (1/sqrt(head_dim)), local RoPE base 10000, linear scaling
    on the global layers: the GGUF (norms stored 1 + w) runs as the Hugging Face
    folder does, stock and FlashNorm, within float32 rounding. The same file
    written with w as is (no shift) would load 1 off every gain: far off."""
    cfg = dict(
        tiny.gemma3_config("gemma3_tied"),
        num_hidden_layers=12,
        sliding_window_pattern=6,
        query_pre_attn_scalar=16,
        rope_scaling={"type": "linear", "factor": 8.0},
    )
    w = tiny.gemma3_weights(cfg, seed=3)
    hf = read_source(str(tiny.write_model(tmp_path / "hf", cfg, w)))
    src = read_source(str(write_gemma3_gguf(tmp_path / "g.gguf", cfg, w)))
    c = src.config
    assert c["model_type"] == "gemma3_text" and c["sliding_window_pattern"] == 6
    assert c["query_pre_attn_scalar"] == 16 and c["rope_local_base_freq"] == 10000
    x = mx.array([PROMPT])
    ref = build_model(hf, STOCK, dtype=mx.float32)[0](x)
    errs = {m.name: rel(build_model(src, m, dtype=mx.float32)[0](x), ref) for m in BOTH}
    r = compare(src, PROMPT, horizon=32, dtype=mx.float32)
    assert r["max_rel_logit_diff"] < tiny.f32_tol() and r["greedy_match"] == 32, r
    raw = read_source(str(write_gemma3_gguf(tmp_path / "w.gguf", cfg, w, shift=0.0)))
    errs["unshifted file"] = rel(build_model(raw, STOCK, dtype=mx.float32)[0](x), ref)
    print(errs)
    assert max(errs[m.name] for m in BOTH) < tiny.f32_tol(), errs
    assert errs["unshifted file"] > 10 * tiny.f32_tol(), errs


@pytest.mark.parametrize("layers,pattern", [(6, 3), (3, None)])
def test_gemma3_gguf_pattern_and_any_depth(tmp_path, layers, pattern):
    """The file's attention.sliding_window_pattern (3: every 3rd layer global)
    is llama.cpp's, 6 where absent; a file of fewer layers than that (all
    sliding) runs in stock too. Both modes equal stock on the Hugging Face
    folder it came from, within float32 rounding."""
    cfg = dict(
        tiny.gemma3_config("gemma3_tied"),
        num_hidden_layers=layers,
        sliding_window_pattern=pattern or 6,
        query_pre_attn_scalar=16,  # what llama.cpp derives: head_dim
        rope_scaling={"type": "linear", "factor": 8.0},
    )
    w = tiny.gemma3_weights(cfg, seed=4)
    hf = read_source(str(tiny.write_model(tmp_path / "hf", cfg, w)))
    key = {}
    if pattern:
        key["attention.sliding_window_pattern"] = mx.array(pattern, dtype=mx.uint32)
    src = read_source(str(write_gemma3_gguf(tmp_path / "g.gguf", cfg, w, **key)))
    assert src.config["sliding_window_pattern"] == (pattern or 6), src.config
    x = mx.array([PROMPT])
    ref = build_model(hf, STOCK, dtype=mx.float32)[0](x)
    errs = {m.name: rel(build_model(src, m, dtype=mx.float32)[0](x), ref) for m in BOTH}
    print(f"{layers} layers, pattern {pattern}: {errs}")
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_gemma3_gguf_with_final_logit_softcapping_is_one_line(tmp_path, capsys):
    """llama.cpp applies a final logit softcap where the file has one; mlx-lm's
    gemma3_text has none, so such a file is refused, not run differently."""
    from flashnorm_mlx.cli import main

    cfg = dict(tiny.gemma3_config("gemma3_tied"), rope_scaling=None)
    path = write_gemma3_gguf(tmp_path / "cap.gguf", cfg, tiny.gemma3_weights(cfg))
    meta_path = tmp_path / "capped.gguf"
    tensors, meta = mx.load(str(path), return_metadata=True)
    meta["gemma3.final_logit_softcapping"] = mx.array(30.0)
    mx.save_gguf(str(meta_path), tensors, meta)
    assert main(["generate", str(meta_path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "softcapping" in err[0], err
