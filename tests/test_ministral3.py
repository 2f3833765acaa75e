"""Ministral 3 (models/ministral3.py) and its Mistral 3 multimodal wrapper
(loading/wrappers.py) against mlx-lm's own classes on the same weights.

Tiny random models (tests/tiny.py), gains in [0.25, 4]: YaRN from
`rope_parameters` without an input scale (the fused epilogue can take it) and
with one (the model's own RoPE module), sliding-window layers, tied by
stock's default and untied; original_max_position_embeddings 8, so the query
scale 1 + beta * log(1 + floor(pos / 8)) changes within every prompt and
decode. The wrappers: text under `language_model.` and under
`model.language_model.` with vision weights to drop; stock is mlx-lm's
wrapper class, as `mlx_lm.load` builds the folder.
"""

import json

import family
import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_gguf import _u32, gguf_runs_as_folder, tiny_metadata, write_gguf
from tiny import PROMPT, rel

from flashnorm_mlx import mlx_lm_compat as compat
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.loading.gguf import read_gguf
from flashnorm_mlx.models import llama, ministral3
from flashnorm_mlx.modes import FLASHNORM, STOCK

EVERY = pytest.mark.parametrize("make,cfg", tiny.every_config("ministral3", "mistral3"))
WRAPPED = pytest.mark.parametrize("cfg", list(tiny.MISTRAL3_WRAPPERS))


def _source(tmp_path, make, cfg):
    return read_source(str(make(tmp_path / cfg, cfg, tokenizer=False)))


def quantized_folder(tmp_path, make, cfg):
    """`make`'s model 4-bit quantized and written as mlx-lm's convert writes
    it: a wrapper keeps its config, quantization block at the top, and its
    text weights under `language_model.` (vision dropped, as its sanitize does)."""
    path = make(tmp_path / cfg, cfg, tokenizer=False)
    source = tiny.quantized(read_source(str(path)))
    config = json.loads((path / "config.json").read_text())
    weights = source.weights
    if "text_config" in config:
        weights = {f"language_model.{k}": v for k, v in weights.items()}
    config["quantization"] = source.config["quantization"]
    out = tmp_path / f"{cfg}-q4"
    return tiny.write_model(out, config, {k: v for k, v in weights.items()}, False)


@EVERY
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_verify_float32_and_quantized_as_stored(tmp_path, make, cfg, engine):
    """`verify`: a prompt and 32 cached steps in float32 within 1e-4 relative
    of mlx-lm's class, and of its 4-bit model as stored (our gains then in the
    kernels; a wrapper's quantized as mlx-lm's convert writes it)."""
    source = _source(tmp_path, make, cfg)
    stored = read_source(str(quantized_folder(tmp_path, make, cfg)))
    assert stored.config["quantization"]["bits"] == 4
    family.verify(source, engine, stored)


@EVERY
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock_on_both_engines(
    tmp_path, make, cfg, quantized
):
    if quantized:
        src = read_source(str(quantized_folder(tmp_path, make, cfg)))
    else:
        src = _source(tmp_path, make, cfg)
    family.greedy_is_stocks(
        src, quantized, lambda flash: flash.layers[0].self_attn.qkv_proj, few=None
    )


@EVERY
def test_folded_model_keeps_no_pre_linear_gain_and_stocks_layers(tmp_path, make, cfg):
    """Every pre-linear norm folded (the final one too where the head is
    untied); sliding layers, tie and head as stock's class has them."""
    source = _source(tmp_path, make, cfg)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    names = [k for k, _ in tree_flatten(flash.parameters())]
    left = [k for k in names if "layernorm" in k or k.startswith("model.norm")]
    tied = source.config.get("tie_word_embeddings", True)
    assert left == ([] if not tied else ["model.norm.weight"]), left
    want = [layer.use_sliding for layer in stock.layers]
    assert [layer.use_sliding for layer in flash.layers] == want
    assert ("lm_head" in flash) == (
        "lm_head" in getattr(stock, "language_model", stock)
    )


