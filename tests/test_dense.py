"""Phi-3 and SmolLM3 (models/phi3.py, models/smollm3.py) against mlx-lm's own
classes on the same weights: the dense families built on the shared decoder.

Tiny random models (tests/tiny.py), gains in [0.25, 4]: Phi-3 with q|k|v and
gate|up stored fused, plain RoPE, 3/4 partial rotary with longrope past its
original length (SuScaledRoPE scales the rotated dims of its input), and
full-rotary su scaling past it too, all three through the fused epilogue
(docs/design.md section 3d); SmolLM3 with its NoPE layers by stock's default
interval and by an explicit list.
"""

import json

import family
import mlx.core as mx
import pytest
import tiny
from tiny import PROMPT, rel

from flashnorm_mlx import kernels
from flashnorm_mlx.errors import LoadError, UnsupportedModel
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.models import phi3, smollm3
from flashnorm_mlx.modes import FLASHNORM, NONORM, STOCK

EVERY = pytest.mark.parametrize("make,cfg", tiny.every_config("phi3", "smollm3"))
# Which path each config's attention takes: the model's own RoPE module (True)
# or the fused epilogue (False), every layer, every step; with the rotated dims
# and the input factor the fused one gets.
UNFUSED = {"phi3": False, "phi3_longrope": False, "phi3_su_full": False}
ROTARY = {"phi3": (16, False), "phi3_longrope": (12, True), "phi3_su_full": (16, True)}


def _source(tmp_path, make, cfg):
    return read_source(str(make(tmp_path / cfg, cfg, tokenizer=False)))


@EVERY
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_verify_float32_and_quantized_as_stored(tmp_path, make, cfg, engine):
    """`verify`: a prompt and 32 cached steps in float32 within 1e-4 relative
    of mlx-lm's class, and stock's own 4-bit model as stored (our gains then
    in the kernels)."""
    source = _source(tmp_path, make, cfg)
    family.verify(source, engine, tiny.quantized(source))


@EVERY
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock_on_both_engines(
    tmp_path, make, cfg, quantized
):
    source = _source(tmp_path, make, cfg)
    family.greedy_is_stocks(
        tiny.quantized(source) if quantized else source,
        quantized,
        lambda flash: flash.layers[0].self_attn.qkv_proj,
        few=None,
    )


@pytest.mark.parametrize("cfg", list(tiny.PHI3_CONFIGS))
def test_phi3_rope_takes_the_path_it_must(tmp_path, cfg, monkeypatch):
    """Plain RoPE, partial rotary and SuScaledRoPE's input scale: the fused
    epilogue, with the rotated dims and factor the config asks for."""
    source = _source(tmp_path, tiny.make_phi3, cfg)
    paths, angles = [], set()
    real = kernels.qkv_epilogue

    def spy(*a):
        paths.append(a[-1].angles is None)
        if a[-1].angles is not None:
            angles.add((a[-1].angles.dims, a[-1].angles.mscale != 1.0))
        return real(*a)

    monkeypatch.setattr(kernels, "qkv_epilogue", spy)
    r = compare(source, PROMPT, horizon=8, dtype=mx.float32)
    assert r["max_rel_logit_diff"] < tiny.f32_tol(), r
    assert paths and set(paths) == {UNFUSED[cfg]}, (cfg, set(paths))
    assert angles == {ROTARY[cfg]}, (cfg, angles)


def test_the_reference_sees_what_phi3_and_smollm3_must_get_right(tmp_path, monkeypatch):
    """Through the fused epilogue, Phi-3's partial longrope with its
    pass-through dims rotated too (R = head_dim), or without SuScaledRoPE's
    input factor, is far off; so is SmolLM3 with RoPE on its NoPE layers."""
    x = mx.array([PROMPT])

    def err(source, patch):
        ref, _ = build_model(source, STOCK, dtype=mx.float32)
        with monkeypatch.context() as m:
            patch(m)
            flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
            return rel(flash(x), ref(x))

    long = _source(tmp_path, tiny.make_phi3, "phi3_longrope")
    smol = _source(tmp_path, tiny.make_smollm3, "smollm3")
    base = tiny.LLAMA_BASE["rope_theta"]
    real = kernels.rope_angles

    def whole_head(rope, h):  # the module's angles, then base's past them
        a = real(rope, h)
        rest = 1.0 / base ** (mx.arange(a.dims, h, 2, dtype=mx.float32) / h)
        return kernels.RopeAngles(mx.concatenate([a.inv_freq, rest]), h, a.mscale)

    errs = {
        "phi3 partial longrope, pass-through rotated": err(
            long, lambda m: m.setattr(kernels, "rope_angles", whole_head)
        ),
        "phi3 partial longrope, no input factor": err(
            long,
            lambda m: m.setattr(
                kernels, "rope_angles", lambda r, h: real(r, h)._replace(mscale=1.0)
            ),
        ),
        "smollm3 RoPE on every layer": err(
            smol,
            lambda m: m.setattr(
                smollm3.Attention,
                "__init__",
                lambda self, args, use_rope: smollm3.llama.Attention.__init__(
                    self, args
                ),
            ),
        ),
    }
    family.far_off(errs)


