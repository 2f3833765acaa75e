"""q|k|v and gate|up stored with different quantization settings, as mlx-lm's
mixed recipes and llama.cpp's quantizer store them: FlashNorm stacks each as
one matmul (loading/stacks.py). Reference: stock mlx-lm on the same weights;
llama.cpp's own files: test_gguf_llama_cpp.py."""

import mlx.core as mx
import pytest
import tiny

from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import Source, build_model
from flashnorm_mlx.loading.stacks import mixed_settings
from flashnorm_mlx.modes import FLASHNORM

PROMPT = [5, 17, 99, 3, 250, 42, 7]


def _mixed(v_spec: dict, mlp_spec: dict, over: dict) -> Source:
    """A tiny Llama at 4-bit group 64, v_proj and up_proj stored otherwise."""
    cfg = dict(tiny.LLAMA_BASE, intermediate_size=128, **over)  # groups of 64
    w = {k: mx.array(v) for k, v in tiny.llama_weights(cfg, seed=5).items()}
    q = {"group_size": 64, "bits": 4, "mode": "affine"}
    out = {}
    for k, v in w.items():
        m = k[: -len(".weight")]
        if not (k.endswith(".weight") and v.ndim == 2):
            out[k] = v
            continue
        spec = v_spec if ".v_proj" in m else mlp_spec if ".up_proj" in m else q
        if spec is None:  # kept float, as a GGUF's Q6_K is read
            out[k] = v
            continue
        if spec is not q:
            q[m] = spec
        parts = mx.quantize(v, spec["group_size"], spec["bits"], mode=spec["mode"])
        names = ("weight", "scales", "biases")[: len(parts)]
        out.update({f"{m}.{n}": p for n, p in zip(names, parts)})
    return Source("mixed", {**cfg, "quantization": q}, out)


@pytest.mark.parametrize(
    "v_spec,way,over",
    [
        ({"group_size": 32, "bits": 8, "mode": "affine"}, "lifted", {}),
        ({"group_size": 32, "bits": 4, "mode": "mxfp4"}, "joined", {}),
        (None, "joined", {}),
        (None, "joined", tiny.LLAMA_CONFIGS["linear_bias"]),  # q|k|v biases
    ],
    ids=["lifted", "mxfp4", "float", "float_bias"],
)
def test_mixed_stacks_run_in_flashnorm_as_stock(v_spec, way, over):
    """v at 8-bit group 32 beside 4-bit group 64 q and k (up at 6-bit group
    64 beside a 4-bit gate): q, k lifted to 8-bit group 32, the same weights;
    an mxfp4 or a float v: q, k and v run as stored, one matmul each
    (models/joined.py). FlashNorm's tokens equal stock's."""
    mlp = {"group_size": 64, "bits": 6, "mode": "affine"}
    source = _mixed(v_spec, mlp, over)
    assert len(mixed_settings(source.weights, source.config)) == 4
    notes = []
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32, notes=notes)
    attn = flash.model.layers[0].self_attn.qkv_proj
    if way == "lifted":
        assert (attn.bits, attn.group_size) == (8, 32), (attn.bits, attn.group_size)
    else:  # each member as the checkpoint holds it
        kinds = [type(p).__name__ for p in attn.parts]
        want = "QuantizedLinear" if v_spec else "Linear"
        assert kinds == ["QuantizedLinear"] * 2 + [want], kinds
        mode = getattr(attn.parts[2], "mode", "affine")
        assert mode == (v_spec or {}).get("mode", "affine"), mode
    assert flash.model.layers[0].mlp.gate_up_proj.bits == 6
    said = "lifted" if way == "lifted" else "stacks mixing float and quantized"
    assert len(notes) == 1 and said in notes[0], notes
    r = compare(source, PROMPT, horizon=8, dtype=mx.float32)
    print(f"{way}: FlashNorm vs stock {r['max_rel_logit_diff']:.3e}; {notes[0]}")
    assert r["max_rel_logit_diff"] < tiny.f32_tol(), r
    assert r["greedy_match"] == 8, r


def test_a_mixed_stack_that_cannot_be_joined_is_dequantized_in_float():
    """Where the model may not hold a Joined (a sharded build cuts stacked
    rows), a float v beside 4-bit q and k makes every member float: the
    stored function, reference mx.dequantize in float32 of each member."""
    from flashnorm_mlx.loading.stacks import common_settings, note

    source = _mixed(None, {"group_size": 64, "bits": 6, "mode": "affine"}, {})
    before = dict(source.weights)
    tensors, config, added = common_settings(
        source.weights, source.config, mx.float32, join=False
    )
    q = config["quantization"]
    for m in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"):
        assert f"{m}.scales" not in tensors and m not in q, m
        want = mx.dequantize(
            before[f"{m}.weight"],
            before[f"{m}.scales"].astype(mx.float32),
            before[f"{m}.biases"].astype(mx.float32),
            group_size=64,
            bits=4,
        )
        got = tensors[f"{m}.weight"]
        assert got.dtype == mx.float32 and mx.array_equal(got, want).item(), m
    assert added["float"] > 0 and added["joined"] == 0, added
    assert "dequantized into a float stack" in note(added), note(added)