@WRAPPED
def test_a_wrapper_is_read_as_its_text_model_and_stock_is_mlx_lms_wrapper(
    tmp_path, cfg
):
    """Config = text_config with the wrapper's tie default, no vision weight,
    the text model's names; stock: mlx_lm.load's wrapper class on the folder."""
    from mlx_lm.utils import load_model

    path = tiny.make_mistral3(tmp_path / cfg, cfg, tokenizer=False)
    source = read_source(str(path))
    text_type = tiny.mistral3_config(cfg)["text_config"]["model_type"]
    assert source.config["model_type"] == text_type
    assert source.config["tie_word_embeddings"] is False
    assert source.wrapper["model_type"] == "mistral3"
    assert all(
        k.startswith(("model.layers.", "model.norm", "model.embed", "lm_"))
        for k in source.weights
    ), sorted(source.weights)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    theirs, _ = load_model(path)
    assert type(stock).__module__ == "mlx_lm.models.mistral3"
    x = mx.array([PROMPT])
    assert rel(stock(x), theirs(x)) == 0.0


def test_the_reference_sees_what_ministral3_must_get_right(tmp_path, monkeypatch):
    """Each piece broken on purpose is far off stock over the prompt and 32
    cached steps (positions past original_max_position_embeddings): the query
    scale dropped, or put on k too; the sliding layers swapped; YaRN's input
    scale (mscale) dropped; the wrapper's vision weights taken."""
    plain = _source(tmp_path, tiny.make_ministral3, "ministral3")
    mscale = _source(tmp_path, tiny.make_ministral3, "ministral3_mscale_sliding")

    def err(source, patch):
        with monkeypatch.context() as m:
            patch(m)
            r = compare(source, PROMPT, horizon=32, dtype=mx.float32, engine="eager")
        return r["max_rel_logit_diff"]

    def on_k_too(self, xs, ms, offset):
        q, k, v = llama.Attention.heads(self, xs, ms, offset)
        scale = compat.llama4_attn_scale(
            q.shape[2], offset, self.scaling_beta, self.original_max_position_embeddings
        ).astype(q.dtype)
        return q * scale, k * scale, v

    def no_mscale(m):
        real = ministral3.Attention.make_rope

        def rope(self, args, h):
            r = real(self, args, h)
            r.mscale = 1.0
            return r

        m.setattr(ministral3.Attention, "make_rope", rope)

    errs = {
        "query scale dropped": err(
            plain,
            lambda m: m.setattr(ministral3.Attention, "heads", llama.Attention.heads),
        ),
        "query scale on k too": err(
            plain, lambda m: m.setattr(ministral3.Attention, "heads", on_k_too)
        ),
        "sliding layers swapped": err(
            mscale,
            lambda m: m.setattr(
                ministral3.Model,
                "is_sliding",
                lambda self, args, i: args.layer_types[i] != "sliding_attention",
            ),
        ),
        "yarn mscale dropped": err(mscale, no_mscale),
    }
    family.far_off(errs)


def test_taking_the_vision_weights_is_refused_not_run(tmp_path, monkeypatch):
    """Vision weights are not the text model's: kept, the build fails (so the
    wrapper tests above prove they are dropped)."""
    from flashnorm_mlx.loading import wrappers

    path = tiny.make_mistral3(tmp_path / "v", "mistral3_vision", tokenizer=False)
    keep = dict(wrappers.WRAPPERS["mistral3"].__dict__, drop=())
    monkeypatch.setitem(wrappers.WRAPPERS, "mistral3", wrappers.Wrapper(**keep))
    with pytest.raises(Exception, match="vision_tower|multi_modal_projector"):
        build_model(read_source(str(path)), FLASHNORM, dtype=mx.float32)


