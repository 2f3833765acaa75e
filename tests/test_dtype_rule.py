"""Activations follow mlx-lm's dtype rule on a stored quantized folder (issue 60
items 3-4): mlx-lm's load casts nothing, its first norm promotes the
embeddings with its gain's dtype, so float16 scales with float32 norms run in
float32. The reference is `mlx_lm generate` on the same folder, a subprocess."""

import shutil

import mlx.core as mx
import pytest
import tiny
from test_mlx_lm_habits import SAMPLING, mlx_lm, ours

from flashnorm_mlx import load
from flashnorm_mlx.loading import model_dtype
from flashnorm_mlx.quant import slow_note


def _cast_folder(src, out, dtype, norms: bool):
    """`src`'s files with its float tensors in `dtype`: scales, biases and
    float weights, the norm gains too where `norms` (else kept float32)."""
    shutil.copytree(src, out)
    w = mx.load(str(out / "model.safetensors"))
    w = {
        k: (
            v.astype(dtype)
            if mx.issubdtype(v.dtype, mx.floating) and (norms or "norm" not in k)
            else v
        )
        for k, v in w.items()
    }
    mx.save_safetensors(str(out / "model.safetensors"), w)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """mlx-lm's 4-bit convert of a tiny float32 Llama, then as an float16 run
    of it leaves it: "mixed" (float16 scales, float32 norms: the embedded
    GGUF's layout) and "half" (every float tensor float16)."""
    base = tmp_path_factory.mktemp("dtype")
    cfg = {
        **tiny.llama_config("gqa_untied"),
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    f32 = tiny.write_model(base / "f32", cfg, tiny.llama_weights(cfg, 3))
    tiny.mlx_q4(f32, base / "q4")
    return {
        "mixed": _cast_folder(base / "q4", base / "mixed", mx.float16, False),
        "half": _cast_folder(base / "q4", base / "half", mx.float16, True),
    }


@pytest.mark.parametrize("dtype", [[], ["--dtype", "float16"]])
@pytest.mark.parametrize("mode", ["stock", "flashnorm"])
def test_seeded_text_is_mlx_lms_on_float16_scales(folders, mode, dtype, capsys):
    """Float16 scales and float32 norms: mlx-lm runs float32 activations on
    float16-rounded embeddings; so do we, by default and with --dtype float16
    (which casts nothing stored), in both modes."""
    folder = str(folders["mixed"])
    want = mlx_lm("--model", folder, *SAMPLING)
    got = ours(capsys, folder, "--mode", mode, *SAMPLING, *dtype)
    print(f"mlx-lm: {want!r}\nours ({mode} {dtype}): {got!r}")
    assert got == want


def test_float16_on_float32_norms_runs_float32(folders, capsys):
    """The issue's case: --dtype float16 on a folder with float32 norms runs
    float32 activations (mlx-lm's speed), and one line says why."""
    from flashnorm_mlx.cli import main

    model, _ = load(str(folders["mixed"]), dtype=mx.float16)
    assert model_dtype(model) == "float32"
    rc = main(["generate", str(folders["mixed"]), "-m", "2", "--dtype", "float16"])
    err = capsys.readouterr().err
    assert rc == 0, err
    print(err)
    assert err.count("activations run in float32, as mlx-lm's") == 1, err


def test_float16_everywhere_says_slow_once(folders, capfd):
    """Every float tensor float16: mlx-lm runs float16, so do we, and on a CPU
    one line says it is the slow choice."""
    from flashnorm_mlx.cli import main

    model, _ = load(str(folders["half"]))
    want = "float32" if mx.default_device() == mx.cpu else "float16"
    assert model_dtype(model) == want  # the CPU default: float32 at least
    rc = main(["generate", str(folders["half"]), "-m", "2", "--dtype", "float16"])
    err = capfd.readouterr().err
    assert rc == 0, err
    line = slow_note(mx.float16)
    if line is None:  # Metal or CUDA: float16 is fast there
        return
    print(err)
    assert err.count(line) == 1, err
    assert "\n" not in line
