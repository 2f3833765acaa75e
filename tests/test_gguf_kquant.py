"""GGUF K-quants: Q4_K/Q5_K run quantized (repacked as MLX affine group-32
triples), Q6_K/Q3_K/Q2_K are read as float16 and named in one line.

The block writers below quantize numpy floats into llama.cpp's block layouts
(ggml-common.h's block_q4_K/q5_K/q6_K), written by the `gguf` package
(llama.cpp's own); every reading is checked against that package's dequantizer
(gguf.quants.dequantize), not against flashnorm_mlx's.
"""

import numpy as np
import pytest
import tiny
from test_gguf import _gguf_name, llama_cpp_permute, tiny_metadata

import mlx.core as mx
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.loading import gguf_kquant as kq
from flashnorm_mlx.loading.gguf import read_gguf
from flashnorm_mlx.verify import compare

gguf = pytest.importorskip("gguf")
QK = 256


# --- block writers -----------------------------------------------------------


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins (n, 8) -> Q4_K's 12 bytes (get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _k_blocks(x: np.ndarray, levels: int) -> tuple:
    """Super-blocks of 256 as 8 x 32 with 6-bit scale and min: (d, dmin, sc, m, q)."""
    g = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(g.min(-1), 0)  # llama.cpp keeps mins >= 0 (w = d*q - min)
    scale = (g.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d, d, 1)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / np.where(dmin, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step, low = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.rint((g + low[..., None]) / step[..., None]), 0, levels)
    return d, dmin, sc, m, q.astype(np.uint8).reshape(-1, QK)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 256) 4-bit values -> 128 bytes: sub-block 2c low, 2c+1 high nibbles."""
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def q4_k_blocks(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_blocks(x, 15)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc, m), _nibbles(q)]
    return np.concatenate(parts, axis=1)


def q5_k_blocks(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_blocks(x, 31)
    qh = ((q >> 4).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(
        1, dtype=np.uint8
    )  # bit j of qh[l]: the fifth bit of weight l of sub-block j
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_scale_min(sc, m), qh]
    return np.concatenate(parts + [_nibbles(q & 15)], axis=1)


def q6_k_blocks(x: np.ndarray) -> np.ndarray:
    g = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(g).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[:, None]), 1, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.rint(g / step[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # per 128 weights, quarters 0-3
    lo, hi = q & 15, q >> 4  # ql: quarters 0|2 and 1|3 as nibbles; qh: 2 bits each
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], 2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)]
    return np.concatenate(parts, axis=1)


WRITERS = {"Q4_K": q4_k_blocks, "Q5_K": q5_k_blocks, "Q6_K": q6_k_blocks}


def kquant(x: np.ndarray, qtype: str) -> np.ndarray:
    """(rows, cols) floats -> the tensor's bytes, (rows, cols/256*block bytes)."""
    return WRITERS[qtype](x.reshape(-1, QK)).reshape(x.shape[0], -1)


def reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    """llama.cpp's reading of the bytes (the gguf package's dequantizer)."""
    return gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, qtype))


# --- a tiny Llama GGUF with K-quant tensors ------------------------------------

CFG = dict(tiny.LLAMA_BASE, hidden_size=256, intermediate_size=512)
# Q4_K_M's choice: Q6_K for the output and some attn_v/ffn_down, Q4_K elsewhere.
Q4_K_M = {"output": "Q6_K", "blk.0.attn_v": "Q6_K", "blk.1.ffn_down": "Q6_K"}


def write_kquant_gguf(path, types, default: str, cfg=CFG, seed=3):
    """A tiny Llama GGUF: each 2-D tensor in types.get(stem, default) ('F32'
    keeps it float), norms F32. Returns (path, {GGUF name: raw bytes})."""
    hf = tiny.llama_weights(cfg, seed=seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in tiny_metadata(cfg).items():
        v = np.array(v).tolist() if isinstance(v, mx.array) else v
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        elif k.endswith(("epsilon", "freq_base")):
            w.add_float32(k, v)
        elif k != "general.architecture":
            w.add_uint32(k, v)
    raws = {}
    for k, v in hf.items():
        if "rotary_emb" in k:
            continue
        if ".q_proj." in k or ".k_proj." in k:
            heads = "num_attention_heads" if ".q_proj." in k else "num_key_value_heads"
            v = llama_cpp_permute(v, cfg[heads])
        name = _gguf_name(k)
        qtype = types.get(name.rpartition(".")[0], default) if v.ndim == 2 else "F32"
        if qtype == "F32":
            w.add_tensor(name, v)
            continue
        raws[name] = raw = kquant(v, qtype)
        w.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, raws


def _dequantized(weights: dict, config: dict, module: str) -> np.ndarray:
    bits = config["quantization"].get(module, config["quantization"])["bits"]
    return np.array(
        mx.dequantize(
            weights[f"{module}.weight"],
            weights[f"{module}.scales"].astype(mx.float32),  # float32 math:
            weights[f"{module}.biases"].astype(mx.float32),  # the file's rounding only
            group_size=32,
            bits=bits,
        )
    )


def _gguf_rows(ours: np.ndarray, name: str) -> np.ndarray:
    """Our Hugging Face rows in the file's order (llama.cpp permutes Q/K)."""
    for stem, key in (("attn_q", "num_attention_heads"), ("attn_k", "num_key_value_heads")):
        if f".{stem}." in name:
            return llama_cpp_permute(ours, CFG[key])
    return ours


def _hf(name: str) -> str:
    from flashnorm_mlx.loading.gguf import hf_name

    return hf_name(name).rpartition(".")[0]


# --- blocks against the gguf package's dequantizer -------------------------------


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_block_writer_round_trips_through_llama_cpps_dequantizer(qtype):
    """The writers write real blocks: llama.cpp reads back the floats they
    quantized, within the format's step."""
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    back = reference(kquant(x, qtype), qtype)
    step = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}[qtype]
    err = np.abs(back - x).max() / np.abs(x).max()
    assert err < 1.5 / step, f"{qtype}: round trip error {err:.3e}"


@pytest.mark.parametrize("qtype,bits", [("Q4_K", 4), ("Q5_K", 5)])
def test_k_quant_is_repacked_not_dequantized(tmp_path, qtype, bits):
    """Q4_K/Q5_K come out as MLX affine triples at 4/5 bits, group 32, whose
    dequantization is llama.cpp's within float16 rounding of scales and mins."""
    path, raws = write_kquant_gguf(tmp_path / f"{qtype}.gguf", {}, qtype)
    config, weights, _ = read_gguf(path, load_tokenizer=False)
    assert kq.CONFIG_KEY not in config, config
    q = config["quantization"]
    assert (q["bits"], q["group_size"], q["mode"]) == (bits, 32, "affine"), q
    for name, raw in raws.items():
        module = _hf(name)
        assert weights[f"{module}.weight"].dtype == mx.uint32, name
        ours = _gguf_rows(_dequantized(weights, config, module), name)
        ref = reference(raw, qtype)
        # Scale and bias held in float16: weight q*s + b is off by at most
        # 2^-11 (|q*s| + |b|), half a float16 step of each.
        b = _gguf_rows(np.repeat(np.array(weights[f"{module}.biases"]), 32, 1), name)
        bound = 2**-11 * (np.abs(ours - b) + np.abs(b)) * 1.01 + 1e-7
        err = np.abs(ours - ref)
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert (err <= bound).all(), (
            f"{name}: {err[worst]:.3e} off llama.cpp's {ref[worst]:.5f} at "
            f"{worst} (float16 bound {bound[worst]:.3e}; max {err.max():.3e})"
        )
