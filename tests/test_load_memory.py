"""FlashNorm costs no memory: its peak is stock's on the same weights (within
3%), while loading and over a whole `generate` (docs/design.md section 4e).
Where it was not: a folded or stacked tensor lived beside its source; now a
build reads its own handles, evaluates layer by layer, and a source read whole
shares the stacked rows (loading/build.py). Reference: stock mlx-lm's class on
the same source, in the same kind of process."""

import gc
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
import tiny

from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK, Mode

# Many thin layers: a build holds one layer's transients at a time (~2% here).
CFG = dict(
    tiny.LLAMA_BASE,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=32,
    vocab_size=2048,
)


def peaks(path, quantized: bool, builds: int = 3) -> dict:
    """{"stock": bytes, "flashnorm": bytes}: peak memory of reading `path` and
    building each mode on it (the source held throughout, as
    `read_for_sampling` and `build_for_sampling` hold it), the least of
    `builds` builds each. MLX's CPU backend leaves a built model holding 0-4%
    more than its parameters' bytes, differently on each build of the same
    folder, in stock and FlashNorm alike (a 64-layer 4-bit folder: 0 to 300 KB
    over 8 MB), which a single build would read as a difference; the builds
    alternate, so what else the process holds meanwhile (an earlier test's
    threads) weighs on both modes alike."""
    got = {STOCK.name: [], FLASHNORM.name: []}
    for _ in range(builds):
        for mode in (STOCK, FLASHNORM):
            got[mode.name].append(_one_peak(path, mode, quantized))
    return {name: min(v) for name, v in got.items()}


def _one_peak(path, mode: Mode, quantized: bool) -> int:
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()  # what the process held before (other tests')
    source = read_source(str(path), need_tokenizer=False)
    if quantized:  # in memory, as a GGUF is read: the source holds every tensor
        source = tiny.quantized(source)
        mx.eval(source.weights)
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()  # from here: the source as read, then the build
    model, _ = build_model(source, mode, dtype=mx.float32)
    peak = mx.get_peak_memory() - base
    del model, source
    gc.collect()
    return peak


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "as_stored"])
def test_flashnorm_load_peak_is_stocks(tmp_path, quantized):
    path = tiny.write_model(tmp_path, CFG, tiny.llama_weights(CFG), tokenizer=False)
    got = peaks(path, quantized)
    stock, flashnorm = got["stock"], got["flashnorm"]
    print(f"load peak: flashnorm {flashnorm} B, stock {stock} B")
    assert flashnorm <= 1.03 * stock, (flashnorm, stock)


def _generate_peak(model: list, mode: str) -> int:
    """The peak bytes of `generate -m 4` in a fresh process, as a user runs it
    (model: [] for the embedded default, else [its folder]). A short system
    prompt and 4 steps: the weights set the peak (SmolLM2: ~145 MB, the same
    within 0.5% with 35 prompt tokens and 16 steps), while each token costs
    ~0.11 s here."""
    child = Path(__file__).with_name("peak_child.py")
    argv = [sys.executable, str(child), *model, "-p", "Tell me about Paris."]
    argv += ["--system-prompt", "Be brief.", "-m", "4", "--mode", mode]
    env = dict(os.environ, PYTHONPATH=str(child.parent.parent))
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1].split()[1])


@pytest.mark.parametrize("which", ["embedded", "float"])
def test_generate_peaks_where_stock_does(tmp_path, which):
    """The whole process (read, build, prefill, 4 tokens): FlashNorm at most
    1.03x stock's peak, on the embedded SmolLM2 (4-bit as stored) and on a
    float32 checkpoint."""
    model = []  # generate's default: the embedded SmolLM2-135M
    if which == "float":
        model = [str(tiny.write_model(tmp_path, CFG, tiny.llama_weights(CFG)))]
    peaks = {mode: _generate_peak(model, mode) for mode in ("stock", "flashnorm")}
    print(f"{which}: generate peak {peaks}, x{peaks['flashnorm'] / peaks['stock']:.3f}")
    assert peaks["flashnorm"] <= 1.03 * peaks["stock"], peaks


def test_a_folders_source_holds_nothing_once_its_model_is_gone(tmp_path):
    """A build from a folder reads its own handles: the caller's Source stays
    lazy, so deleting the model frees every byte it took (mlx-lm's 4-bit
    folder, whose q|k|v and gate|up FlashNorm stacks as stored)."""
    from mlx_lm.convert import convert as mlx_convert

    cfg = dict(CFG, num_hidden_layers=4)
    path = tiny.write_model(tmp_path / "f", cfg, tiny.llama_weights(cfg))
    mlx_convert(str(path), str(tmp_path / "q"), quantize=True, q_group_size=32)
    source = read_source(str(tmp_path / "q"), need_tokenizer=False)
    gc.collect()
    base = mx.get_active_memory()
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    del model
    gc.collect()
    held = mx.get_active_memory() - base
    print(f"held by the source after its model: {held} B")
    assert held < 4096, held  # a few bytes of constants cached once a process


# 32 thin layers at K-quant widths (rows a multiple of 256): one layer's
# stacked q|k|v and gate|up, held beside the source's until shared, is ~2%.
GGUF_CFG = dict(CFG, hidden_size=256, intermediate_size=256, vocab_size=512)


def _gguf_peak(path, mode: Mode) -> int:
    """Peak memory of reading the GGUF `path` and building `mode` on it: a
    GGUF is read whole, so the read is part of what a user's load costs."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    source = read_source(str(path), need_tokenizer=False)
    model, _ = build_model(source, mode, dtype=mx.float32)
    peak = mx.get_peak_memory() - base
    del model, source
    gc.collect()
    return peak


# Every layer's attn_v Q6_K beside Q4_K q and k: what llama-quantize's Q4_K_M
# writes for many layers of a real model.
_V_Q6_K = {f"blk.{i}.attn_v": "Q6_K" for i in range(GGUF_CFG["num_hidden_layers"])}


@pytest.mark.parametrize(
    "default,types",
    [("Q6_K", {}), ("F32", {}), ("Q4_K", _V_Q6_K)],
    ids=["q6_k", "f32", "q4_k_m_mix"],
)
def test_gguf_load_peak_is_stocks(tmp_path, default, types):
    """FlashNorm's load peak on a 32-layer GGUF at most 1.03x stock's. A GGUF
    is read whole and held: folding its float tensors (F32, or Q6_K read as
    float32 since MLX cannot hold its 16-weight scales) held each weight
    twice (1.67x stock here: 86.4 MB against 51.8), so FlashNorm runs them as
    stored, the gains in its kernels, sharing the source's tensors. A Q6_K v
    beside Q4_K q and k: stacked in float, q and k were held dequantized
    beside the source's (2.34x: 30.8 MB against 13.2), so the three run as
    stored, one matmul each (models/joined.py; docs/design.md 2i)."""
    pytest.importorskip("gguf")
    from test_gguf_kquant import write_kquant_gguf

    path, _ = write_kquant_gguf(tmp_path / "m.gguf", types, default, cfg=GGUF_CFG)
    stock = min(_gguf_peak(path, STOCK) for _ in range(2))
    flashnorm = min(_gguf_peak(path, FLASHNORM) for _ in range(2))
    print(f"{default} GGUF load peak: flashnorm {flashnorm} B, stock {stock} B")
    assert flashnorm <= 1.03 * stock, (flashnorm / stock, flashnorm, stock)
