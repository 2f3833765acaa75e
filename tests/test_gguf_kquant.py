"""GGUF K-quants: Q4_K/Q5_K run quantized (repacked as MLX affine group-32
triples, float32 scales), Q6_K/Q3_K/Q2_K are read as float32 and named in one
line.

The block writers below quantize numpy floats into llama.cpp's block layouts
(ggml-common.h's block_q4_K/q5_K/q6_K), written by the `gguf` package
(llama.cpp's own); every reading is checked against that package's dequantizer
(gguf.quants.dequantize), not against flashnorm_mlx's.
"""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from test_gguf import _gguf_name, llama_cpp_permute, tiny_metadata

from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model
from flashnorm_mlx.loading import gguf_kquant as kq
from flashnorm_mlx.loading import read_source
from flashnorm_mlx.loading.gguf import read_gguf
from flashnorm_mlx.loading.rows import comparison
from flashnorm_mlx.modes import FLASHNORM, STOCK

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
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], 2
    )
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
    for stem, key in (
        ("attn_q", "num_attention_heads"),
        ("attn_k", "num_key_value_heads"),
    ):
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
def test_k_quant_is_repacked_not_dequantized(tmp_path, monkeypatch, qtype, bits):
    """Q4_K/Q5_K come out as MLX affine triples at 4/5 bits, group 32, with
    float32 scales and biases whose dequantization is llama.cpp's within
    float32 rounding (decoded a few rows at a time, the last chunk short, as a
    large tensor is)."""
    monkeypatch.setattr(kq, "CHUNK", 1000)  # 3 rows of 256 a chunk
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
        # Scale d*sc and bias -dmin*m held exactly (float32): weight q*s + b
        # is llama.cpp's within one float32 rounding of the sum.
        assert weights[f"{module}.scales"].dtype == mx.float32, name
        bound = 2**-24 * np.abs(ref) * 1.01
        err = np.abs(ours - ref)
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert (err <= bound).all(), (
            f"{name}: {err[worst]:.3e} off llama.cpp's {ref[worst]:.5f} at "
            f"{worst} (float32 bound {bound[worst]:.3e}; max {err.max():.3e})"
        )


