"""FlashNorm Gemma 4 (gemma4_text) against mlx-lm's own class on the same weights.

Tiny random models (tests/tiny.py): every norm gain random in 0.25..4 (the QK
gains 0.05..0.4: attention's scale is 1; the router's too), a layer scalar of
0.5..2 per layer, six layers (two sliding, one global, twice), a window of 6
(shorter than every prompt plus decode here), global heads twice as wide with
proportional RoPE on a quarter of their dims, a softcapped head; one tied, one
untied with a large eps (the q, k and v norms' epsilon adjustments matter);
`gemma4_e` (per-layer inputs, the last three layers KV-shared, K = V) and
`gemma4_moe` (the MoE block beside each MLP, a strong router, K = V), in
Hugging Face's layout (its fused 3-D experts, the shared layers' unused k and
v projections).
"""

import json

import family
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from tiny import PROMPT, rel

from flashnorm_mlx import fold, kernels, models
from flashnorm_mlx.errors import LoadError
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.loading.gguf import read_gguf
from flashnorm_mlx.models import gemma4_text
from flashnorm_mlx.models.arch import Architecture
from flashnorm_mlx.modes import FLASHNORM, STOCK

# stock_q4: mlx-lm's own `convert -q` of the tiny model, read back as stored.
folder, source, stock_q4 = family.fixtures(
    tiny.make_gemma4, [*tiny.GEMMA4_CONFIGS, *tiny.GEMMA4_PARTS]
)


@pytest.fixture(scope="module", params=list(tiny.GEMMA4_CONFIGS))
def dense_source(request, tmp_path_factory):
    """The dense configs alone (the parts' are `verify`'s over the same steps)."""
    path = tiny.make_gemma4(tmp_path_factory.mktemp(request.param), request.param)
    return read_source(str(path))


def test_classes_and_what_is_left_of_the_norms(source):
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    assert type(stock).__module__ == "mlx_lm.models.gemma4_text"
    assert type(flash).__module__ == "flashnorm_mlx.models.gemma4_text"
    names = {n for n, _ in flash.named_modules()}
    # Pre-linear norms folded away (no gain left as a parameter); post-norms
    # and QK gains kept; the final norm only before a tied head.
    params = {k for k, _ in tree_flatten(flash.parameters())}
    assert not any(
        n.endswith(("input_layernorm", "pre_feedforward_layernorm")) for n in names
    )
    assert not any(("input_layernorm" in k or "pre_feed" in k) for k in params)
    assert not any(k.endswith(("router.scale", "router.gain")) for k in params)
    layers = source.config["num_hidden_layers"]
    assert sum(k.endswith("post_attention_layernorm.weight") for k in params) == layers
    assert sum(k.endswith("layer_scalar") for k in params) == layers
    assert ("model.norm" in names) == source.config["tie_word_embeddings"]
    kinds = [type(c) for c in flash.make_cache()]
    assert kinds == [type(c) for c in stock.make_cache()], kinds
    own = gemma4_text.first_shared(source.config)  # none for the KV-shared
    assert kinds == ([RotatingKVCache, RotatingKVCache, KVCache] * 2)[:own], kinds
    heads = [l.self_attn.head_dim for l in flash.layers]
    assert heads == [16, 16, 32] * 2, heads
    # Each layer's q|k|v rows as stock's q, k and v (K = V: no v; shared: q).
    for ours, theirs in zip(flash.layers, stock.layers):
        a = theirs.self_attn
        rows = sum(
            a[n].weight.shape[0] for n in ("q_proj", "k_proj", "v_proj") if n in a
        )
        assert ours.self_attn.qkv_proj.weight.shape[0] == rows
        assert ours.mlp.down_proj.weight.shape == theirs.mlp.down_proj.weight.shape
    # The global layers' proportional RoPE: 8 of 32 dims rotated, in the epilogue.
    assert flash.layers[2].self_attn._angles.dims == 32
    assert (flash.layers[2].self_attn._angles.inv_freq[4:] == 0).all().item()


