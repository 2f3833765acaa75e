"""LFM2 and LFM2-MoE (models/lfm2.py, models/lfm2_moe.py) against mlx-lm's own
`lfm2` and `lfm2_moe` classes on the same weights: short gated convolutions
beside QK-norm attention.

Tiny random models (tests/tiny.py `make_lfm2`, `make_lfm2_moe`) in Hugging
Face's layout (Conv1d (C, 1, K), the MoE's per-expert w1/w3/w2), every norm
gain in [0.25, 4] (QK-norms' too), the head tied as stock's always is:
- `lfm2`: conv, attention, conv, conv (`layer_types`);
- `lfm2_bias`: biases on the conv's in_proj, Conv1d and out_proj, attention
  first and last (`full_attn_idxs`), a ff_dim rounded up by block_multiple_of;
- `lfm2_moe`: one dense layer, then sigmoid-routed experts with an expert bias
  that changes picks, renormalized top-2 times 1.5;
- `lfm2_moe_plain`: no bias, raw top-k weights, two dense layers.
Routers have large weights, so the experts picked depend on the token; every
token's picks are compared with stock's at every step.
"""

import family
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_gguf import _u32, gguf_runs_as_folder, tiny_metadata, write_gguf
from tiny import PROMPT, rel

from flashnorm_mlx import fold, kernels
from flashnorm_mlx.errors import UnsupportedModel
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.loading.gguf import read_gguf
from flashnorm_mlx.models import lfm2, lfm2_moe
from flashnorm_mlx.modes import FLASHNORM, NONORM, STOCK

MAKERS = {
    **{c: tiny.make_lfm2 for c in tiny.LFM2_CONFIGS},
    **{c: tiny.make_lfm2_moe for c in tiny.LFM2_MOE_CONFIGS},
}
NAMES = list(MAKERS)


def make(path, name, **kw):
    return MAKERS[name](path, name, **kw)


# stock_q4: mlx-lm's own `convert -q` (the MoE's router at 8 bits, as its
# quant_predicate says).
folder, source, stock_q4 = family.fixtures(make, NAMES)


@pytest.fixture(scope="module", params=list(tiny.LFM2_MOE_CONFIGS))
def moe_folder(request, tmp_path_factory):
    return make(tmp_path_factory.mktemp(request.param), request.param)


_source = family.sources(make)


def test_layers_and_what_is_left_of_the_norms(source):
    """Layer kinds and feed-forwards as stock's; folded, no operator or FFN
    norm gain is left, only the QK-norm gains the epilogue reads and the final
    norm's (the head is the embedding)."""
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    kinds = [type(l).__name__ for l in model.layers]
    assert [not l.is_attention_layer for l in stock.layers] == [
        k == "ConvBlock" for k in kinds
    ], kinds
    ffn = [type(l.feed_forward).__name__ for l in model.layers]
    theirs = [type(l.feed_forward).__name__ for l in stock.layers]
    assert [f == "SigmoidRouted" for f in ffn] == [
        t == "Lfm2MoeSparseMoeBlock" for t in theirs
    ], (ffn, theirs)
    norms = [k for k, _ in tree_flatten(model.parameters()) if "norm" in k]
    assert {k.split(".")[-2] for k in norms} == {"q_norm", "k_norm", "norm"}, norms
    assert all("layers" not in k or "self_attn" in k for k in norms), norms


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_verify_float32_and_stock_quantized_as_stored(source, stock_q4, engine):
    """`verify`: a prompt and 32 cached steps within 1e-4 relative of mlx-lm's
    class in float32, and on mlx-lm's 4-bit checkpoint as stored."""
    family.verify(source, engine, stock_q4)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock_on_both_engines(
    source, stock_q4, quantized
):

    def proj(flash):
        mixer = flash.layers[1]["conv" if "conv" in flash.layers[1] else "self_attn"]
        return mixer["in_proj" if "in_proj" in mixer else "qkv_proj"]

    family.greedy_is_stocks(stock_q4 if quantized else source, quantized, proj)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_every_tokens_experts_are_stocks_at_every_step(
    moe_folder, tmp_path_factory, quantized
):
    """The experts each token picks (the expert bias choosing, the sigmoid
    weights not) equal stock's, prompt and 32 greedy steps; and they vary."""
    ls, lf = family.picks_on(
        moe_folder, quantized, tmp_path_factory, "feed_forward.switch_mlp"
    )
    family.picks_are_stocks(ls, lf, 2)