@EVERY
@pytest.mark.parametrize(
    "q_method", [None, "rtn", "gptq"], ids=["float", "rtn", "gptq"]
)
def test_convert_loads_in_stock_mlx_lm(tmp_path, make, cfg, q_method):
    """`convert --compat` (float, and -q by RTN and GPTQ): mlx-lm's own
    load_model runs the checkpoint, a ministral3 folder mlx-lm names by its
    text model_type, as FlashNorm on it does; float within 1e-4 of stock on
    the source, quantized equal to FlashNorm on the same checkpoint."""
    from mlx_lm.utils import load_model

    from flashnorm_mlx.jobs.checkpoint import convert
    from flashnorm_mlx.quant import gptq

    source = read_source(str(make(tmp_path / cfg, cfg)))
    if q_method is None:
        errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
        assert max(errs.values()) < tiny.f32_tol(), errs
        return
    out = tmp_path / "q4"
    convert(
        source,
        out,
        quantize=(4, 32),
        compat=True,
        progress=False,
        q_method=q_method,
        calibration=gptq.Calibration(num_seqs=4, seq_len=32),
    )
    config = json.loads((out / "config.json").read_text())
    text_type = source.config["model_type"]  # a wrapper's: its text model's
    assert config["model_type"] == text_type and "text_config" not in config
    assert config["flashnorm"]["quantization_method"]["method"] == q_method
    theirs, _ = load_model(out)
    ours, _ = build_model(read_source(str(out)), FLASHNORM)
    x = mx.array([PROMPT])
    assert rel(ours(x), theirs(x)) < tiny.f32_tol(), rel(ours(x), theirs(x))


@pytest.mark.parametrize("name", ["ministral3", "mistral3"])
def test_flashnorm_load_peak_is_stocks(tmp_path, name):
    """Many thin layers (tests/test_load_memory.py's measure): FlashNorm's
    load peak at most 1.03x stock's, on the wrapper too (its vision weights
    never read)."""
    import test_load_memory

    text = {**tiny.ministral3_config("ministral3"), **test_load_memory.CFG}
    text.update(model_type="ministral3", head_dim=None, tie_word_embeddings=False)
    text = {k: v for k, v in text.items() if v is not None and k != "rope_theta"}
    w = tiny.llama_weights(text)
    config = text
    if name == "mistral3":
        config = {**tiny.mistral3_config("mistral3"), "text_config": text}
        w = {f"language_model.{k}": v for k, v in w.items()}
        w["vision_tower.patch_conv.weight"] = np.ones((4096, 512), np.float32)
    path = tiny.write_model(tmp_path / name, config, w, tokenizer=False)
    got = test_load_memory.peaks(path, False)
    stock, flashnorm = got["stock"], got["flashnorm"]
    print(f"{name} load peak: flashnorm {flashnorm} B, stock {stock} B")
    assert flashnorm <= 1.03 * stock, (flashnorm, stock)


@pytest.mark.slow
def test_two_rank_tensor_parallel_matches_one_process_and_stock(tmp_path):
    """A 2-rank `mlx.launch` (tests/distributed_child.py) of FlashNorm and
    stock on ministral3 (YaRN with its input scale, sliding layers) and on
    the mistral3 wrapper: each as one process gives it, greedy identical."""
    import test_distributed

    paths = {
        "ministral3": tiny.make_ministral3(tmp_path / "m", "ministral3_mscale_sliding"),
        "mistral3": tiny.make_mistral3(tmp_path / "w", "mistral3"),
    }
    cases = family.launch_cases(paths, q4=False)
    test_distributed.ranks_match_one_process(cases, tmp_path)


# --- bad wrappers are one line; wrappers FlashNorm does not cover run as stock -----