def test_prompt_and_32_cached_steps_across_the_window_match_stock(dense_source):
    source = dense_source
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    errs, cf = family.cached_errors(stock, flash)
    assert cf[0].offset == len(PROMPT) + 32 > 4 * source.config["sliding_window"]
    assert max(errs) < tiny.f32_tol(), f"max rel logit diff {max(errs):.3e}: {errs}"


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_verify_float32_and_stock_quantized_as_stored(source, stock_q4, engine):
    """`verify`'s comparison: float32, and mlx-lm's own 4-bit output as stored
    (the gains then applied in the kernels)."""
    family.verify(source, engine, stock_q4)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock(source, stock_q4, quantized, engine):
    src = stock_q4 if quantized else source
    dtype = None if quantized else mx.float32
    if quantized:
        flash, _ = build_model(src, FLASHNORM)
        qkv = flash.layers[0].self_attn.qkv_proj
        assert type(qkv).__name__ == "QuantizedLinear", type(qkv)
        assert "input_layernorm" in flash.layers[0]  # gains kept, in the kernels
    r = compare(src, PROMPT, horizon=64, dtype=dtype, engine=engine)
    assert r["greedy_match"] == 64, r


def test_the_reference_sees_what_gemma4_must_get_right(source, monkeypatch):
    """Each piece broken on purpose is far off stock on the prompt: v's norm
    dropped, the layer scalar dropped, the softcap dropped, the global
    layers' partial RoPE made full, the embedding scale dropped, and (where
    eps is large) Gemma 4's input 1/RMS applied twice (the q, k and v norms
    then see its epsilon wrong: it must cancel, not be applied)."""
    broken = family.breaker(monkeypatch, source, mx.array([PROMPT]))

    real_heads = gemma4_text.Attention.heads

    def plain_heads(self, xs, ms, offset):
        if not self.has_kv:
            return real_heads(self, xs, ms, offset)
        y = self.qkv_proj(xs)
        if self.k_eq_v:
            y = mx.concatenate([y, y[..., self.n_heads * self.head_dim :]], axis=-1)
        return kernels.qkv_epilogue(y, ms, offset, self.epilogue())

    def no_scalar(flash):
        for layer in flash.layers:
            layer.layer_scalar = mx.ones((1,))

    def no_softcap(flash):
        flash.args.final_logit_softcapping = None

    def full_rope(flash):
        for layer in flash.layers[2::3]:
            a = layer.self_attn
            a._angles = kernels.rope_angles(nn.RoPE(a.head_dim, base=1e6), a.head_dim)

    cfg = source.config
    errs = {
        "no v norm": broken(
            lambda m: m.setattr(gemma4_text.Attention, "heads", plain_heads)
        ),
        "no layer scalar": broken(built=no_scalar),
        "no softcap": broken(built=no_softcap),
        "full RoPE on global layers": broken(built=full_rope),
        "no embedding scale": broken(
            lambda m: m.setattr(Architecture, "embedding_scale", lambda s, c: 1)
        ),
    }
    if source.config["rms_norm_eps"] >= 0.01:
        real = gemma4_text.Attention.heads

        def twice(self, xs, ms, offset):
            s = kernels.deferred_scale(ms, xs.dtype)
            return real(self, (xs * s).astype(xs.dtype), ms, offset)

        errs["Gemma 4's input 1/RMS applied twice"] = broken(
            lambda m: m.setattr(gemma4_text.Attention, "heads", twice)
        )
    if cfg.get("attention_k_eq_v"):

        def v_is_k(self, xs, ms, offset):  # K = V read as "the values are k'"
            q, k, v = real_heads(self, xs, ms, offset)
            return (q, k, k) if self.k_eq_v and self.has_kv else (q, k, v)

        errs["K = V layers' v taken as k'"] = broken(
            lambda m: m.setattr(gemma4_text.Attention, "heads", v_is_k)
        )
    if cfg.get("num_kv_shared_layers"):

        def wrong_source(flash):  # the sliding shared layers read layer 0, not 1
            src = flash.model.sources
            flash.model.sources = [
                0 if s != j and s == 1 else s for j, s in enumerate(src)
            ]
            flash.layers[0].self_attn.shares = True

        errs["KV sharing from the wrong layer"] = broken(built=wrong_source)
    if cfg.get("hidden_size_per_layer_input"):

        def unit_projection_norm(flash):
            norm = flash.model.per_layer_projection_norm
            norm.weight = mx.ones_like(norm.weight)

        def unit_post_norm(flash):
            for layer in flash.layers:
                g = layer.post_per_layer_input_norm
                g.weight = mx.ones_like(g.weight)

        def no_per_layer_inputs(flash):
            flash.model.hidden_size_per_layer_input = 0

        errs["per-layer projection norm's gain dropped"] = broken(
            built=unit_projection_norm
        )
        errs["per-layer input post-norm's gain dropped"] = broken(built=unit_post_norm)
        errs["no per-layer inputs"] = broken(built=no_per_layer_inputs)
    if cfg.get("enable_moe_block"):

        def s_after_softmax(self, xs, ms):  # s on the weights, not the logits
            z = self.proj(xs)
            inds = mx.argpartition(z, kth=-self.top_k, axis=-1)[..., -self.top_k :]
            w = mx.softmax(mx.take_along_axis(z, inds, axis=-1), axis=-1)
            w = kernels.scaled(w, ms)
            return inds, w * self.per_expert_scale[inds]

        def router_gain_unfolded(m):  # the router's scale never reaches proj
            m.setattr(gemma4_text.fold, "fold_gain", lambda w, g, lin: w)

        errs["router's s after the softmax"] = broken(
            lambda m: m.setattr(gemma4_text.Router, "__call__", s_after_softmax)
        )
        errs["router's gain unfolded"] = broken(router_gain_unfolded)
    family.far_off(errs)