def test_hugging_face_files_read_as_mlx_lm_reads_them(source):
    """The tiny folders are Hugging Face's layout: ours and our stock against
    mlx-lm's own `load_model` of the folder, the independent reference."""
    from mlx_lm.utils import load_model

    theirs, _ = load_model(source.folder)
    x = mx.array([PROMPT])
    errs = {
        mode.name: rel(build_model(source, mode, dtype=mx.float32)[0](x), theirs(x))
        for mode in (STOCK, FLASHNORM)
    }
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_the_reference_sees_what_lfm2_must_get_right(tmp_path, monkeypatch):
    """Each break, made on purpose, moves the logits far past the tolerance:
    s moved past the token convolution (B * x carrying s^2 after it), C's s
    dropped, the conv's in_proj bias added before s, the operator norm's gain
    left out of in_proj, the LFM2 router's s applied after the sigmoid, and the
    expert bias in the experts' weights."""
    x = mx.array([PROMPT * 2])
    breaks = {
        n: family.breaker(monkeypatch, _source(tmp_path, n), x)
        for n in ("lfm2", "lfm2_bias", "lfm2_moe")
    }
    real = lfm2.ShortConv.gated

    def err(name, patch, built=lambda model: None):
        return breaks[name](patch, built)

    box = {}

    def late(self, y, ms):  # B * x unscaled, its s^2 after the convolution
        Bx, C, ms_c = real(self, y, ms)
        box["s2"] = 1 / ms
        return Bx * ms, C, ms_c

    class LateConv(nn.Module):
        def __init__(self, conv):
            super().__init__()
            self.conv = conv

        def __call__(self, bx):
            return self.conv(bx) * box["s2"]

    def late_conv(model):
        for layer in model.layers:
            if "conv" in layer:
                layer.conv.conv = LateConv(layer.conv.conv)

    def c_unscaled(self, y, ms):
        Bx, C, _ = real(self, y, ms)
        return Bx, C, None

    def bias_first(self, y, ms):
        s = kernels.deferred_scale(ms, y.dtype)
        B, C, x_ = mx.split((y + self.in_bias) * s, 3, axis=-1)
        return B * x_, C, None

    folded = fold.fold_gain

    def unfolded_in_proj(weights, gain, linear):
        return (
            weights
            if linear.endswith("conv.in_proj")
            else folded(weights, gain, linear)
        )

    def router_after(self, xs, ms):  # sigmoid(z) * s in place of sigmoid(s z)
        w = mx.sigmoid(self.gate(xs)) * kernels.deferred_scale(ms, xs.dtype)
        pick = w + self.expert_bias
        inds = mx.argpartition(pick, kth=-self.top_k, axis=-1)[..., -self.top_k :]
        scores = mx.take_along_axis(w, inds, axis=-1)
        scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-6)
        return inds, scores * self.routed_scaling_factor

    real_route = lfm2_moe.SigmoidRouted.route

    def biased_weights(self, xs, ms):
        inds, scores = real_route(self, xs, ms)
        bias = mx.take_along_axis(
            mx.broadcast_to(self.expert_bias, (*inds.shape[:-1], self.num_experts)),
            inds,
            axis=-1,
        )
        return inds, scores + bias * self.routed_scaling_factor

    S = lfm2.ShortConv
    R = lfm2_moe.SigmoidRouted
    errs = {
        "s past the convolution": err(
            "lfm2", lambda m: m.setattr(S, "gated", late), late_conv
        ),
        "C without s": err("lfm2", lambda m: m.setattr(S, "gated", c_unscaled)),
        "in_proj bias before s": err(
            "lfm2_bias", lambda m: m.setattr(S, "gated", bias_first)
        ),
        "operator norm gain not in in_proj": err(
            "lfm2", lambda m: m.setattr(fold, "fold_gain", unfolded_in_proj)
        ),
        "the LFM2 router's s applied after the sigmoid": err(
            "lfm2_moe", lambda m: m.setattr(R, "route", router_after)
        ),
        "expert bias in the weights": err(
            "lfm2_moe", lambda m: m.setattr(R, "route", biased_weights)
        ),
    }
    family.far_off(errs)


def test_fold_twice_equals_fold_once(source):
    once = family.fold_once(source)
    left = [k for k in once if k.endswith(("operator_norm.weight", "ffn_norm.weight"))]
    assert not left and "model.embedding_norm.weight" in once, left