def test_smollm3_nope_layers_are_those_stock_reads(tmp_path):
    for cfg, want in (("smollm3", [1, 1, 1, 0]), ("smollm3_listed", [0, 1, 0])):
        model, _ = build_model(_source(tmp_path, tiny.make_smollm3, cfg), FLASHNORM)
        got = [int(l.self_attn._angles.inv_freq.any().item()) for l in model.layers]
        assert got == want, (cfg, got)


@EVERY
def test_convert_compat_loads_in_stock_mlx_lm(tmp_path, make, cfg):
    source = _source(tmp_path, make, cfg)
    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    assert max(errs.values()) < tiny.f32_tol(), errs


@pytest.mark.slow
def test_two_rank_tensor_parallel_matches_one_process_and_stock(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of FlashNorm and stock
    Phi-3 (partial longrope, fused q|k|v and gate|up split by rows) and
    SmolLM3: each as one process gives it, greedy tokens identical."""
    import test_distributed

    paths = {
        "phi3": tiny.make_phi3(tmp_path / "p", "phi3_longrope"),
        "smollm3": tiny.make_smollm3(tmp_path / "s", "smollm3"),
    }
    cases = family.launch_cases(paths, q4=False)
    test_distributed.ranks_match_one_process(cases, tmp_path)


# --- what a family cannot do is declared in its ARCH and is one line -------------


@pytest.mark.parametrize("arch", ["nemotron_h", "smollm3"])
def test_a_gguf_of_a_family_that_declares_none_is_one_line(tmp_path, arch, capsys):
    from flashnorm_mlx.cli import main

    path = tmp_path / f"{arch}.gguf"
    mx.save_gguf(
        str(path),
        {"token_embd.weight": mx.zeros((8, 4))},
        {"general.architecture": arch, f"{arch}.block_count": mx.array(1, mx.uint32)},
    )
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{arch} has no gguf: llama.cpp's {arch} files are not read yet" in err


def test_a_mode_a_family_declares_it_cannot_run_is_one_error(tmp_path, monkeypatch):
    import dataclasses

    source = _source(tmp_path, tiny.make_phi3, "phi3")
    why = "a made-up reason"
    monkeypatch.setattr(
        phi3, "ARCH", dataclasses.replace(phi3.ARCH, cannot=(("nonorm", why),))
    )
    with pytest.raises(UnsupportedModel) as e:
        build_model(source, NONORM)
    assert str(e.value) == f"phi3 has no nonorm: {why}", e.value
    assert isinstance(e.value, LoadError)
    build_model(source, STOCK)  # mlx-lm's class runs whatever the contract says


@pytest.mark.parametrize(
    "make,cfg,edit,said",
    [
        (
            tiny.make_smollm3,
            "smollm3",
            lambda c: c.update(no_rope_layers=[1, 0]),
            "'no_rope_layers' has 2 entries for 4 layers",
        ),
        (
            tiny.make_phi3,
            "phi3_longrope",
            lambda c: c["rope_scaling"].update(long_factor=[1.0, 2.0]),
            "rope_scaling long_factor has 2 entries for 6 rotary pairs",
        ),
    ],
    ids=["no_rope_layers", "long_factor"],
)
def test_a_config_that_does_not_fit_the_layers_is_one_line(
    tmp_path, make, cfg, edit, said, capsys
):
    from flashnorm_mlx.cli import main

    path = make(tmp_path / cfg, cfg)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
