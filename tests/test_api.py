"""The Python API (issue 46 item 2, docs/api.md): `flashnorm_mlx.load` takes
`mlx_lm.load`'s keywords and a dtype by name; `generate` and
`stream_generate` are mlx-lm's, so a script changes one import line.
The reference is mlx-lm's own `load` on the same folder and adapter."""

import mlx.core as mx
import numpy as np
import pytest
import tiny
from test_adapters import make_adapter

import flashnorm_mlx


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    model = tiny.make_llama(root / "m", "gqa_untied", seed=4)
    return model, make_adapter(model, root / "adapter")


def _logits(model, ids):
    return np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))


def test_load_takes_mlx_lms_keywords_and_a_dtype_name(folder):
    """load(path, adapter_path=A, return_config=True, dtype="float16"): (model,
    tokenizer, config), the model in float16 with the adapter fused: its logits
    are mlx-lm's load(path, adapter_path=A)'s, not the plain model's."""
    from mlx_lm import load as mlx_lm_load

    from flashnorm_mlx.loading import model_dtype

    path, adapter = folder
    got = flashnorm_mlx.load(
        str(path), adapter_path=str(adapter), return_config=True, dtype="float16"
    )
    assert len(got) == 3
    model, tokenizer, config = got
    assert model_dtype(model) == "float16"
    assert config["model_type"] == "llama" and config["hidden_size"] == 64
    ids = tokenizer.encode("the quick brown fox")
    assert ids
    ref, _ = mlx_lm_load(str(path), adapter_path=str(adapter))
    plain, _ = mlx_lm_load(str(path))
    ours, want, base = _logits(model, ids), _logits(ref, ids), _logits(plain, ids)
    err, moved = np.abs(ours - want).max(), np.abs(base - want).max()
    scale = np.abs(want).max()
    print(f"max |ours - mlx-lm adapted| {err:.4g}, adapter moved {moved:.4g}")
    assert err < 0.02 * scale and moved > 10 * err


@pytest.mark.parametrize("bad", ["float8", "fp16", "int8", 16, mx.int32])
def test_a_bad_dtype_is_one_clear_valueerror(folder, bad):
    with pytest.raises(ValueError) as e:
        flashnorm_mlx.load(str(folder[0]), dtype=bad)
    line = str(e.value)
    print(line)
    assert "\n" not in line and repr(bad) in line
    assert all(d in line for d in ("float16", "bfloat16", "float32"))


def test_tokenizer_config_reaches_the_tokenizer_as_in_mlx_lm(folder):
    from mlx_lm import load as mlx_lm_load

    path = str(folder[0])
    cfg = {"eos_token": "<|endoftext|>"}
    _, tok, config = flashnorm_mlx.load(path, tokenizer_config=cfg, return_config=True)
    _, ref = mlx_lm_load(path, tokenizer_config=cfg)
    assert tok.eos_token == ref.eos_token == "<|endoftext|>"
    assert tok.eos_token_ids == ref.eos_token_ids
    _, plain = flashnorm_mlx.load(path, lazy=True)
    assert plain.eos_token == "<|im_end|>", "the config changed nothing"


def test_model_config_updates_the_config(folder):
    _, _, config = flashnorm_mlx.load(
        str(folder[0]), model_config={"rms_norm_eps": 0.25}, return_config=True
    )
    assert config["rms_norm_eps"] == 0.25


def test_generate_is_mlx_lms_so_one_import_line_changes(folder):
    """The same script body under `from mlx_lm import ...` and `from
    flashnorm_mlx import ...` (float32: greedy identical)."""
    import mlx_lm

    assert flashnorm_mlx.generate is mlx_lm.generate
    assert flashnorm_mlx.stream_generate is mlx_lm.stream_generate

    def script(load, generate):
        model, tokenizer = load(str(folder[0]))
        return generate(model, tokenizer, "the quick brown fox", max_tokens=24)

    want = script(mlx_lm.load, mlx_lm.generate)
    got = script(flashnorm_mlx.load, flashnorm_mlx.generate)
    print(f"mlx-lm {want!r}\nours   {got!r}")
    assert got == want and len(want) > 0


def test_load_runs_a_family_flashnorm_does_not_cover_as_mlx_lms_class(tmp_path):
    """The reference: mlx-lm's own load on the same folder gives the same logits."""
    import tiny_stock
    from mlx_lm import load as mlx_lm_load

    from flashnorm_mlx.errors import UnsupportedModel

    path = tiny_stock.make(tmp_path / "olmo2", "olmo2")
    model, _ = flashnorm_mlx.load(str(path), dtype="float32")
    assert type(model).__module__ == "mlx_lm.models.olmo2", type(model)
    ref, _ = mlx_lm_load(str(path))
    x = mx.array([[1, 5, 9, 3]])
    got, want = model(x).astype(mx.float32), ref(x).astype(mx.float32)
    diff = mx.abs(got - want).max().item()
    assert diff < 1e-5, diff
    with pytest.raises(UnsupportedModel, match="olmo2"):
        flashnorm_mlx.load(str(path), mode="flashnorm")
