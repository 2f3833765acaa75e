"""Qwen3.5 (models/qwen3_5.py) and Qwen3-Next (models/qwen3_next.py) against
mlx-lm's own classes on the same weights: gated DeltaNet layers beside
gated-attention ones.

Tiny random models (tests/tiny.py `make_qwen3_5`), every norm gain in [0.25, 4]
(the gated norms' too), 25% partial rotary: three DeltaNets then attention,
untied; and DeltaNet, attention, DeltaNet (the last block recurrent), tied.
Each as mlx-lm saves it and as Hugging Face's own files hold it (the 1 + w
norms, the Conv1d layout, a vision tower and MTP head to drop), the latter
checked against mlx-lm's own `load_model` of the same folder. Qwen3-Next:
the same layers, the DeltaNet's inputs in two linears whose rows run per key
head, a dense layer between sparse ones, per-expert Hugging Face weights.
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

from flashnorm_mlx import kernels, models
from flashnorm_mlx.jobs.checkpoint import convert
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import LoadError, build_model, read_source
from flashnorm_mlx.loading.gguf import read_gguf
from flashnorm_mlx.models import qwen3_5
from flashnorm_mlx.modes import FLASHNORM, STOCK

# case -> (maker, config): dense untied and tied; qwen3_5_moe on the tied one.
CASES = {
    "qwen3_5": (tiny.make_qwen3_5, "qwen3_5"),
    "qwen3_5_tied": (tiny.make_qwen3_5, "qwen3_5_tied"),
    "qwen3_5_moe": (tiny.make_qwen3_5_moe, "qwen3_5_tied"),
    "qwen3_next": (tiny.make_qwen3_next, "untied"),
}
# A linear of layer 0 that convert writes under its own name, per case.
LAYER0_LINEAR = {
    "qwen3_next": "model.layers.0.linear_attn.in_proj_qkvz.weight",
}
NAMES = list(CASES)


def make(path, case, **kw):
    maker, name = CASES[case]
    return maker(path, name, **kw)


# stock_q4: mlx-lm's own `convert -q` of the tiny model, read back as a checkpoint.
folder, source, stock_q4 = family.fixtures(make, NAMES)


def test_layers_and_what_is_left_of_the_norms(source):
    """Folded: no block norm, final norm (untied) or gated norm gain is left,
    only the QK-norm gains the epilogue reads; layer kinds as stock's."""
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    kinds = [type(l).__name__ for l in model.layers]
    assert [l.is_linear for l in stock.layers] == [
        k == "DeltaNetBlock" for k in kinds
    ], kinds
    norms = [k for k, _ in tree_flatten(model.parameters()) if "norm" in k]
    tied = source.config["tie_word_embeddings"]
    want = {"q_norm", "k_norm"} | ({"norm"} if tied else set())
    assert {k.split(".")[-2] for k in norms} == want, norms


@pytest.mark.parametrize("case", ["qwen3_5_moe", "qwen3_next"])
def test_every_expert_pick_matches_stock_over_32_cached_steps(tmp_path, case):
    """The experts each token picks (s on the router logits before their
    softmax) equal stock's at the prompt and every cached step, and the
    logits with them."""
    from mlx_lm.models.cache import make_prompt_cache
    from test_moe import Picks, picks_differ

    src = read_source(str(make(tmp_path / "m", case, tokenizer=False)))
    logs, errs = {}, []
    models = {}
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(src, mode, dtype=mx.float32, engine="eager")
        logs[mode.name] = {}
        for i, layer in enumerate(model.layers):
            if "switch_mlp" not in layer.mlp:  # a dense layer
                continue
            logs[mode.name][i] = []
            layer.mlp.switch_mlp = Picks(layer.mlp.switch_mlp, logs[mode.name][i])
        models[mode.name] = (model, make_prompt_cache(model))
    x = mx.array([PROMPT])
    for step in range(33):
        out = {m: model(x, cache=c) for m, (model, c) in models.items()}
        errs.append(rel(out["flashnorm"], out["stock"]))
        x = mx.argmax(out["stock"][:, -1:], axis=-1)
    differ = picks_differ(logs["stock"], logs["flashnorm"])
    assert logs["stock"] and all(len(v) == 33 for v in logs["stock"].values())
    assert not differ, differ[:5]
    assert max(errs) < tiny.f32_tol(), max(errs)


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_verify_float32_and_stock_quantized_as_stored(source, stock_q4, engine):
    """`verify`: a prompt and 32 cached steps within 1e-4 relative of mlx-lm's
    class in float32, and on mlx-lm's 4-bit checkpoint as stored (the gains,
    gated norms' included, then in the model)."""
    # As stored, rounding grown over 32 steps: OpenBLAS (blas.py) sums the
    # float32 matmuls in another order than the reference BLAS (1.08e-4 seen
    # there, under 1e-4 without it); a break is off by 1e-2 or more.
    family.verify(source, engine, stock_q4, tiny.f32_tol(2e-4))


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock_on_both_engines(
    source, stock_q4, quantized
):
    family.greedy_is_stocks(
        stock_q4 if quantized else source,
        quantized,
        lambda flash: flash.layers[0].linear_attn.in_proj,
        few=None,
    )


