"""Nemotron-H and Nemotron 3 (models/nemotron_h.py) against mlx-lm's own
`nemotron_h` class on the same weights: Mamba-2, attention without RoPE,
ReLU² MLPs and sigmoid-routed experts, one norm a block.

Tiny random models (tests/tiny.py `make_nemotron_h`) as checkpoints write
them (the pattern a string, time_step_limit [0.0, Infinity], Conv1d
(C, 1, K), per-expert up/down), every norm gain in [0.25, 4] (the grouped
gated norms' too), embeddings of RMS 4 so that s is far from 1:
- `nemotron_h`: M * - M -, every bias the config has (in_proj, conv, out_proj,
  q|k|v, o_proj, up, down);
- `nemotron_h_moe`: M E * M E, group routing with a correction bias that
  changes picks, a shared expert, no biases (as shipped).
"""

import family
import mlx.core as mx
import mlx.nn as nn
import pytest
import tiny
from mlx.utils import tree_flatten
from tiny import PROMPT, rel

from flashnorm_mlx import fold
from flashnorm_mlx.errors import ShardError
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.models import nemotron_h
from flashnorm_mlx.modes import FLASHNORM, STOCK

NAMES = list(tiny.NEMOTRON_H_CONFIGS)


# stock_q4: mlx-lm's own `convert -q` of the folder, read back as stored.
folder, source, stock_q4 = family.fixtures(tiny.make_nemotron_h, NAMES)
_source = family.sources(tiny.make_nemotron_h)


def test_blocks_as_stocks_and_no_norm_gain_left(source):
    """Block kinds as stock's pattern; folded, no norm gain is a parameter:
    the block norms in the mixers' input projections, the gated norms in
    out_proj, the final norm in lm_head."""
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    assert [l.kind for l in model.layers] == [l.block_type for l in stock.layers]
    norms = [k for k, _ in tree_flatten(model.parameters()) if "norm" in k]
    assert not norms, norms


@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_verify_float32(source, engine):
    """`verify`: a prompt and 32 cached steps within 1e-4 relative of mlx-lm's
    class in float32 (the compiled engine on the dense config alone: its
    every block kind, at a fraction of the compile cost)."""
    if engine == "compiled" and source.config["hybrid_override_pattern"] != "M*-M-":
        pytest.skip("one config on the compiled engine (its trace is the cost)")
    family.verify(source, engine)


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock(source, stock_q4, quantized):
    """64 greedy tokens as stock's, float32 and mlx-lm's 4-bit checkpoint as
    stored (its gains kept where the kernels apply them)."""
    family.greedy_is_stocks(
        stock_q4 if quantized else source,
        quantized,
        lambda flash: flash.layers[0].mixer.in_proj,
        engines=("eager",),
    )


@pytest.mark.parametrize("latent", [None, 32], ids=["direct", "latent"])
def test_every_tokens_experts_are_stocks_at_every_step(tmp_path, latent):
    """The experts each token picks (s * logits through stock's sigmoid, group
    routing and correction bias) equal stock's, prompt and 32 greedy steps;
    they vary; the logits of a prompt long enough for stock's expert-sorted
    path too. With a latent projection (`moe_latent_size`, and the biases of
    mlp_bias) as well."""
    over = dict(moe_latent_size=latent, mlp_bias=True) if latent else {}
    src = _source(tmp_path, "nemotron_h_moe", **over)
    logs, logits = {}, {}
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(src, mode, dtype=mx.float32, engine="eager")
        logits[mode.name] = model(mx.array([PROMPT * 3]))  # 72 rows: sorted by expert
        logs[mode.name] = family.record_picks(model, "mixer.switch_mlp")
        family.greedy(model, 32)
    family.picks_are_stocks(logs["stock"], logs["flashnorm"], 2)
    err = rel(logits["flashnorm"], logits["stock"])
    print("latent", latent, "logits", err)
    assert err < tiny.f32_tol(), err


