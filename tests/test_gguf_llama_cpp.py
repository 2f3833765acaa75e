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
- "256": real K-quants in q|k|v and gate|up (Q4_K q, k with a Q6_K v: stacked
  in float), 128-wide attn_output and ffn_down (Q5_0/Q5_1/Q8_0).
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

from flashnorm_mlx.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.loading.gguf import read_gguf
from flashnorm_mlx.quant import dequantize_weights

HERE = Path(__file__).with_name("llama_cpp")
LLAMA_CPP = json.loads((HERE / "llama_cpp.json").read_text())
FILES = sorted(p.stem for p in HERE.glob("*.gguf"))  # llama128-Q4_K_M, ...


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
    build_model(source, "flashnorm", dtype=mx.float32, notes=notes)
    r = compare(source, prompt, horizon=8, dtype=mx.float32)
    print(f"{name}: FlashNorm vs stock {r['max_rel_logit_diff']:.3e}; {notes}")
    if "128" in name:  # q, k below v's bits: lifted, and said so in one line
        assert sum("lifted to the stack's bits" in n for n in notes) == 1, notes
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
        source, "flashnorm", dtype=mx.float32, quantized_way="dequantize"
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
    for mode in ("stock", "flashnorm"):
        model, _ = build_model(source, mode, dtype=mx.float32)
        got = _greedy(model, want["prompt"], len(want["tokens"]))
        assert got == want["tokens"], f"{name} {mode}: {got} vs {want['tokens']}"