def test_convert_compat_loads_in_stock_mlx_lm(source, tmp_path):
    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_nonorm_is_absent_in_one_line(source):
    """Stock's head is always the embedding: the final norm's constant has no
    linear to fold into, so nonorm is refused in one line and bench lists it
    absent with that reason."""
    with pytest.raises(UnsupportedModel) as e:
        build_model(source, NONORM, dtype=mx.float32)
    assert "\n" not in str(e.value) and "embedding" in str(e.value), e.value
    from flashnorm_mlx.loading.rows import absent

    assert set(absent(source.config)) == {"nonorm"}, absent(source.config)


@pytest.mark.parametrize("name", ["lfm2_bias", "lfm2_moe"])
def test_convert_q_rtn_and_gptq_load_in_mlx_lm(tmp_path, name):
    """-q, both methods: every projection quantized (RTN: mx.quantize of the
    folded weight; GPTQ: not); each --compat checkpoint loads in mlx-lm, whose
    logits there equal ours. At 8 bits; no ratio to stock's error is asserted:
    on these tiny random models quantization noise is chaotic (measured and
    printed: see the report)."""
    source = _source(tmp_path, name)
    key = "model.layers.1.conv.in_proj.weight"
    if key not in source.weights:
        key = "model.layers.0.conv.in_proj.weight"
    family.convert_q_loads_in_mlx_lm(
        source, tmp_path, key, linear="conv.in_proj", stock8=True
    )


@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_bench_counts_fewer_launches(tmp_path, name):
    r = tiny.bench_launches(_source(tmp_path, name), name)
    assert "nonorm" not in r["variants"] and "nonorm" in r["absent"], list(
        r["variants"]
    )