def test_fold_twice_equals_fold_once_and_compat_writes_unit_gains(source):
    once_w, once_c = fold.fold_norms(source.weights, source.config, compat=True)
    twice_w, twice_c = fold.fold_norms(once_w, once_c)
    assert once_c == twice_c and once_w.keys() == twice_w.keys()
    assert all(mx.array_equal(once_w[k], twice_w[k]).item() for k in once_w)
    p = "model.layers.0"
    for n in ("input_layernorm", "pre_feedforward_layernorm"):
        assert (once_w[f"{p}.{n}.weight"] == 1).all().item(), n
    for n in ("post_attention_layernorm", "self_attn.q_norm", "layer_scalar"):
        key = f"{p}.{n}" if n == "layer_scalar" else f"{p}.{n}.weight"
        assert mx.array_equal(once_w[key], source.weights[key]), n


def test_convert_compat_loads_in_stock_mlx_lm(source, tmp_path):
    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_convert_q_rtn_and_gptq_load_in_mlx_lm(source, tmp_path):
    """-q, both methods (RTN: mx.quantize of the folded weight; GPTQ: not);
    each --compat checkpoint loads in mlx-lm, whose logits there equal ours,
    and both are near stock at 8 bits."""
    key = "model.layers.0.self_attn.q_proj.weight"
    linear = "layers.0.self_attn.qkv_proj"
    family.convert_q_loads_in_mlx_lm(source, tmp_path, key, linear=linear, bound=0.1)


def test_the_wrapper_is_read_as_its_text_model_and_stock_is_mlx_lms(tmp_path):
    """gemma4 around gemma4_text: config = text_config (the wrapper's vocab),
    no vision weight, the text model's names; stock is mlx-lm's own
    load_model of the folder; ours matches it, prompt and 32 steps."""
    from mlx_lm.utils import load_model

    path = tiny.make_gemma4_wrapped(tmp_path / "w", tokenizer=False)
    src = read_source(str(path))
    assert src.config["model_type"] == "gemma4_text"
    assert src.config["vocab_size"] == tiny.VOCAB
    assert src.wrapper["model_type"] == "gemma4"
    assert all(k.startswith("model.") for k in src.weights), sorted(src.weights)
    assert not any("vision" in k for k in src.weights)
    stock, _ = build_model(src, STOCK, dtype=mx.float32)
    theirs, _ = load_model(path)
    assert type(stock).__module__ == "mlx_lm.models.gemma4"
    x = mx.array([PROMPT])
    assert rel(stock(x), theirs(x)) == 0.0
    r = compare(src, PROMPT, horizon=32, dtype=mx.float32)
    assert r["max_rel_logit_diff"] < tiny.f32_tol() and r["greedy_match"] == 32, r