@pytest.mark.parametrize(
    "name,wrapped",
    [
        pytest.param(n, w, id=f"{n}-{'wrapper' if w else 'flat'}")
        for n in NAMES
        for w in (False, True)
        if not (w and n == "qwen3_next")  # Qwen3-Next ships no wrapper
    ],
)
def test_hugging_face_files_read_as_mlx_lm_reads_them(tmp_path, name, wrapped):
    """Hugging Face's layout (1 + w norms, Conv1d (C, 1, K), vision and MTP
    weights), its config flat or as the multimodal wrapper ships it: ours and
    our stock against mlx-lm's own `load_model` of the folder, the
    independent reference; `convert` of it writes a folder mlx-lm loads too
    (the text config flat, as its qwen3_5 class takes it)."""
    from mlx_lm.utils import load_model

    kw = dict(wrapped=True) if wrapped else {}
    path = make(tmp_path / name, name, hf=True, tokenizer=False, **kw)
    theirs, _ = load_model(path)
    src = read_source(str(path), need_tokenizer=False)
    assert "text_config" not in src.config, src.config
    x = mx.array([PROMPT])
    errs = {
        mode.name: rel(build_model(src, mode, dtype=mx.float32)[0](x), theirs(x))
        for mode in (STOCK, FLASHNORM)
    }
    convert(src, tmp_path / "out", progress=False, compat=True)
    errs["mlx-lm on convert"] = rel(load_model(tmp_path / "out")[0](x), theirs(x))
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_the_reference_sees_what_qwen3_5_must_get_right(source, monkeypatch):
    """Each break, made on purpose, moves the logits far past the tolerance:
    s left out of one DeltaNet projection (beta's), s moved past the token
    convolution, the gated norm's gain left unfolded, the attention gate's s
    dropped."""
    err = family.breaker(monkeypatch, source, mx.array([PROMPT * 2]))
    real = qwen3_5.GatedDeltaNet.project

    def unscaled_beta(self, y, ms):
        qkv, z, b, a = real(self, y, ms)
        return qkv, z, b / kernels.deferred_scale(ms, b.dtype), a

    box = {}

    def qkv_unscaled(self, y, ms):  # s kept for the conv's output instead
        qkv, z, b, a = real(self, y, ms)
        box["s"] = kernels.deferred_scale(ms, qkv.dtype)
        return qkv / box["s"], z, b, a

    class LateConv(nn.Module):
        def __init__(self, conv):
            super().__init__()
            self.conv = conv

        def __call__(self, x):
            return self.conv(x) * box["s"]

    def late_conv(model):
        for layer in model.layers:
            if "linear_attn" in layer:
                layer.linear_attn.conv1d = LateConv(layer.linear_attn.conv1d)

    from flashnorm_mlx.models.arch import Architecture

    real_gain = Architecture.folded_gain

    def unit_gated(self, config, norm, weight):  # the gated norms' gains dropped
        g = real_gain(self, config, norm, weight)
        return mx.ones_like(g) if norm in self.gated_norms(config) else g

    errs = {
        "beta without s": err(
            lambda m: m.setattr(qwen3_5.GatedDeltaNet, "project", unscaled_beta)
        ),
        "s past the convolution": err(
            lambda m: m.setattr(qwen3_5.GatedDeltaNet, "project", qkv_unscaled),
            late_conv,
        ),
        "gated norm gain unfolded": err(
            lambda m: m.setattr(Architecture, "folded_gain", unit_gated)
        ),
        "attention gate without s": err(
            lambda m: m.setattr(
                qwen3_5.Attention,
                "gate",
                lambda self, xs, ms: mx.sigmoid(self.gate_proj(xs)),
            )
        ),
    }
    family.far_off(errs)


