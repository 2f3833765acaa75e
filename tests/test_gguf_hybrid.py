"""GGUF files of the hybrid families (Qwen3.5, LFM2, ...), written here as
llama.cpp's converter writes them (each transform names the converter function
it mirrors: llama.cpp's conversion/*.py, vendored by llama-cpp-python's sdist),
read back, and run against mlx-lm's own class on the Hugging Face folder."""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from test_gguf import tiny_metadata

from flashnorm_mlx.equivalence import compare
from flashnorm_mlx.loading import LoadError, build_model, read_source
from flashnorm_mlx.loading.gguf import read_gguf

PROMPT = [5, 77, 200, 3, 9, 120, 41]


def _u32(x):
    return mx.array(x, dtype=mx.uint32)


def write_gguf(path, arch: str, meta: dict, tensors: dict, qtype=None):
    """Tensors (GGUF names -> numpy) and metadata into a GGUF by the `gguf`
    package (llama.cpp's own); with `qtype`, every 2-D or 3-D weight whose rows
    split into 32-wide blocks in that type, the rest as the converter keeps
    them (F32: norms, conv, A, biases)."""
    import gguf

    f32 = path.with_suffix(".f32.gguf")
    mx.save_gguf(str(f32), {k: mx.array(v) for k, v in tensors.items()}, meta)
    if qtype is None:
        return f32
    r = gguf.GGUFReader(str(f32))
    w = gguf.GGUFWriter(str(path), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        t = f.types
        w.add_key_value(f.name, f.contents(), t[0], sub_type=t[1] if t[1:] else None)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    for t in r.tensors:
        data = np.array(t.data)
        if data.ndim >= 2 and data.shape[-1] % 32 == 0 and "conv" not in t.name:
            w.add_tensor(t.name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rel(a, b) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def _runs_as_the_folder(folder, gguf_path, prompt=PROMPT):
    """FlashNorm and stock on the GGUF against stock on the folder (float32)."""
    ids = mx.array([prompt])
    ref, _ = build_model(read_source(str(folder)), "stock", dtype=mx.float32)
    want = ref(ids)
    errs = {}
    for mode in ("stock", "flashnorm"):
        got, _ = build_model(read_source(str(gguf_path)), mode, dtype=mx.float32)
        errs[mode] = _rel(got(ids), want)
    assert max(errs.values()) < tiny.f32_tol(), errs
    return errs


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
    (`fuse`: its --fuse-gate-up-exps, ModelBase.modify_tensors's gate|up)."""
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
    errs = _runs_as_the_folder(folder, path)
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


def lfm2_gguf_tensors(cfg: dict, hf: dict) -> dict:
    """Hugging Face LFM2 (-MoE) tensors -> llama.cpp's, as the converter writes
    them (LFM2Model / LFM2MoeModel.modify_tensors: the conv squeezed, the
    experts stacked, expert_bias as exp_probs_b.bias)."""
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
        lfm2_gguf_tensors(cfg, hf),
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
    errs = _runs_as_the_folder(folder, path)
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
    errs = _runs_as_the_folder(folder, path)
    print(f"qwen3next: rel logit errors {errs}")


# --- Ministral 3 (mistral3) ----------------------------------------------------------


def ministral3_gguf(tmp_path, cfg: dict, hf: dict, qtype=None, **meta_over):
    """A mistral3 file as llama.cpp's converter writes it: LlamaModel's names
    and Q/K permutation (test_gguf's copy of LlamaModel.permute), YaRN in the
    metadata (TextModel.set_gguf_parameters) and Ministral3Model's
    yarn_log_multiplier (mscale_all_dim) and temperature scale (beta)."""
    from test_gguf import _gguf_name, llama_cpp_permute

    rope = cfg["rope_parameters"]
    meta = tiny_metadata({**cfg, "rope_theta": rope["rope_theta"]}, arch="mistral3")
    a = "mistral3"
    meta.update(
        {
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": mx.array(rope["factor"]),
            f"{a}.rope.scaling.original_context_length": _u32(
                rope["original_max_position_embeddings"]
            ),
            f"{a}.rope.scaling.yarn_beta_fast": mx.array(rope["beta_fast"]),
            f"{a}.rope.scaling.yarn_beta_slow": mx.array(rope["beta_slow"]),
            f"{a}.rope.scaling.yarn_log_multiplier": mx.array(rope["mscale_all_dim"]),
            f"{a}.attention.temperature_scale": mx.array(rope["llama_4_scaling_beta"]),
            **meta_over,
        }
    )
    tensors = {}
    for k, v in hf.items():
        if "rotary_emb" in k:  # a buffer, no weight (TextModel.filter_tensors)
            continue
        v = np.array(v)
        if ".q_proj." in k:
            v = llama_cpp_permute(v, cfg["num_attention_heads"])
        elif ".k_proj." in k:
            v = llama_cpp_permute(v, cfg["num_key_value_heads"])
        tensors[_gguf_name(k)] = v
    return write_gguf(tmp_path / "mistral3.gguf", a, meta, tensors, qtype)


@pytest.mark.parametrize("qtype", [None, "Q4_0"], ids=["f32", "q4_0"])
def test_llama_cpp_mistral3_gguf_runs_as_the_ministral3_checkpoint(tmp_path, qtype):
    """Float32: the same tensors (Q/K unpermuted), YaRN and Llama 4's query
    scale from the metadata, stock and FlashNorm on the file as stock on the
    folder past several scale changes; Q4_0: as stored, like stock."""
    import json

    folder = tiny.make_ministral3(tmp_path / "hf", seed=7)
    cfg = json.loads((folder / "config.json").read_text())
    hf = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    path = ministral3_gguf(tmp_path, cfg, hf, qtype)
    if qtype:
        r = compare(read_source(str(path)), PROMPT, horizon=12, dtype=mx.float32)
        assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
        assert r["greedy_match"] == 12, r
        return
    config, weights, _ = read_gguf(path, load_tokenizer=False)
    assert config["model_type"] == "ministral3", config
    want = {k: v for k, v in cfg["rope_parameters"].items()}
    got = {k: config["rope_parameters"].get(k) for k in want}
    assert got == want, (got, want)
    hf = {k: v for k, v in hf.items() if "rotary_emb" not in k}
    assert sorted(weights) == sorted(hf)
    for k, v in hf.items():
        assert np.array_equal(np.array(weights[k]), v), k
    errs = _runs_as_the_folder(folder, path, PROMPT * 3)  # 21 > 2 * 8 positions
    print(f"mistral3: rel logit errors {errs}")


def test_a_mistral3_file_with_a_sliding_window_is_one_line(tmp_path, capsys):
    """llama.cpp's converter writes no layer types: a window in the file is
    refused in one line, exit 1, nothing run."""
    from flashnorm_mlx.cli import main

    folder = tiny.make_ministral3(tmp_path / "hf", seed=7, tokenizer=False)
    import json

    cfg = json.loads((folder / "config.json").read_text())
    hf = dict(mx.load(str(folder / "model.safetensors")))
    window = {"mistral3.attention.sliding_window": _u32(4)}
    path = ministral3_gguf(tmp_path, cfg, hf, **window)
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sliding window" in err, err
