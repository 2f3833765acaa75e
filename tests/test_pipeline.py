"""`convert` writes what loading builds: one weight pipeline (recipe.py).

For every architecture and every way a source can be taken, the tensors of the
converted checkpoint (row chunks forced) equal, bit for bit, the parameters of
the FlashNorm model `build_model` makes in memory from the same source.
"""

import json
from pathlib import Path

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten

from flashnorm_mlx import fold
from flashnorm_mlx.jobs.checkpoint import convert
from flashnorm_mlx.loading import build_model, read_source, wrappers
from flashnorm_mlx.modes import FLASHNORM

ARCHITECTURES = {
    "llama": lambda p: tiny.make_llama(p, "gqa_untied"),
    "llama_tied": lambda p: tiny.make_llama(p, "mha_tied"),
    "mistral": lambda p: tiny.make_llama(p, "mistral_sliding"),
    "qwen2": lambda p: tiny.make_qwen(p, "qwen2"),
    "qwen3": lambda p: tiny.make_qwen(p, "qwen3_untied"),
    "openelm": lambda p: tiny.make_openelm(p, "quantizable_untied"),
    "gemma3": lambda p: tiny.make_gemma3(p, "gemma3_untied"),
    "phi3": lambda p: tiny.make_phi3(p, "phi3_longrope"),
    "smollm3": lambda p: tiny.make_smollm3(p, "smollm3"),
    "llama4_text": lambda p: tiny.make_llama4_text(p, "llama4_text"),
    "llama4": lambda p: tiny.make_llama4(p, "llama4_interleaved"),
    "ministral3": lambda p: tiny.make_ministral3(p, "ministral3_mscale_sliding"),
    "mistral3": lambda p: tiny.make_mistral3(p, "mistral3_vision"),
    "qwen3_5": lambda p: tiny.make_qwen3_5(p, "qwen3_5"),
    "qwen3_5_moe": lambda p: tiny.make_qwen3_5_moe(p, "qwen3_5_tied", wrapped=True),
    "qwen3_next": lambda p: tiny.make_qwen3_next(p, "untied", hf=True),
    "lfm2": lambda p: tiny.make_lfm2(p, "lfm2"),
    "lfm2_moe": lambda p: tiny.make_lfm2_moe(p, "lfm2_moe"),
    "glm4_moe": lambda p: tiny.make_glm4_moe(p, "glm4_moe"),
    "deepseek_v3": lambda p: tiny.make_deepseek_v3(p, "deepseek_v3"),
    # Dense: tiny.quantized packs every 2-D weight, and the MoE's router is
    # no linear in mlx-lm's class (tests/test_nemotron_h.py converts that one).
    "nemotron_h": lambda p: tiny.make_nemotron_h(p, "nemotron_h"),
    # Dense: mlx-lm's -q keeps the MoE's router at 8 bits, tiny.quantized not.
    "granitemoehybrid": lambda p: tiny.make_granite4(p, "granitemoehybrid_dense"),
}

# (quantized source?, build_model/convert flags)
WAYS = {
    "float": (False, {}),
    "q4_g32": (False, dict(quantize=(4, 32))),
    "as_stored": (True, {}),
    "dequantize": (True, dict(quantized_way="dequantize")),
    "requantize": (True, dict(quantized_way="requantize")),
}


def _files(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


@pytest.mark.parametrize("way", list(WAYS))
def test_convert_writes_what_load_builds_for_llama(tmp_path, way):
    """Every way on Llama alone: the developer loop's case (`-m "not slow"`)."""
    _convert_and_load_agree(tmp_path, "llama", way)


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "llama"])
def test_convert_writes_what_load_builds(tmp_path, arch, way):
    _convert_and_load_agree(tmp_path, arch, way)


def _convert_and_load_agree(tmp_path, arch: str, way: str) -> None:
    quantized_source, flags = WAYS[way]
    source = read_source(str(ARCHITECTURES[arch](tmp_path / "src")))
    if quantized_source:
        source = tiny.quantized(source, bits=4, group_size=32)
    out = tmp_path / "out"
    # A tiny chunk_elements makes every weight go in row chunks.
    convert(source, out, progress=False, chunk_elements=500, q_method="rtn", **flags)
    model, config = build_model(source, FLASHNORM, engine="eager", **flags)

    written = json.loads((out / "config.json").read_text())
    assert written.get("quantization") == config.get("quantization")
    assert fold.is_folded(written) == fold.is_folded(config)
    # Llama 4's is written in its wrapper's form: read flat, as loading reads it.
    written = wrappers.text_config(written, "config.json") or written
    files = model.sanitize(fold.drop_unit_norms(_files(out), written))
    params = dict(tree_flatten(model.parameters()))
    assert sorted(params) == sorted(files)
    diff = [
        k
        for k in params
        if params[k].dtype != files[k].dtype
        or not mx.array_equal(params[k], files[k]).item()
    ]
    assert not diff, f"convert and load differ in {diff}"