@pytest.mark.slow
def test_two_rank_tensor_parallel_matches_one_process_and_stock(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of FlashNorm and stock
    on every config (convs split by channels, attention by GQA groups, GLUs and
    experts by hidden columns; float32 and FlashNorm's 4-bit): each as one
    process gives it, greedy tokens identical."""
    import test_distributed

    paths = {n: make(tmp_path / n, n, tokenizer=False) for n in NAMES}
    test_distributed.ranks_match_one_process(family.launch_cases(paths), tmp_path)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4_as_stored"])
@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_load_peak_is_stocks(tmp_path, name, quantized):
    """Reading and building FlashNorm peaks within 3% of stock on the same
    16-layer folder, float32 and mlx-lm's 4-bit as stored
    (tests/test_load_memory.py's measure)."""
    over = dict(hidden_size=128, num_hidden_layers=16, vocab_size=2048)
    over["layer_types"] = ["conv", "conv", "full_attention", "conv"] * 4
    if name == "lfm2":
        over.update(block_dim=128, block_ff_dim=576)
    family.load_peak_is_stocks(tmp_path, make, quantized, label=name, name=name, **over)


# --- LFM2 (lfm2, lfm2moe) ----------------------------------------------------------

# Hugging Face module (under model.layers.i) -> llama.cpp's (gguf-py constants
# MODEL_ARCH.LFM2 / LFM2MOE, tensor_mapping.py).
LFM2_NAMES = {
    "operator_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_output",
    "self_attn.q_layernorm": "attn_q_norm",
    "self_attn.k_layernorm": "attn_k_norm",
    "conv.conv": "shortconv.conv",
    "conv.in_proj": "shortconv.in_proj",
    "conv.out_proj": "shortconv.out_proj",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w3": "ffn_up",
    "feed_forward.w2": "ffn_down",
    "feed_forward.gate": "ffn_gate_inp",
}
LFM2_EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def lfm2_gguf_tensors(cfg: dict, hf: dict, fuse: bool = False) -> dict:
    """Hugging Face LFM2 (-MoE) tensors -> llama.cpp's, as the converter writes
    them (LFM2Model / LFM2MoeModel.modify_tensors: the conv squeezed, the
    experts stacked, expert_bias as exp_probs_b.bias; `fuse`: --fuse-qkv)."""
    out, experts = {}, {}
    for k, v in hf.items():
        v = np.array(v)
        if k == "model.embed_tokens.weight":
            out["token_embd.weight"] = v
            continue
        if k == "model.embedding_norm.weight":
            out["token_embd_norm.weight"] = v
            continue
        _, _, i, rest = k.split(".", 3)
        if "conv.conv" in rest and v.ndim == 3:
            v = v.squeeze(1)  # (C, 1, K) -> (C, K)
        if rest == "feed_forward.expert_bias":
            out[f"blk.{i}.exp_probs_b.bias"] = v
        elif rest.startswith("feed_forward.experts."):
            _, _, e, name, _ = rest.split(".")
            experts.setdefault((i, name), {})[int(e)] = v
        else:
            module, _, suffix = rest.rpartition(".")
            out[f"blk.{i}.{LFM2_NAMES[module]}.{suffix}"] = v
    for (i, name), per in experts.items():
        stacked = np.stack([per[e] for e in range(len(per))])
        out[f"blk.{i}.{LFM2_EXPERTS[name]}.weight"] = stacked
    for i in range(cfg["num_hidden_layers"] if fuse else 0):  # --fuse-qkv
        names = [f"blk.{i}.attn_{x}.weight" for x in "qkv"]
        if names[0] in out:
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(
                [out.pop(n) for n in names]
            )
    return out


def lfm2_metadata(cfg: dict, arch: str) -> dict:
    """LFM2Model / LFM2MoeModel.set_gguf_parameters."""
    moe = arch == "lfm2moe"
    attends = [tiny.lfm2_attends(cfg, i) for i in range(cfg["num_hidden_layers"])]
    ff = cfg["intermediate_size"] if moe else tiny._lfm2_ff_dim(cfg)
    base = {**cfg, "rms_norm_eps": cfg["norm_eps"], "intermediate_size": ff}
    meta = tiny_metadata(base, arch=arch)
    kv = [cfg["num_key_value_heads"] if a else 0 for a in attends]
    meta[f"{arch}.attention.head_count_kv"] = mx.array(kv, dtype=mx.uint32)
    meta[f"{arch}.shortconv.l_cache"] = _u32(cfg["conv_L_cache"])
    meta[f"{arch}.vocab_size"] = _u32(cfg["vocab_size"])
    if moe:
        meta[f"{arch}.expert_feed_forward_length"] = _u32(cfg["moe_intermediate_size"])
        meta[f"{arch}.leading_dense_block_count"] = _u32(cfg["num_dense_layers"])
        meta[f"{arch}.expert_gating_func"] = _u32(2)  # SIGMOID
        meta[f"{arch}.expert_count"] = _u32(cfg["num_experts"])
        meta[f"{arch}.expert_used_count"] = _u32(cfg["num_experts_per_tok"])
    return meta


def _lfm2_case(tmp_path, name: str, qtype=None, **over):
    import json

    moe = name.startswith("lfm2_moe")
    if moe:  # what llama.cpp's graph runs: the file holds neither value
        over = dict(norm_topk_prob=True, routed_scaling_factor=1.0, **over)
        folder = tiny.make_lfm2_moe(tmp_path / "hf", name, seed=4, **over)
    else:
        folder = tiny.make_lfm2(tmp_path / "hf", name, seed=4, **over)
    cfg = json.loads((folder / "config.json").read_text())
    hf = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    arch = "lfm2moe" if moe else "lfm2"
    path = write_gguf(
        tmp_path / f"{arch}.gguf",
        arch,
        lfm2_metadata(cfg, arch),
        lfm2_gguf_tensors(cfg, hf, fuse=moe and qtype is None),
        qtype,
    )
    return folder, cfg, path


@pytest.mark.parametrize("name", ["lfm2", "lfm2_bias", "lfm2_moe"])
def test_llama_cpp_lfm2_gguf_runs_as_the_hf_checkpoint(tmp_path, name):
    """Float32 lfm2 / lfm2moe files: the layer kinds from head_count_kv, the
    conv's layout, the stacked experts; stock and FlashNorm on the file match
    stock on the folder."""
    folder, cfg, path = _lfm2_case(tmp_path, name)
    config, weights, _ = read_gguf(path, load_tokenizer=False)
    attends = [tiny.lfm2_attends(cfg, i) for i in range(cfg["num_hidden_layers"])]
    assert config["full_attn_idxs"] == [i for i, a in enumerate(attends) if a]
    conv = next(v for k, v in weights.items() if k.endswith("conv.conv.weight"))
    assert conv.shape == (cfg["hidden_size"], cfg["conv_L_cache"], 1), conv.shape
    errs = gguf_runs_as_folder(folder, path, PROMPT)
    print(f"{name}: rel logit errors {errs}")


@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_llama_cpp_lfm2_q4_0_gguf_runs_as_stored_like_stock(tmp_path, name):
    """Q4_0 files run as stored: FlashNorm and stock agree, greedy tokens equal."""
    _, _, path = _lfm2_case(tmp_path, name, "Q4_0")
    source = read_source(str(path))
    assert source.config["quantization"]["bits"] == 4, source.config
    r = compare(source, PROMPT, horizon=8, dtype=mx.float32)
    assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
    assert r["greedy_match"] == 8, r