def test_hugging_face_files_read_as_mlx_lm_reads_them(source):
    """Ours and our stock against mlx-lm's own `load_model` of the folder."""
    from mlx_lm.utils import load_model

    theirs, _ = load_model(source.folder)
    x = mx.array([PROMPT])
    errs = {
        mode.name: rel(build_model(source, mode, dtype=mx.float32)[0](x), theirs(x))
        for mode in (STOCK, FLASHNORM)
    }
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_a_block_type_list_without_a_layer_count_reads_as_mlx_lm_reads_it(tmp_path):
    """transformers 5.13 writes `layers_block_type` (names, not characters) and
    no num_hidden_layers; mlx-lm derives both. Ours and stock's logits there
    are mlx-lm's own `load_model`'s."""
    import json

    from mlx_lm.utils import load_model

    path = tiny.make_nemotron_h(tmp_path / "f", "nemotron_h", tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    del config["num_hidden_layers"]
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    pattern = config.pop("hybrid_override_pattern")
    config["layers_block_type"] = [names[c] for c in pattern]
    (path / "config.json").write_text(json.dumps(config))
    source = read_source(str(path), need_tokenizer=False)
    x = mx.array([PROMPT])
    theirs = load_model(path)[0](x)
    errs = {
        m.name: rel(build_model(source, m)[0](x), theirs) for m in (STOCK, FLASHNORM)
    }
    assert max(errs.values()) < tiny.f32_tol(), errs


def test_the_reference_sees_what_nemotron_h_must_get_right(tmp_path, monkeypatch):
    """Each break, made on purpose, moves the logits far past the tolerance:
    s moved past the convolution (exact were s the same on every token), the
    grouped gated norm's 1/RMS taken over the whole vector, the gated norm's
    gain left out of out_proj, dt without s. On the config without in_proj
    biases, so that undoing s is a division."""
    src = _source(tmp_path, "nemotron_h_moe")
    breaks = family.breaker(monkeypatch, src, mx.array([PROMPT * 2]))
    M = nemotron_h.Mamba2
    real_project = M.project
    box = {}

    def err(*patches, built=lambda model: None):
        return breaks(lambda m: [m.setattr(M, n, fn) for n, fn in patches], built)

    def unscaled(part):  # project with `part` (1: x|B|C, 2: dt) lacking s
        def project(self, xs, ms):
            parts = list(real_project(self, xs, ms))
            box["s"] = mx.rsqrt(ms)
            parts[part] = parts[part] / box["s"]
            return parts

        return project

    class LateConv(nn.Module):  # s * (conv(x) - b) + b: exact were s one scalar
        def __init__(self, conv):
            super().__init__()
            self.conv = conv

        def __call__(self, x):
            b = self.conv.bias
            return (self.conv(x) - b) * box["s"] + b

    def late_conv(model):
        for layer in model.layers:
            if layer.kind == "M":
                layer.mixer.conv1d = LateConv(layer.mixer.conv1d)

    def whole_vector(self, y, gate):
        return mx.fast.rms_norm(nemotron_h.swiglu(gate, y), None, self.eps)

    folded = fold.fold_gain

    def unfolded_out_proj(weights, gain, linear):
        skip = linear.endswith("mixer.out_proj")
        return weights if skip else folded(weights, gain, linear)

    gain_left = breaks(lambda m: m.setattr(fold, "fold_gain", unfolded_out_proj))
    errs = {
        "s past the convolution": err(("project", unscaled(1)), built=late_conv),
        "gated norm's 1/RMS over the whole vector": err(("gated_norm", whole_vector)),
        "gated norm's gain not in out_proj": gain_left,
        "dt without s": err(("project", unscaled(2))),
    }
    family.far_off(errs)


def test_fold_twice_equals_fold_once_and_folds_the_gated_norms(source):
    once = family.fold_once(source)
    left = [k for k in once if "norm" in k]
    assert not left, left
    gated = nemotron_h.ARCH.gated_norms(source.config)
    assert len(gated) == source.config["hybrid_override_pattern"].count("M"), gated


def test_convert_compat_loads_in_stock_mlx_lm(source, tmp_path):
    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    assert max(errs.values()) < tiny.f32_tol(), errs


@pytest.mark.parametrize("name", NAMES)
def test_convert_q_rtn_and_gptq_load_in_mlx_lm(tmp_path, name):
    """-q, both methods: in_proj quantized (RTN: mx.quantize of the folded
    weight; GPTQ: not); each --compat checkpoint loads in mlx-lm, whose logits
    there equal ours. At 8 bits; tiny random models' quantization noise is
    chaotic, so no ratio to stock's error is asserted (printed)."""
    family.convert_q_loads_in_mlx_lm(
        _source(tmp_path, name),
        tmp_path,
        "backbone.layers.0.mixer.in_proj.weight",
        linear="mixer.in_proj",
        stock8=True,
    )


@pytest.mark.parametrize("name", NAMES)
def test_bench_counts_fewer_launches(tmp_path, name):
    tiny.bench_launches(_source(tmp_path, name), name)


@pytest.mark.slow
def test_two_rank_tensor_parallel_matches_one_process_and_stock(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of FlashNorm and stock
    on both configs and a latent MoE with biases (Mamba-2 by whole groups,
    attention by GQA groups, MLPs and experts by hidden columns; float32 and
    FlashNorm's 4-bit): each as one process gives it, greedy tokens identical."""
    import test_distributed

    make = tiny.make_nemotron_h
    paths = {n: make(tmp_path / n, n, tokenizer=False) for n in NAMES}
    latent = dict(moe_latent_size=32, mlp_bias=True)  # its biases once in the sum
    label = "nemotron_h_moe-latent"
    latent = {
        label: make(tmp_path / label, "nemotron_h_moe", tokenizer=False, **latent)
    }
    cases = family.launch_cases(paths) + family.launch_cases(latent, q4=False)
    test_distributed.ranks_match_one_process(cases, tmp_path)


def test_more_ranks_than_mamba_groups_is_one_line(source):
    """A rank needs a whole group of the Mamba-2 mixer: 4 ranks over its 2
    groups is one ShardError line, ours and stock's."""

    class FourRanks:  # mx.distributed's group as rank 0 of 4 sees it
        def size(self):
            return 4

        def rank(self):
            return 0

    for mode in (FLASHNORM, STOCK):
        with pytest.raises(ShardError) as e:
            build_model(source, mode, dtype=mx.float32, group=FourRanks())
        assert "\n" not in str(e.value) and "2 groups" in str(e.value), e.value


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4_as_stored"])
def test_load_peak_is_stocks(tmp_path, quantized):
    """Reading and building FlashNorm peaks within 3% of stock on the same
    16-layer MoE folder, float32 and mlx-lm's 4-bit as stored
    (tests/test_load_memory.py's measure)."""
    over = dict(hybrid_override_pattern="ME*-" * 4, num_hidden_layers=16)
    family.load_peak_is_stocks(
        tmp_path, tiny.make_nemotron_h, quantized, name="nemotron_h_moe", **over
    )