@pytest.mark.parametrize(
    "edit,said",
    [
        (lambda c: c.pop("text_config"), "a mistral3 config needs a text_config"),
        (
            lambda c: c["text_config"].update(model_type="no_such_model"),
            "text_config: unsupported model_type 'no_such_model'",
        ),
        (lambda c: c["text_config"].pop("model_type"), "text_config has no model_type"),
        (
            lambda c: c["text_config"].update(hidden_size=-3),
            "config.json text_config: hidden_size is -3",
        ),
    ],
    ids=["no_text_config", "unknown_text_type", "no_text_type", "bad_text_value"],
)
def test_a_bad_wrapper_is_one_line(tmp_path, edit, said, capsys):
    from flashnorm_mlx.cli import main

    path = tiny.make_mistral3(tmp_path / "w", "mistral3")
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err


def test_a_wrapper_of_a_text_family_not_read_out_runs_as_stock(tmp_path, capsys):
    """mistral3 around a text model_type not in its table (Qwen2 here, which
    mlx-lm's wrapper runs as Llama): read as it is, run as stock with the
    one-line note, as every wrapper was."""
    from flashnorm_mlx.cli import main

    path = tiny.make_mistral3(tmp_path / "w", "mistral3")
    config = json.loads((path / "config.json").read_text())
    text = {**tiny.LLAMA_BASE, "model_type": "qwen2", "tie_word_embeddings": False}
    config["text_config"] = text
    (path / "config.json").write_text(json.dumps(config))
    w = {f"language_model.{k}": v for k, v in tiny.llama_weights(text).items()}
    tiny.write_model(path, config, w)
    source = read_source(str(path))
    assert source.wrapper is None and source.config["model_type"] == "mistral3"
    assert main(["generate", str(path), "-p", "hi", "-m", "2"]) == 0
    err = capsys.readouterr().err
    assert "FlashNorm does not cover model_type 'mistral3' yet" in err, err


@pytest.mark.parametrize(
    "edit,said",
    [
        (lambda c: c.pop("rope_parameters"), "rope_parameters is missing"),
        (
            lambda c: c["rope_parameters"].pop("llama_4_scaling_beta"),
            "rope_parameters needs 'llama_4_scaling_beta'",
        ),
        (
            lambda c: c["rope_parameters"].update(original_max_position_embeddings=0),
            "original_max_position_embeddings must be a positive number",
        ),
        (lambda c: c["rope_parameters"].pop("factor"), "yarn scaling needs 'factor'"),
    ],
    ids=["no_rope_parameters", "no_beta", "zero_original", "yarn_no_factor"],
)
def test_a_bad_rope_parameters_is_one_line(tmp_path, edit, said, capsys):
    from flashnorm_mlx.cli import main

    path = tiny.make_ministral3(tmp_path / "m", "ministral3")
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err


# --- Ministral 3 (mistral3) ----------------------------------------------------------


def ministral3_gguf(tmp_path, cfg: dict, hf: dict, qtype=None, **meta_over):
    """A mistral3 file as llama.cpp's converter writes it: LlamaModel's names
    and Q/K permutation (test_gguf's copy of LlamaModel.permute), YaRN in the
    metadata (TextModel.set_gguf_parameters) and Ministral3Model's
    yarn_log_multiplier (mscale_all_dim) and temperature scale (beta)."""
    from test_gguf import _gguf_name, llama_cpp_permute

    rope = cfg["rope_parameters"]
    meta = tiny_metadata({**cfg, "rope_theta": rope["rope_theta"]}, arch="mistral3")
    a = "mistral3"
    meta.update(
        {
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": mx.array(rope["factor"]),
            f"{a}.rope.scaling.original_context_length": _u32(
                rope["original_max_position_embeddings"]
            ),
            f"{a}.rope.scaling.yarn_beta_fast": mx.array(rope["beta_fast"]),
            f"{a}.rope.scaling.yarn_beta_slow": mx.array(rope["beta_slow"]),
            f"{a}.rope.scaling.yarn_log_multiplier": mx.array(rope["mscale_all_dim"]),
            f"{a}.attention.temperature_scale": mx.array(rope["llama_4_scaling_beta"]),
            **meta_over,
        }
    )
    tensors = {}
    for k, v in hf.items():
        if "rotary_emb" in k:  # a buffer, no weight (TextModel.filter_tensors)
            continue
        v = np.array(v)
        if ".q_proj." in k:
            v = llama_cpp_permute(v, cfg["num_attention_heads"])
        elif ".k_proj." in k:
            v = llama_cpp_permute(v, cfg["num_key_value_heads"])
        tensors[_gguf_name(k)] = v
    return write_gguf(tmp_path / "mistral3.gguf", a, meta, tensors, qtype)