def test_bench_counts_fewer_launches(source):
    tiny.bench_launches(source)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return tiny.make_gemma4(tmp_path_factory.mktemp("gemma4_moe"), "gemma4_moe")


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_every_tokens_experts_are_stocks_at_every_step(
    moe_folder, tmp_path_factory, quantized
):
    """The experts each token picks equal stock's (mlx-lm's class), prompt and
    32 greedy steps, float32 and mlx-lm's 4-bit as stored; and they vary."""
    ls, lf = family.picks_on(
        moe_folder, quantized, tmp_path_factory, "experts.switch_glu", every=True
    )
    family.picks_are_stocks(ls, lf, 2)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4_as_stored"])
@pytest.mark.parametrize("name", list(tiny.GEMMA4_PARTS))
def test_load_peak_is_stocks(tmp_path, name, quantized):
    """Reading and building FlashNorm peaks within 3% of stock on the same
    12-layer folder, float32 and mlx-lm's 4-bit as stored
    (tests/test_load_memory.py's measure)."""
    over = dict(hidden_size=128, num_hidden_layers=12, vocab_size=2048)
    over.update(vocab_size_per_layer_input=2048, intermediate_size=256)
    over["layer_types"] = tiny.GEMMA4_BASE["layer_types"] * 2
    if name == "gemma4_e":
        over["num_kv_shared_layers"] = 6
    family.load_peak_is_stocks(
        tmp_path, tiny.make_gemma4, quantized, label=name, name=name, **over
    )