def test_fold_twice_equals_fold_once_and_folds_the_gated_norms(source):
    once = family.fold_once(source)
    gated = models.architecture(source.config).gated_norms(source.config)
    assert gated and all(f"{n}.weight" not in once for n in gated), list(gated)
    out, _ = next(iter(gated.values()))
    w, g = (
        source.weights[f"{out}.weight"],
        source.weights[f"{next(iter(gated))}.weight"],
    )
    want = w * mx.tile(g, (w.shape[1] // g.shape[0],))[None, :]
    assert mx.allclose(once[f"{out}.weight"], want, rtol=1e-6).item()


def test_convert_compat_loads_in_stock_mlx_lm(source, tmp_path):
    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_convert_q_rtn_and_gptq_load_in_mlx_lm(source, tmp_path):
    """-q, both methods: every projection quantized (RTN: mx.quantize of the
    folded weight; GPTQ: not); each --compat checkpoint loads in mlx-lm, whose
    logits there equal ours (GPTQ's Hessians in the folded basis, the gated
    norms' tiled per head, else a shape error). No quality ratio is asserted:
    quantization noise on these tiny random DeltaNets is chaotic (stock's own
    4-bit error exceeds the logits' scale; at 8 bits it is 0.06 on one config
    and 0.62 on another, and GPTQ beats RTN on some and not others); GPTQ's
    quality is tests/test_gptq.py's, on real text."""
    name = source.config["model_type"]
    key = LAYER0_LINEAR.get(
        name, "language_model.model.layers.0.linear_attn.in_proj_z.weight"
    )
    linear = "layers.0.linear_attn.in_proj"
    family.convert_q_loads_in_mlx_lm(  # bound: finite, the logits scale
        source, tmp_path, key, linear=linear, bound=10
    )


def test_bench_counts_fewer_launches_and_nonorm_runs(source):
    v = tiny.bench_launches(source)["variants"]
    assert v["nonorm"]["rms_norm_modules"] == 0, v["nonorm"]


@pytest.mark.slow
def test_two_rank_tensor_parallel_matches_one_process_and_stock(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of FlashNorm and stock
    on both configs (DeltaNets split by key heads, attention by GQA groups with
    its gate rows, the MLPs by hidden columns; float32 and FlashNorm's 4-bit):
    each as one process gives it, greedy tokens identical."""
    import test_distributed

    paths = {n: make(tmp_path / n, n, tokenizer=False) for n in NAMES}
    test_distributed.ranks_match_one_process(family.launch_cases(paths), tmp_path)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4_as_stored"])
def test_load_peak_is_stocks(tmp_path, quantized):
    """Reading and building FlashNorm peaks within 3% of stock on the same
    16-layer Qwen3.5 folder, float32 and mlx-lm's 4-bit as stored
    (tests/test_load_memory.py's measure): the fused in_proj and q|k|v, the
    parted gate rows and the folded out_proj free their sources as they go.
    A folder, as this family ships (llama.cpp files, read whole, are not read
    for it): a build reads its own lazy handles of the files."""
    over = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=16)
    over.update(vocab_size=2048, tokenizer=False)
    family.load_peak_is_stocks(tmp_path, tiny.make_qwen3_5, quantized, **over)


def test_qwen3_next_in_proj_rows_follow_key_heads(tmp_path, monkeypatch):
    """Qwen3-Next's [q | k | v | z] and [b | a] rows per key head, reordered
    into Qwen3.5's one in_proj: taken as if they were laid out Qwen3.5's way
    already, the logits are far from stock's."""
    from flashnorm_mlx.models import qwen3_next

    src = read_source(str(make(tmp_path / "n", "qwen3_next", tokenizer=False)))
    x = mx.array([PROMPT])
    ref, _ = build_model(src, STOCK, dtype=mx.float32)
    ours, _ = build_model(src, FLASHNORM, dtype=mx.float32)
    monkeypatch.setattr(
        qwen3_next, "in_proj_rows", lambda qkvz, ba, args: mx.concatenate([qkvz, ba])
    )
    wrong, _ = build_model(src, FLASHNORM, dtype=mx.float32)
    errs = {"reordered": rel(ours(x), ref(x)), "as stored": rel(wrong(x), ref(x))}
    print(errs)
    assert errs["reordered"] < tiny.f32_tol() < errs["as stored"] / 10, errs


# --- Qwen3.5 (qwen35, qwen35moe) -------------------------------------------------

# Hugging Face module (under model.layers.i) -> llama.cpp's tensor (gguf-py
# constants MODEL_ARCH.QWEN35 / QWEN35MOE, tensor_mapping.py).
QWEN35_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def reorder_v_heads(x, axis, nk, r, hd):
    """conversion/qwen.py `_LinearAttentionVReorderBase._reorder_v_heads`:
    value heads grouped by key head -> tiled."""
    axis %= x.ndim
    shape = x.shape
    t = x.reshape(*shape[:axis], nk, r, hd, *shape[axis + 1 :])
    return np.swapaxes(t, axis, axis + 1).reshape(shape)


def qwen35_gguf_tensors(cfg: dict, hf: dict, fuse: bool = False) -> dict:
    """Hugging Face Qwen3.5 tensors -> llama.cpp's, as the converter writes them
    (`fuse`: its --fuse-gate-up-exps and --fuse-qkv, ModelBase.modify_tensors's
    gate|up and q|k|v)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    r, qk = nv // nk, 2 * nk * dk
    # Qwen3.5's converter classes only (Qwen3NextModel has no reorder).
    reorder = nk != nv and cfg["model_type"].startswith("qwen3_5")
    L = cfg["num_hidden_layers"]
    out, experts = {}, {}
    for k, v in hf.items():
        v = np.array(v)
        if k.startswith("model.visual"):  # the vision tower: the mmproj file's
            continue
        if k.startswith("mtp."):  # _QwenMtpMixin: one more block, never read
            out[f"blk.{L}.nextn.eh_proj.weight"] = v
            continue
        k = k.replace("model.language_model.", "model.")
        # Qwen3NextModel.modify_tensors: 1 + w norms stored as the gain.
        if k.endswith("norm.weight") and not k.endswith("linear_attn.norm.weight"):
            v = v + 1.0
        if reorder and ".linear_attn." in k:  # _LinearAttentionVReorderBase
            if ".in_proj_qkv." in k:
                v = np.concatenate([v[:qk], reorder_v_heads(v[qk:], 0, nk, r, dv)])
            elif ".in_proj_z." in k:
                v = reorder_v_heads(v, 0, nk, r, dv)
            elif ".in_proj_b." in k or ".in_proj_a." in k:
                v = reorder_v_heads(v, 0, nk, r, 1)
            elif k.endswith((".A_log", ".dt_bias")):
                v = reorder_v_heads(v[:, None], 0, nk, r, 1)[:, 0]
            elif ".conv1d." in k:
                v = v.squeeze()
                v = np.concatenate([v[:qk], reorder_v_heads(v[qk:], 0, nk, r, dv)])
            elif ".out_proj." in k:
                v = reorder_v_heads(v, 1, nk, r, dv)
        if ".in_proj_qkvz." in k:  # Qwen3NextModel.modify_tensors: per key
            per = v.reshape(nk, 2 * dk + 2 * r * dv, -1)  # head [q k v z] -> all
            q, k_, v_, z = np.split(per, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            i = k.split(".")[2]
            qkv = [x.reshape(-1, v.shape[-1]) for x in (q, k_, v_)]
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(qkv)
            out[f"blk.{i}.attn_gate.weight"] = z.reshape(-1, v.shape[-1])
            continue
        if k.endswith(".A_log"):  # Qwen3NextModel.modify_tensors: -exp
            v = -np.exp(v)
        elif "conv1d" in k:  # ... squeeze: (C, 1, K) -> (C, K)
            v = v.squeeze()
        if k == "lm_head.weight":
            out["output.weight"] = v
            continue
        if k in ("model.embed_tokens.weight", "model.norm.weight"):
            name = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
            out[f"{name[k.rpartition('.')[0]]}.weight"] = v
            continue
        _, _, i, rest = k.split(".", 3)
        if rest.endswith("A_log"):
            out[f"blk.{i}.ssm_a"] = v
        elif rest.endswith("dt_bias"):  # ... renamed dt_proj.bias: ssm_dt.bias
            out[f"blk.{i}.ssm_dt.bias"] = v
        elif rest.startswith("mlp.experts.gate_up_proj") and fuse:
            out[f"blk.{i}.ffn_gate_up_exps.weight"] = v  # (E, 2F, D), gate first
        elif rest.startswith("mlp.experts.gate_up_proj"):  # Qwen2MoeModel: split
            F = v.shape[-2] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"] = v[..., :F, :]
            out[f"blk.{i}.ffn_up_exps.weight"] = v[..., F:, :]
        elif rest.startswith("mlp.experts.down_proj"):
            out[f"blk.{i}.ffn_down_exps.weight"] = v
        elif rest.startswith("mlp.experts."):  # Qwen2MoeModel: stacked
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault((i, proj), {})[int(e)] = v
        elif rest.startswith("linear_attn.in_proj_ba."):  # as it is: ssm_ba
            out[f"blk.{i}.ssm_ba.weight"] = v
        else:
            module, _, suffix = rest.rpartition(".")
            out[f"blk.{i}.{QWEN35_NAMES[module]}.{suffix}"] = v
    for i in range(L if fuse else 0):  # ModelBase.modify_tensors's --fuse-qkv
        names = [f"blk.{i}.attn_{x}.weight" for x in "qkv"]
        if names[0] in out:
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate(
                [out.pop(n) for n in names]
            )
    for (i, proj), per in experts.items():
        stem = proj.removesuffix("_proj")
        out[f"blk.{i}.ffn_{stem}_exps.weight"] = np.stack([per[e] for e in sorted(per)])
    return out


def qwen35_metadata(cfg: dict, arch: str) -> dict:
    """Qwen3NextModel.set_gguf_parameters (+ Qwen2MoeModel's, _QwenMtpMixin's,
    _Qwen35MRopeMixin's) for a one-block MTP head."""
    rope = cfg.get("rope_parameters") or cfg  # Qwen3-Next's: top-level keys
    meta = tiny_metadata({**cfg, "rope_theta": rope["rope_theta"]}, arch=arch)
    a, h = arch, cfg["head_dim"]
    meta.update(
        {
            f"{a}.block_count": _u32(cfg["num_hidden_layers"] + 1),
            f"{a}.nextn_predict_layers": _u32(1),
            f"{a}.attention.key_length": _u32(h),
            f"{a}.attention.value_length": _u32(h),
            f"{a}.rope.freq_base": mx.array(rope["rope_theta"]),
            f"{a}.rope.dimension_count": _u32(int(h * rope["partial_rotary_factor"])),
            f"{a}.ssm.conv_kernel": _u32(cfg["linear_conv_kernel_dim"]),
            f"{a}.ssm.state_size": _u32(cfg["linear_key_head_dim"]),
            f"{a}.ssm.group_count": _u32(cfg["linear_num_key_heads"]),
            f"{a}.ssm.time_step_rank": _u32(cfg["linear_num_value_heads"]),
            f"{a}.ssm.inner_size": _u32(
                cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
            ),
            f"{a}.full_attention_interval": _u32(cfg["full_attention_interval"]),
        }
    )
    if "mrope_section" in rope:  # _Qwen35MRopeMixin
        sections = rope["mrope_section"] + [0]
        meta[f"{a}.rope.dimension_sections"] = mx.array(sections, dtype=mx.int32)
    if cfg.get("num_experts"):
        meta[f"{a}.expert_count"] = _u32(cfg["num_experts"])
        meta[f"{a}.expert_used_count"] = _u32(cfg["num_experts_per_tok"])
        meta[f"{a}.expert_feed_forward_length"] = _u32(cfg["moe_intermediate_size"])
        meta[f"{a}.expert_shared_feed_forward_length"] = _u32(
            cfg["shared_expert_intermediate_size"]
        )
    return meta


def _qwen35_case(tmp_path, moe: bool, qtype=None, **over):
    import json

    make = tiny.make_qwen3_5_moe if moe else tiny.make_qwen3_5
    folder = make(tmp_path / "hf", hf=True, seed=3, **over)
    cfg = json.loads((folder / "config.json").read_text())
    hf = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    arch = "qwen35moe" if moe else "qwen35"
    tensors = qwen35_gguf_tensors(cfg, hf, fuse=moe and qtype is None)
    path = write_gguf(
        tmp_path / f"{arch}.gguf", arch, qwen35_metadata(cfg, arch), tensors, qtype
    )
    return folder, cfg, path


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_llama_cpp_qwen35_gguf_reads_back_and_runs_as_the_hf_checkpoint(tmp_path, moe):
    """Float32: mlx-lm's sanitized tensors back (A_log to float32 rounding,
    the rest bit for bit, the value heads untiled), the MTP block dropped, and
    stock and FlashNorm on the file match stock on the folder."""
    from flashnorm_mlx.models import qwen3_5

    folder, cfg, path = _qwen35_case(tmp_path, moe)
    config, weights, _ = read_gguf(path, load_tokenizer=False)
    assert config["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5"), config
    for k in ("num_hidden_layers", "linear_value_head_dim", "full_attention_interval"):
        assert config[k] == cfg[k], (k, config[k], cfg[k])
    src = read_source(str(folder))
    want = qwen3_5.canonical(cfg, dict(src.weights))
    assert sorted(weights) == sorted(want), sorted(set(weights) ^ set(want))
    for k, v in want.items():
        got, ref = np.array(weights[k]), np.array(v)
        if k.endswith("A_log"):
            assert np.allclose(got, ref, rtol=1e-6, atol=0), k
        else:
            assert np.array_equal(got, ref), f"{k} differs after reading"
    errs = gguf_runs_as_folder(folder, path, PROMPT)
    print(f"qwen35 moe={moe}: rel logit errors {errs}")


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_llama_cpp_qwen35_q8_0_gguf_runs_as_stored_like_stock(tmp_path, moe):
    """A Q8_0 file (value heads 32 wide, so ssm_out's untiled columns move in
    whole groups): FlashNorm and stock on it agree, greedy tokens equal."""
    _, _, path = _qwen35_case(tmp_path, moe, "Q8_0", linear_value_head_dim=32)
    source = read_source(str(path))
    assert source.config["quantization"]["bits"] == 8, source.config
    r = compare(source, PROMPT, horizon=8, dtype=mx.float32)
    assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
    assert r["greedy_match"] == 8, r


def test_a_quantized_qwen35_ssm_out_split_inside_groups_is_one_line(tmp_path, capsys):
    """Value heads 16 wide: llama.cpp's tiled ssm_out columns cannot be moved
    back inside 32-wide quantization groups: one line, exit 1."""
    from flashnorm_mlx.cli import main

    _, _, path = _qwen35_case(tmp_path, False, "Q8_0")
    with pytest.raises(LoadError) as e:
        read_gguf(path, load_tokenizer=False)
    assert "ssm_out" in str(e.value) and "\n" not in str(e.value), e.value
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ssm_out" in err, err


# --- Qwen3-Next (qwen3next) ------------------------------------------------------


@pytest.mark.parametrize("qtype", [None, "Q8_0"], ids=["f32", "q8_0"])
def test_llama_cpp_qwen3next_gguf_runs_as_the_hf_checkpoint(tmp_path, qtype):
    """A float32 qwen3next file (in_proj_qkvz split into attn_qkv and
    attn_gate, A = -exp(A_log), 1 + w norms, per-expert weights stacked, an MTP
    block): in_proj_qkvz and in_proj_ba back bit for bit, and stock and
    FlashNorm on the file match stock on the Hugging Face folder; a Q8_0 file
    (in_proj_qkvz's rows moved back quantized) runs as stored like stock."""
    import json

    folder = tiny.make_qwen3_next(tmp_path / "hf", hf=True, seed=6)
    cfg = json.loads((folder / "config.json").read_text())
    hf = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    meta = qwen35_metadata(cfg, "qwen3next")
    tensors = qwen35_gguf_tensors(cfg, hf)
    path = write_gguf(tmp_path / "next.gguf", "qwen3next", meta, tensors, qtype)
    if qtype:
        r = compare(read_source(str(path)), PROMPT, horizon=8, dtype=mx.float32)
        assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
        assert r["greedy_match"] == 8, r
        return
    config, weights, _ = read_gguf(path, load_tokenizer=False)
    assert config["model_type"] == "qwen3_next", config
    assert config["mlp_only_layers"] == cfg["mlp_only_layers"], config
    for name in ("in_proj_qkvz", "in_proj_ba"):
        k = f"model.layers.0.linear_attn.{name}.weight"
        assert np.array_equal(np.array(weights[k]), hf[k]), k
    errs = gguf_runs_as_folder(folder, path, PROMPT)
    print(f"qwen3next: rel logit errors {errs}")