@pytest.mark.parametrize("qtype", [None, "Q4_0"], ids=["f32", "q4_0"])
def test_llama_cpp_mistral3_gguf_runs_as_the_ministral3_checkpoint(tmp_path, qtype):
    """Float32: the same tensors (Q/K unpermuted), YaRN and Llama 4's query
    scale from the metadata, stock and FlashNorm on the file as stock on the
    folder past several scale changes; Q4_0: as stored, like stock."""
    import json

    folder = tiny.make_ministral3(tmp_path / "hf", seed=7)
    cfg = json.loads((folder / "config.json").read_text())
    hf = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    path = ministral3_gguf(tmp_path, cfg, hf, qtype)
    if qtype:
        r = compare(read_source(str(path)), PROMPT, horizon=12, dtype=mx.float32)
        assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
        assert r["greedy_match"] == 12, r
        return
    config, weights, _ = read_gguf(path, load_tokenizer=False)
    assert config["model_type"] == "ministral3", config
    want = {k: v for k, v in cfg["rope_parameters"].items()}
    got = {k: config["rope_parameters"].get(k) for k in want}
    assert got == want, (got, want)
    hf = {k: v for k, v in hf.items() if "rotary_emb" not in k}
    assert sorted(weights) == sorted(hf)
    for k, v in hf.items():
        assert np.array_equal(np.array(weights[k]), v), k
    errs = gguf_runs_as_folder(folder, path, PROMPT * 2)  # 24 > 2 * 8 positions
    print(f"mistral3: rel logit errors {errs}")


def test_a_mistral3_file_with_a_sliding_window_is_one_line(tmp_path, capsys):
    """llama.cpp's converter writes no layer types: a window in the file is
    refused in one line, exit 1, nothing run."""
    from flashnorm_mlx.cli import main

    folder = tiny.make_ministral3(tmp_path / "hf", seed=7, tokenizer=False)
    import json

    cfg = json.loads((folder / "config.json").read_text())
    hf = dict(mx.load(str(folder / "model.safetensors")))
    window = {"mistral3.attention.sliding_window": _u32(4)}
    path = ministral3_gguf(tmp_path, cfg, hf, **window)
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sliding window" in err, err


def test_a_mistral3_file_without_yarn_is_a_plain_mistral(tmp_path):
    """Mistral Small 3.1's text model converts to `mistral3` with neither YaRN
    nor a temperature scale: read as Mistral (mlx-lm runs it as Llama), its
    Q/K rows unpermuted, the same tensors as the Llama-layout file."""
    from test_gguf import write_tiny_gguf

    cfg = dict(tiny.LLAMA_BASE)
    hf = tiny.llama_weights(cfg, seed=8)
    llama = write_tiny_gguf(tmp_path / "llama.gguf", cfg, hf)
    tensors, meta = mx.load(str(llama), return_metadata=True)
    meta = {k.replace("llama.", "mistral3.", 1): v for k, v in meta.items()}
    meta["general.architecture"] = "mistral3"
    path = tmp_path / "mistral3.gguf"
    mx.save_gguf(str(path), tensors, meta)
    config, weights, _ = read_gguf(path, load_tokenizer=False)
    assert config["model_type"] == "mistral" and "rope_parameters" not in config
    _, want, _ = read_gguf(llama, load_tokenizer=False)
    assert sorted(weights) == sorted(want)
    for k, v in want.items():
        assert mx.array_equal(weights[k], v).item(), k
