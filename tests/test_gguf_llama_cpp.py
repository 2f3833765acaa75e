"""GGUF files as llama.cpp's own tools write them, against llama.cpp's numbers.

The fixtures in tests/llama_cpp/ were made by tests/llama_cpp/make.py (its
docstring says how) with the llama.cpp that the llama-cpp-python 0.3.36 sdist
vendors (vendor/llama.cpp: ggml 0c1e570, llama.cpp 0.5.0; the sdist carries no
git commit of its own): its `convert_hf_to_gguf.py` to F32, `llama-quantize`
to Q5_K_M, Q4_K_M and Q3_K_M, `llama-quantize --allow-requantize ... F32` for
its dequantized copies, and `llama-simple` (greedy) for its tokens on the F32
and dequantized files (llama_cpp.json), with the sha256 of every tensor of
each dequantized copy. Tiny Llama and Qwen3 checkpoints, one layer:
- "128": 128-wide q|k|v and gate|up rows, where llama-quantize swaps each
  K-quant for Q4_0/Q5_0/Q5_1/Q8_0, so q, k and v differ (Q5_0 q, k with a Q8_0
  v: FlashNorm lifts q and k to 8 bits; loading/stacks.py), down 256 wide
  (real K-quants);
- "256": real K-quants in q|k|v and gate|up (Q4_K q, k with a Q6_K v, read
  as float: FlashNorm runs the three as stored, models/joined.py), 128-wide
  attn_output and ffn_down (Q5_0/Q5_1/Q8_0).
And Phi-3 (llama.cpp's `phi3`: fused attn_qkv, ffn_up holding gate|up, 3/4 of
each head rotated; "phi3long" with longrope factors), converted to F16 (the
checkpoint's values exactly: kept) and Q4_K_M.
llama.cpp's quantized runs round the activations too (not a float
reference); its dequantized F32 copies are: our --dequantize equals them
weight for weight, and greedy token for token.
"""

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tiny

from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.loading.gguf import read_gguf
from flashnorm_mlx.modes import FLASHNORM, STOCK
from flashnorm_mlx.quant import dequantize_weights

HERE = Path(__file__).with_name("llama_cpp")
LLAMA_CPP = json.loads((HERE / "llama_cpp.json").read_text())
FILES = sorted(p.stem for p in HERE.glob("*-Q*.gguf"))  # llama128-Q4_K_M, ...


def _greedy(model, prompt, n: int):
    """n greedy tokens after `prompt` (each step the whole sequence again)."""
    ids, out = list(prompt), []
    for _ in range(n):
        nxt = model(mx.array([ids]))[0, -1].argmax().item()
        out.append(nxt)
        ids.append(nxt)
    return out


@pytest.mark.parametrize("name", FILES)
def test_llama_cpp_file_runs_in_both_modes_as_stock(name):
    """Every mix llama-quantize wrote runs as stored in the default mode, and
    FlashNorm's tokens equal stock's (mlx-lm's class, float32)."""
    source = read_source(str(HERE / f"{name}.gguf"))
    prompt = LLAMA_CPP[f"{name}-F32"]["prompt"]
    notes = []
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32, notes=notes)
    r = compare(source, prompt, horizon=8, dtype=mx.float32)
    print(f"{name}: FlashNorm vs stock {r['max_rel_logit_diff']:.3e}; {notes}")
    if "128" in name:  # q, k below v's bits: lifted, and said so in one line
        assert sum("lifted to the stack's bits" in n for n in notes) == 1, notes
    if "256" in name and "phi3" not in name:  # float (Q6_K/Q3_K) beside K-quants
        qkv = flash.model.layers[0].self_attn.qkv_proj  # q, k: run as stored
        assert type(qkv).__name__ == "Joined", type(qkv)
        assert sum("mixing float and quantized" in n for n in notes) == 1, notes
    assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
    assert r["greedy_match"] == 8, r


@pytest.mark.parametrize("name", FILES)
def test_dequantized_weights_are_llama_cpps_bit_for_bit(name):
    """Our dequantization in float32 (quantized and float-read tensors alike)
    equals llama.cpp's own dequantized F32 copy, every tensor (sha256)."""
    config, weights, _ = read_gguf(HERE / f"{name}.gguf", load_tokenizer=False)
    ours, _ = dequantize_weights(weights, config, mx.float32)
    want = LLAMA_CPP[f"{name}-F32"]["sha256"]
    assert sorted(ours) == sorted(want)
    off = []
    for k, v in ours.items():
        if _make().digest(np.array(v)) != want[k]:
            off.append(k)
    assert not off, f"{name}: {len(off)} of {len(want)} tensors differ: {off[:3]}"