def test_two_rank_tensor_parallel_matches_one_process(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of FlashNorm on the
    part configs, float32 and its 4-bit: attention split by GQA groups (q|k
    rows of K = V layers, two global KV heads here; q rows of KV-shared ones,
    whose source's heads split alike), the dense MLPs by hidden columns; the
    experts, router and per-layer inputs whole on each rank. Each as one
    process gives it, within 1e-5 (all-sums add in another order)."""
    import test_distributed

    cases = []
    for name in tiny.GEMMA4_PARTS:
        over = dict(num_global_key_value_heads=2, tokenizer=False)
        path = str(tiny.make_gemma4(tmp_path / name, name, **over))
        cases.append({"name": name, "model": path, "mode": "flashnorm"})
        q4 = {"name": f"{name}-q4", "model": path, "mode": "flashnorm"}
        cases.append({**q4, "quantize": [4, 32]})
    test_distributed.ranks_match_one_process(cases, tmp_path)


# =============================================================================
# llama.cpp's gemma4 GGUF files (loading/gguf_gemma4.py; docs/design.md 2n),
# written from a tiny Hugging Face checkpoint by the converter's own transforms
# (conversion/gemma.py `Gemma4Model` and its bases, gguf-py's tensor_mapping.py
# names) with the `gguf` package, read back and run against mlx-lm's class on
# the folder, both modes.
# =============================================================================


# Hugging Face module under model.layers.i -> llama.cpp's (tensor_mapping.py
# for MODEL_ARCH.GEMMA4's tensors; pre_feedforward_layernorm is FFN_PRE_NORM,
# "ffn_norm").
G4_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "router.proj": "ffn_gate_inp",
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
}
G4_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}


def gemma4_gguf_tensors(cfg: dict, hf: dict, fuse_qkv: bool = False) -> dict:
    """Hugging Face Gemma 4 tensors -> llama.cpp's, as the converter writes
    them: `Gemma4Model.norm_shift` 0 (norms as w), `filter_tensors` (layer_scalar
    -> layer_output_scale.weight), `modify_tensors` (router.scale,
    per_expert_scale -> ffn_gate_inp.scale, ffn_down_exps.scale),
    experts.gate_up_proj as ffn_gate_up_exps, `generate_extra_tensors`'
    rope_freqs, and with `fuse_qkv` `ModelBase.modify_tensors`' q|k|v rows.
    (`Gemma3Model.modify_tensors` trims the embedding to the tokenizer's
    size: a no-op here, the vocabulary is the embedding's.)"""
    out = {}
    for k, v in hf.items():
        v = np.array(v)
        if k in G4_GLOBAL:
            out[G4_GLOBAL[k]] = v
            continue
        _, _, i, rest = k.split(".", 3)
        if rest == "layer_scalar":
            out[f"blk.{i}.layer_output_scale.weight"] = v
        elif rest == "router.scale":
            out[f"blk.{i}.ffn_gate_inp.scale"] = v
        elif rest == "router.per_expert_scale":
            out[f"blk.{i}.ffn_down_exps.scale"] = v
        elif rest == "experts.gate_up_proj":
            out[f"blk.{i}.ffn_gate_up_exps.weight"] = v
        elif rest == "experts.down_proj":
            out[f"blk.{i}.ffn_down_exps.weight"] = v
        else:
            module, _, suffix = rest.rpartition(".")
            out[f"blk.{i}.{G4_LAYER[module]}.{suffix}"] = v
    for i in range(cfg["num_hidden_layers"] if fuse_qkv else 0):
        names = [f"blk.{i}.attn_{x}.weight" for x in "qkv"]
        if all(n in out for n in names):
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(
                [out.pop(n) for n in names]
            )
    full = cfg["rope_parameters"]["full_attention"]
    n_rot = int(cfg["global_head_dim"] * full["partial_rotary_factor"] / 2)
    n_unrot = cfg["global_head_dim"] // 2 - n_rot
    out["rope_freqs.weight"] = np.array([1.0] * n_rot + [1e30] * n_unrot, np.float32)
    return out


def write_gemma4_gguf(path, cfg: dict, tensors: dict, qtype=None):
    """The metadata `TextModel`, `Gemma3Model` and `Gemma4Model`'s
    set_gguf_parameters and `Gemma4Model.set_vocab` write (later calls
    overwrite earlier ones, as GGUFWriter does), the tensors as they are or,
    with `qtype`, every 2-D or 3-D one whose rows split into 32-wide blocks in
    that type, by the `gguf` package (llama.cpp's own)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma4")
    L, swa = cfg["num_hidden_layers"], cfg["sliding_window"]
    types = cfg["layer_types"]
    rope = cfg["rope_parameters"]
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(swa)  # no sliding_window_pattern of 1 in the config
    shared = cfg["num_kv_shared_layers"]
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg["hidden_size_per_layer_input"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_key_length(cfg["global_head_dim"])
    w.add_value_length(cfg["global_head_dim"])
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    if cfg.get("use_double_wide_mlp"):
        F = cfg["intermediate_size"]
        w.add_feed_forward_length([F if i < L - shared else 2 * F for i in range(L)])
    if cfg.get("num_global_key_value_heads") is not None:
        kv, kv_full = cfg["num_key_value_heads"], cfg["num_global_key_value_heads"]
        w.add_head_count_kv(
            [kv if t == "sliding_attention" else kv_full for t in types]
        )
    w.add_rope_dimension_count(cfg["global_head_dim"])
    w.add_rope_dimension_count_swa(cfg["head_dim"])
    # set_vocab: the tokenizer model is "gemma4" (LlamaHfVocab's tokens).
    w.add_tokenizer_model("gemma4")
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    w.add_token_types([1] * cfg["vocab_size"])
    w.add_add_bos_token(True)
    kind = getattr(gguf.GGMLQuantizationType, qtype) if qtype else None
    for name, data in tensors.items():
        if kind is not None and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rounded(tensors: dict, qtype) -> dict:
    """Each tensor `write_gemma4_gguf` quantizes, as its `qtype` blocks hold it
    (the `gguf` package's quantize, then dequantize). The converter moves whole
    rows only and blocks run along a row, so Hugging Face tensors rounded so
    are what the quantized file holds: the folder it must run as."""
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    return {
        k: (
            gguf.quants.dequantize(gguf.quants.quantize(v, kind), kind)
            if v.ndim >= 2 and v.shape[-1] % 32 == 0
            else v
        )
        for k, v in tensors.items()
    }


def _gemma4_gguf(tmp_path, name, qtype=None, fuse_qkv=False, edit=None):
    folder = tiny.make_gemma4_gguf_source(tmp_path / "hf", name, seed=4)
    cfg = json.loads((folder / "config.json").read_text())
    hf = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    tensors = gemma4_gguf_tensors(cfg, hf, fuse_qkv)
    if edit:
        edit(cfg, tensors)
    path = write_gemma4_gguf(tmp_path / f"{name}.gguf", cfg, tensors, qtype)
    return folder, cfg, path


def gemma4_gguf_errors(folder, path, horizon=8):
    """Stock and the default mode on the file against stock on `folder` (a
    folder or a float file), float32: prompt logits, then greedy decoding
    with their own caches."""
    ids = mx.array([PROMPT])
    ref_src = read_source(str(folder), need_tokenizer=False)
    ref, _ = build_model(ref_src, STOCK, dtype=mx.float32)
    src = read_source(str(path), need_tokenizer=False)
    out = {}
    for mode in (STOCK, models.run_mode(src.config)):
        got, _ = build_model(src, mode, dtype=mx.float32)
        cr, cg = make_prompt_cache(ref), make_prompt_cache(got)
        a, b = ref(ids, cache=cr), got(ids, cache=cg)
        errs, same = [rel(b, a)], 0
        for _ in range(horizon):
            ta, tb = mx.argmax(a[:, -1], -1), mx.argmax(b[:, -1], -1)
            same += int((ta == tb).item())
            a, b = ref(ta[:, None], cache=cr), got(tb[:, None], cache=cg)
            errs.append(rel(b, a))
        out[mode.name] = (max(errs), same)
    return out


G4_GGUF_CASES = [
    ("gemma4_tied", None, False),
    ("gemma4_untied", None, True),  # --fuse-qkv
    ("gemma4_tied", "Q8_0", False),
    ("gemma4_every_part", None, False),
    ("gemma4_every_part", "Q8_0", False),
]


@pytest.mark.parametrize(
    "name, qtype, fuse",
    G4_GGUF_CASES,
    ids=[f"{n}-{q or 'f32'}" for n, q, _ in G4_GGUF_CASES],
)
def test_llama_cpp_gemma4_gguf_runs_as_the_hf_checkpoint(tmp_path, name, qtype, fuse):
    """mlx-lm's config back (every key its class reads), its sanitized tensors
    back bit for bit (float32 files), and stock and the default mode on the
    file match stock on the folder (a Q8_0 file: on the folder's weights
    rounded as its blocks hold them): logits within the float32
    tolerance, greedy tokens equal."""
    folder, cfg, path = _gemma4_gguf(tmp_path, name, qtype, fuse)
    config, weights, _ = read_gguf(path, load_tokenizer=False)
    for k in (
        "hidden_size", "num_hidden_layers", "intermediate_size", "use_double_wide_mlp",
        "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
        "rms_norm_eps", "vocab_size", "num_kv_shared_layers", "sliding_window",
        "layer_types", "rope_parameters", "max_position_embeddings",
        "final_logit_softcapping", "tie_word_embeddings",
    ):  # fmt: skip
        assert config[k] == cfg[k], (k, config[k], cfg[k])
    for k in ("hidden_size_per_layer_input", "attention_k_eq_v", "enable_moe_block"):
        assert config[k] == (cfg.get(k) or type(config[k])()), (k, config[k])
    if cfg.get("attention_k_eq_v"):
        assert config["num_global_key_value_heads"] == cfg["num_global_key_value_heads"]
    if cfg.get("enable_moe_block"):
        for k in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            assert config[k] == cfg[k], (k, config[k], cfg[k])
    if qtype is None:
        from mlx_lm.models import gemma4_text as stock

        theirs = stock.Model(stock.ModelArgs.from_dict(cfg))
        want = theirs.sanitize(
            {
                k: mx.array(v)
                for k, v in mx.load(str(folder / "model.safetensors")).items()
            }
        )
        assert sorted(weights) == sorted(want), sorted(set(weights) ^ set(want))
        for k, v in want.items():
            assert mx.array_equal(weights[k], v).item(), f"{k} differs after reading"
    else:
        assert config["quantization"]["bits"] == 8, config.get("quantization")
    ref = folder
    if qtype is not None:  # the folder's weights as the file's blocks round them
        hf = mx.load(str(folder / "model.safetensors"))
        hf = rounded({k: np.array(v) for k, v in hf.items()}, qtype)
        ref = tiny.write_model(tmp_path / "rounded", cfg, hf, tokenizer=False)
    errs = gemma4_gguf_errors(ref, path)
    print(f"{name} {qtype or 'f32'}: (max rel logit error, greedy equal of 8) {errs}")
    for mode, (err, same) in errs.items():
        assert err < tiny.f32_tol() and same == 8, (mode, errs)


def _refusal(tmp_path, edit):
    _, _, path = _gemma4_gguf(tmp_path, "gemma4_tied", edit=edit)
    with pytest.raises(LoadError) as e:
        read_gguf(path, load_tokenizer=False)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_gemma4_gguf_what_mlx_lms_class_cannot_say_is_one_line(tmp_path, capsys):
    """Refused in one line each (design 2n): KV-shared layers after a sliding
    layer (llama.cpp reuses other layers than mlx-lm), global layers with their
    own KV heads but a v projection, a rope_freqs that is not proportional
    RoPE's; and the converter's `gemma4` vocabulary (no --tokenizer): one line
    and exit 1 from the CLI."""
    from flashnorm_mlx.cli import main

    def shared_after_sliding(cfg, tensors):
        cfg["num_kv_shared_layers"] = 2  # layers 4, 5 after sliding layer 3

    def global_kv_heads(cfg, tensors):
        cfg["num_global_key_value_heads"] = 1

    def llama3_freqs(cfg, tensors):
        tensors["rope_freqs.weight"] = np.linspace(1, 8, 16, dtype=np.float32)

    msgs = {
        "shared": _refusal(tmp_path / "a", shared_after_sliding),
        "kv heads": _refusal(tmp_path / "b", global_kv_heads),
        "rope_freqs": _refusal(tmp_path / "c", llama3_freqs),
    }
    print(msgs)
    assert "reuse other layers" in msgs["shared"], msgs
    assert "without K = V" in msgs["kv heads"], msgs
    assert "proportional" in msgs["rope_freqs"], msgs
    _, _, path = _gemma4_gguf(tmp_path / "d", "gemma4_tied")
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'gemma4'" in err, err


def test_gemma4_gguf_without_layer_scales_runs_with_scalars_of_1(tmp_path):
    """llama.cpp's graph skips a missing `layer_output_scale` (not required):
    mlx-lm's class gets layer_scalar 1, and matches a folder of scalars 1."""

    def no_scales(cfg, tensors):
        for k in [k for k in tensors if "layer_output_scale" in k]:
            del tensors[k]

    folder, cfg, path = _gemma4_gguf(tmp_path, "gemma4_tied", edit=no_scales)
    hf = dict(mx.load(str(folder / "model.safetensors")))
    hf.update({k: mx.ones((1,)) for k in hf if k.endswith("layer_scalar")})
    ref = tiny.write_model(tmp_path / "ones", cfg, hf, tokenizer=False)
    errs = gemma4_gguf_errors(ref, path, horizon=2)
    assert all(e < tiny.f32_tol() and s == 2 for e, s in errs.values()), errs