@pytest.mark.parametrize("qtype", ["Q6_K", "Q3_K", "Q2_K"])
def test_types_mlx_cannot_hold_are_llama_cpps_floats(monkeypatch, qtype):
    """Q6_K (written from floats), Q3_K and Q2_K (random blocks with sane
    float16 scales): llama.cpp's reading exactly (float32), recorded as
    float-read."""
    monkeypatch.setattr(kq, "CHUNK", 1200)  # 2 rows of 512 a chunk
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    block = gguf.GGML_QUANT_SIZES[kind][1]
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    if qtype == "Q6_K":
        raw = kquant(x, qtype)
    else:  # d (and dmin) are the last 2 (4) bytes of a block
        raw = np.random.default_rng(2).integers(0, 256, (16, block), np.uint8)
        tail = {"Q3_K": [-2], "Q2_K": [-4, -2]}[qtype]
        for at in tail:
            raw[:, at : at + 2 or None] = _f16_bytes(np.full(16, 0.01, np.float32))
        raw = raw.reshape(8, -1)
    out = kq._decode("blk.0.attn_q.weight", qtype, raw.reshape(-1), (8, 512))
    ours = np.array(out["blk.0.attn_q.weight"])
    want = reference(raw, qtype)
    assert ours.dtype == np.float32 and np.array_equal(
        ours, want
    ), f"{qtype}: max {np.abs(ours - want).max():.3e} off"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_own_reader_reads_what_mlx_reads(tmp_path, qtype):
    """A file MLX reads itself, read by gguf_kquant.py: the same metadata and
    the same tensors, bit for bit (a K-quant file's Q8_0 fallbacks and norms)."""
    from test_gguf import _quantized_gguf, write_tiny_gguf

    from flashnorm_mlx.loading.checks import check_gguf

    cfg = dict(tiny.LLAMA_BASE)
    src = write_tiny_gguf(tmp_path / "f.gguf", cfg, tiny.llama_weights(cfg, seed=1))
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    path = _quantized_gguf(src, tmp_path / f"{qtype}.gguf", kind)
    want, want_meta = mx.load(str(path), return_metadata=True)
    got, meta, floats = kq.read_file(path, check_gguf(path))
    assert floats == {} and sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and mx.array_equal(got[k], v).item(), k
    assert sorted(meta) == sorted(want_meta)
    for k, v in want_meta.items():
        if isinstance(v, mx.array):
            assert meta[k].dtype == v.dtype and mx.array_equal(meta[k], v).item(), k
        else:
            assert meta[k] == v, k


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_q5_blocks_are_5_bit_triples(qtype):
    """Q5_0/Q5_1 (llama.cpp's fallback where a row is not whole 256-blocks),
    which MLX's reader refuses: 5-bit group-32 triples, llama.cpp's values."""
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    x = np.random.default_rng(4).standard_normal((6, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, kind)
    out = kq._decode("t.weight", qtype, raw.reshape(-1), (6, 96))
    ours = mx.dequantize(
        out["t.weight"],
        out["t.scales"].astype(mx.float32),
        out["t.biases"].astype(mx.float32),
        group_size=32,
        bits=5,
    )
    err = np.abs(np.array(ours) - reference(raw, qtype)).max()
    assert err < 2**-10 * np.abs(x).max(), f"{qtype}: {err:.3e} off llama.cpp's"


# --- running them -------------------------------------------------------------

PROMPT = [5, 17, 99, 3, 250, 42, 7]


@pytest.mark.parametrize("default", ["Q4_K", "Q5_K"])
def test_q4_k_m_mix_runs_quantized_and_flashnorm_agrees(tmp_path, default):
    """A Q4_K_M-style file (Q6_K output, one attn_v and one ffn_down): the
    Q4_K/Q5_K tensors run as QuantizedLinear, the Q6_K ones in float, and
    FlashNorm (float32 compute) matches stock on them."""
    path, _ = write_kquant_gguf(tmp_path / "mix.gguf", Q4_K_M, default)
    source = read_source(str(path))
    floats = source.config[kq.CONFIG_KEY]
    assert sorted(floats) == sorted(_hf(f"{s}.weight") for s in Q4_K_M), floats
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    layer = stock.model.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "QuantizedLinear"
    assert layer.self_attn.q_proj.bits == int(default[1])
    assert type(layer.self_attn.v_proj).__name__ == "Linear"  # its Q6_K
    r = compare(source, PROMPT, horizon=8, dtype=mx.float32)
    print(f"{default} mix: FlashNorm vs stock {r['max_rel_logit_diff']:.3e}")
    assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
    assert r["greedy_match"] == 8, r
    note = comparison(source)["comparison_note"]  # what verify and bench say
    assert "3 Q6_K tensors read as float:" in note and "not quantized" not in note
    # --requantize: the Q6_K ones at 6 bits, each stacked q|k|v at one setting.
    notes = []
    model, _ = build_model(
        source, STOCK, dtype=mx.float32, quantized_way="requantize", notes=notes
    )
    attn = model.model.layers[0].self_attn
    assert [attn.q_proj.bits, attn.k_proj.bits, attn.v_proj.bits] == [6, 6, 6]
    assert model.model.layers[1].mlp.down_proj.bits == 6
    assert any("Q6_K to 6-bit, --requantize" in n for n in notes), notes
    v = source.weights["model.layers.0.self_attn.v_proj.weight"].astype(mx.float32)
    want = mx.quantize(v, group_size=32, bits=6)[0]  # RTN of the float-read Q6_K
    assert mx.array_equal(attn.v_proj.weight, want).item()
    ids = mx.array([PROMPT])
    flash, _ = build_model(source, FLASHNORM, quantized_way="requantize")
    assert mx.isfinite(flash(ids)).all().item()  # one setting per stack: it builds


BIG = dict(CFG, hidden_size=512, intermediate_size=1024)  # weights dominate memory


def _generate(path, mode: str):
    """(peak bytes, stderr) of `generate` in a fresh process (peak_child.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    child = Path(__file__).with_name("peak_child.py")
    argv = [sys.executable, str(child), str(path), "-p", "the thin", "-m", "8"]
    env = dict(os.environ, PYTHONPATH=str(child.parent.parent))
    r = subprocess.run(
        [*argv, "--mode", mode], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1].split()[1]), r.stderr


@pytest.mark.slow  # three generate processes: ~19 s on 2 CPU cores (was 4, ~27 s)
def test_q4_k_runs_at_its_bytes_q6_k_is_named_with_its_cost(tmp_path, capsys):
    """generate on an all-Q4_K file (stock) and an all-Q6_K one (stock and
    FlashNorm): the Q6_K one says in one note line that it runs in float and at
    what cost; the Q4_K one says nothing and peaks lower. convert writes Q4_K at
    about its bytes in the file (not ~5x), and never calls either "not
    quantized". (FlashNorm's load peak against stock's: test_load_memory.py.)"""
    from flashnorm_mlx.cli import main

    peaks, said_all = {}, []
    for qtype in ("Q4_K", "Q6_K"):
        path, _ = write_kquant_gguf(tmp_path / f"{qtype}.gguf", {}, qtype, cfg=BIG)
        for mode in ("stock", "flashnorm") if qtype == "Q6_K" else ("stock",):
            peaks[qtype, mode], err = _generate(path, mode)
            notes = [l for l in err.splitlines() if "note:" in l]
            if qtype == "Q4_K":
                assert notes == [], notes
            else:
                assert len(notes) == 1 and "Q6_K tensors" in notes[0], notes
                assert "run in float32" in notes[0] and "x their bytes" in notes[0]
        out = tmp_path / f"{qtype}-out"
        assert main(["convert", str(path), "-o", str(out)]) == 0
        said = capsys.readouterr().out
        assert "not quantized" not in said, said
        written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        ratio = written / path.stat().st_size
        said_all.append(f"{qtype}: convert wrote {ratio:.2f}x the GGUF's bytes")
        if qtype == "Q4_K":
            assert ratio < 1.3, ratio
        else:
            assert "Q6_K tensors in float16" in said, said
    mb = {k: f"{v / 1e6:.1f} MB" for k, v in peaks.items()}
    with capsys.disabled():  # the numbers, in every run's output
        print(f"\nK-quant generate peak memory (float32 compute): {mb}")
        print("; ".join(said_all))
    assert peaks["Q4_K", "stock"] < peaks["Q6_K", "stock"] / 2, peaks