@pytest.mark.parametrize("name", FILES)
def test_dequantize_tokens_are_llama_cpps_on_its_dequantized_copy(name):
    """--dequantize (FlashNorm, float32): llama.cpp's greedy tokens on its own
    dequantized F32 copy of the file."""
    want = LLAMA_CPP[f"{name}-F32"]
    source = read_source(str(HERE / f"{name}.gguf"))
    model, _ = build_model(
        source, FLASHNORM, dtype=mx.float32, quantized_way="dequantize"
    )
    got = _greedy(model, want["prompt"], len(want["tokens"]))
    assert got == want["tokens"], f"{name}: ours {got}, llama.cpp's {want['tokens']}"


def _make():
    spec = importlib.util.spec_from_file_location("make", HERE / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    return make


@pytest.mark.parametrize("name", ["llama128", "llama256", "qwen3128", "qwen3256"])
def test_f32_tokens_are_llama_cpps(tmp_path, name):
    """The checkpoints llama.cpp converted to F32, made again (make.py's
    `checkpoint`, seeded): FlashNorm's and stock's greedy tokens are
    llama.cpp's on its F32 file."""
    family, width = name[:-3], int(name[-3:])
    folder = _make().checkpoint(tmp_path, family, width)
    want = LLAMA_CPP[f"{name}-F32"]
    source = read_source(str(folder))
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(source, mode, dtype=mx.float32)
        got = _greedy(model, want["prompt"], len(want["tokens"]))
        assert got == want["tokens"], f"{name} {mode}: {got} vs {want['tokens']}"


@pytest.mark.parametrize("name", ["phi3", "phi3long"])
def test_phi3_file_is_its_checkpoint_and_runs_as_llama_cpp(tmp_path, name):
    """llama.cpp's F16 Phi-3 file holds the checkpoint it came from (made again
    by make.py, seeded): the same tensors under Hugging Face's names, stock's
    logits on it those of stock on the folder bit for bit (fused q|k|v and
    gate|up, partial rotary, longrope), and FlashNorm's and stock's greedy
    tokens llama.cpp's on the file."""
    folder = _make().phi3_checkpoint(tmp_path, name)
    hf = read_source(str(folder), need_tokenizer=False)
    source = read_source(str(HERE / f"{name}-F16.gguf"), need_tokenizer=False)
    assert sorted(source.weights) == sorted(hf.weights)
    off = [
        k
        for k, v in hf.weights.items()
        if not mx.array_equal(source.weights[k].astype(mx.float32), v).item()
    ]
    assert not off, off
    want = LLAMA_CPP[f"{name}-F16"]
    x = mx.array([want["prompt"] + want["tokens"]])
    stock_hf, _ = build_model(hf, STOCK, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    diff = mx.abs(stock(x) - stock_hf(x)).max().item()
    assert diff == 0.0, f"{name}: stock on the GGUF vs on the folder {diff:.3e}"
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(source, mode, dtype=mx.float32)
        got = _greedy(model, want["prompt"], len(want["tokens"]))
        assert got == want["tokens"], f"{name} {mode}: {got} vs {want['tokens']}"


def _patched(tmp_path, name: str, old: bytes, new: bytes, after: bytes = b""):
    """The fixture `name` with its bytes `old` (at the first `after`) made `new`."""
    data = (HERE / f"{name}.gguf").read_bytes()
    at = data.index(old, data.index(after) if after else 0)
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data[:at] + new + data[at + len(old) :])
    return path


def test_phi3_files_not_held_exactly_are_refused_in_one_line(tmp_path):
    """A longrope attention factor other than mlx-lm's for the file's contexts,
    and q, k and v stored apart: one line each, naming what is not read."""
    from flashnorm_mlx.errors import LoadError

    key = b"phi3.rope.scaling.attn_factor"
    two = np.float32(2.0).tobytes()  # the float32 after the key's type field
    stored = np.float32(np.sqrt(1 + np.log(64 / 8) / np.log(8))).tobytes()
    path = _patched(tmp_path, "phi3long-F16", stored, two, after=key)
    with pytest.raises(LoadError, match="attn_factor 2 is not longrope's 1.41421"):
        read_source(str(path), need_tokenizer=False)
    apart = b"blk.0.attn_q.v.weight"  # as long as attn_qkv's name
    path = _patched(tmp_path, "phi3-F16", b"blk.0.attn_qkv.weight", apart)
    with pytest.raises(LoadError, match="with q, k and v apart is not read") as e:
        read_source(str(path), need_tokenizer=False)
    assert "\n" not in str(e.value)
