"""What the commands say to a user: config and shape errors in the checkpoint's
own words, the note on a quantized source, each command's --help."""

import io
import json
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import tiny

from flashnorm_mlx.cli import main


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama with its tokenizer (transformers reads config.json for it)."""
    return tiny.make_llama(tmp_path_factory.mktemp("m"), "gqa_untied")


def _altered(base, tmp_path, config=None, drop=(), weights=None):
    """A copy of `base` with config.json changed (`config`: key -> value, None
    removes the key) or its weights replaced."""
    out = tmp_path / "altered"
    shutil.copytree(base, out)
    cfg = json.loads((base / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        mx.save_safetensors(
            str(out / "model.safetensors"),
            {k: mx.array(v) for k, v in weights.items()},
        )
    return out


def _one_error(argv, capsys):
    """(exit status, the one stderr line): no traceback escapes main()."""
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    err = [e for e in err if not e.startswith(f"flashnorm-mlx {argv[0]}: ")]
    assert rc == 1, (argv, rc, err)
    assert len(err) == 1 and err[0].startswith("flashnorm-mlx: error: "), err
    return err[0]


# --- config errors name the config's fields ----------------------------------

CONFIG_ERRORS = {
    "heads do not divide hidden_size": (
        {"num_attention_heads": 5},
        "config.json: hidden_size 64 is not a multiple of num_attention_heads 5",
    ),
    "kv heads do not divide heads": (
        {"num_key_value_heads": 3},
        "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    "head_dim 0": ({"head_dim": 0}, "config.json: head_dim is 0: expected an integer"),
    "head_dim a string": ({"head_dim": "x"}, 'config.json: head_dim is "x"'),
    "vocab_size 0": ({"vocab_size": 0}, "config.json: vocab_size is 0"),
    "num_hidden_layers 0": (
        {"num_hidden_layers": 0},
        "config.json: num_hidden_layers is 0",
    ),
    **{
        f"no {key}": ({key: None}, f"config.json: {key} is missing")
        for key in (
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "vocab_size",
            "intermediate_size",
        )
    },
}


@pytest.mark.parametrize("what", list(CONFIG_ERRORS))
@pytest.mark.parametrize("command", ["generate", "convert"])
def test_a_config_error_names_the_configs_fields(
    what, command, llama_dir, tmp_path, capsys
):
    """Not transformers' `could not load the tokenizer (Class validation error
    ...)`: the field and its value, as config.json spells them."""
    change, says = CONFIG_ERRORS[what]
    model = _altered(llama_dir, tmp_path, change)
    argv = {
        "generate": ["generate", str(model), "-p", "hi", "-m", "1"],
        "convert": ["convert", str(model), "-o", str(tmp_path / "out")],
    }[command]
    line = _one_error(argv, capsys)
    assert says in line and "tokenizer" not in line, (what, line)
    assert not (tmp_path / "out").exists()


def test_a_config_error_through_the_entry_point(llama_dir, tmp_path):
    model = _altered(llama_dir, tmp_path, {"num_attention_heads": 5})
    r = subprocess.run(
        [sys.executable, "-m", "flashnorm_mlx", "chat", str(model)],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(err) == 1, err
    assert err[0].endswith(
        "config.json: hidden_size 64 is not a multiple of num_attention_heads 5"
    ), err


# --- shape errors name the checkpoint's tensor and both shapes ---------------


def _reshaped(cfg, name, shape):
    weights = tiny.llama_weights(cfg)
    assert name in weights and weights[name].shape != shape
    weights[name] = np.zeros(shape, np.float32)
    return weights


SHAPE_CASES = {  # tensor -> the shape written in its place
    "model.layers.0.mlp.gate_proj.weight": (80, 64),  # stacked as gate|up by ours
    "model.layers.1.self_attn.k_proj.weight": (16, 64),  # stacked as q|k|v
    "model.layers.0.post_attention_layernorm.weight": (32,),  # folded into gate|up
    "model.embed_tokens.weight": (200, 64),
}


@pytest.mark.parametrize("name", list(SHAPE_CASES))
@pytest.mark.parametrize("mode", ["flashnorm", "stock", "convert"])
def test_a_shape_error_names_the_checkpoints_tensor(
    name, mode, llama_dir, tmp_path, capsys
):
    cfg = json.loads((llama_dir / "config.json").read_text())
    shape = SHAPE_CASES[name]
    model = _altered(llama_dir, tmp_path, weights=_reshaped(cfg, name, shape))
    want = list(tiny.llama_weights(cfg)[name].shape)
    if mode == "convert":
        argv = ["convert", str(model), "-o", str(tmp_path / "out")]
        argv += ["-q", "--q-method", "rtn"]
    else:
        argv = ["generate", str(model), "-p", "hi", "-m", "1", "--mode", mode]
    line = _one_error(argv, capsys)
    says = f"tensor {name} has shape {list(shape)}, but config.json makes it {want}"
    assert line.endswith(says), (line, says)
    assert "gate_up_proj" not in line and "qkv_proj" not in line, line
    assert not (tmp_path / "out").exists()  # convert wrote nothing


@pytest.mark.parametrize("layers,says", [(3, "no tensor"), (1, "has no place")])
def test_a_layer_count_that_does_not_fit_the_weights(
    layers, says, llama_dir, tmp_path, capsys
):
    """Two layers of weights, a config of 3 (a KeyError inside the fold before)
    or of 1: the first tensor missing or left over, by its name."""
    model = _altered(llama_dir, tmp_path, {"num_hidden_layers": layers})
    for mode in ("flashnorm", "stock"):
        argv = ["generate", str(model), "-p", "hi", "-m", "1", "--mode", mode]
        line = _one_error(argv, capsys)
        assert says in line and "model.layers." in line, (mode, line)
        assert "config.json" in line, line


def test_a_quantized_tensor_is_compared_unpacked(llama_dir, tmp_path, capsys):
    """A 4-bit checkpoint whose one weight has other rows: its shape unpacked."""
    cfg = json.loads((llama_dir / "config.json").read_text())
    name = "model.layers.0.self_attn.o_proj.weight"
    weights = _reshaped(cfg, name, (48, 64))
    packed = {}
    for k, v in weights.items():
        if v.ndim == 2:
            w, s, b = mx.quantize(mx.array(v), group_size=32, bits=4)
            m = k[: -len(".weight")]
            packed.update({k: w, f"{m}.scales": s, f"{m}.biases": b})
        else:
            packed[k] = v
    model = _altered(llama_dir, tmp_path, weights=packed)
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))
    line = _one_error(["generate", str(model), "-p", "hi", "-m", "1"], capsys)
    assert line.endswith(
        f"tensor {name} has shape [48, 64] (4-bit, unpacked), but config.json "
        "makes it [64, 64]"
    ), line


# --- what will be slow is said before it is (estimate.py) --------------------

SLOW = re.compile(
    r"about (?:\d+ (?:s|min)|[\d.]+ h)"  # the time left, rounded for a person
    r" more at this pace \((?P<piece>.+) took [\d.]+ s; (?P<left>[\d.]+) more "
    r"like it to go\)"
)


def _slow_lines(text: str, prefix: str):
    return [
        (line, SLOW.search(line))
        for line in text.splitlines()
        if "more at this pace" in line and line.startswith(prefix)
    ]


@pytest.fixture(params=["0", "1e9"], ids=["threshold 0", "threshold high"])
def threshold(request, monkeypatch):
    """estimate.SLOW_S lowered to 0 (every estimate said) or raised out of reach."""
    from flashnorm_mlx import estimate

    monkeypatch.setenv(estimate.SLOW_ENV, request.param)
    return float(request.param)


def _check(lines, threshold, piece, left):
    if threshold > 0:
        assert lines == [], lines
        return
    assert len(lines) == 1, lines
    line, m = lines[0]
    assert m is not None, line
    # left=None: priced from measured times (bench), any amount more than 0
    ok = float(m["left"]) > 0 if left is None else float(m["left"]) == left
    assert m["piece"] == piece and ok, line


def test_bench_says_how_long_after_its_first_generation(llama_dir, threshold, capsys):
    argv = ["bench", str(llama_dir), "-p", "8", "-g", "4", "-n", "2"]
    assert main([*argv, "--variants", "stock,flashnorm"]) == 0
    err = capsys.readouterr().err
    # After the first warm-up: the other's, 2 rounds of 2 variants and each
    # variant's host pass, priced from the first warm-up's parts (timing.passes_left).
    lines = _slow_lines(err, "flashnorm-mlx bench: about ")
    _check(lines, threshold, "the warm-up of stock", None)


def test_perplexity_says_how_long_after_its_first_batch(llama_dir, threshold, capsys):
    argv = ["perplexity", str(llama_dir), "--seq-len", "16", "--num-seqs", "6"]
    assert main([*argv, "-b", "4"]) == 0
    err = capsys.readouterr().err
    # 6 windows in batches of 4: 2 batches per side, 3 left after the first.
    lines = _slow_lines(err, "flashnorm-mlx perplexity: about ")
    _check(lines, threshold, "a batch of 4 windows of 16 tokens", 3)


def test_compare_says_how_long_after_its_first_variant(
    llama_dir, threshold, monkeypatch, capsys
):
    from flashnorm_mlx.loading.rows import NAMES

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/compare\n/quit\n"))
    assert main(["chat", str(llama_dir), "-m", "4"]) == 0
    out = capsys.readouterr().out
    lines = _slow_lines(out, "/compare: about ")
    _check(lines, threshold, f"{NAMES[0]}'s turn", len(NAMES) - 1)
    assert "decode tok/s, last reply regenerated" in out  # and then it ran


needs_cpu = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="GPTQ's estimate is the CPU's alone"
)


@needs_cpu
def test_gptq_on_the_cpu_names_rtn_after_its_first_calibration_batch(
    llama_dir, threshold, tmp_path, capsys
):
    argv = ["convert", str(llama_dir), "-q", "--q-group-size", "32"]
    gptq_argv = [*argv, "--q-method", "gptq", "--calib-seqs", "8"]
    assert main([*gptq_argv, "-o", str(tmp_path / "gptq")]) == 0
    err = capsys.readouterr().err
    prefix = "flashnorm-mlx convert: GPTQ on the CPU, calibrating: about "
    lines = _slow_lines(err, prefix)
    # Calibration runs 4 windows a batch: 1 batch left of 2.
    _check(lines, threshold, "the first 4 calibration windows", 1)
    if lines:  # what it measured, what comes after, and the fast choice
        assert lines[0][0].endswith(
            "to go); then every layer; --q-method rtn is the fast choice "
            "(round-to-nearest: seconds, less exact)"
        ), lines
    argv = [*argv, "-o", str(tmp_path / "rtn"), "--q-method", "rtn"]
    assert main(argv) == 0
    assert "more at this pace" not in capsys.readouterr().err  # RTN: no estimate


@needs_cpu
def test_gptq_says_it_after_the_first_layer_group_where_calibration_is_one_batch(
    llama_dir, monkeypatch
):
    from flashnorm_mlx import estimate
    from flashnorm_mlx.loading import read_source, recipe
    from flashnorm_mlx.quant import gptq

    monkeypatch.setenv(estimate.SLOW_ENV, "0")
    said = []
    source = read_source(str(llama_dir))
    recipe.fold_checkpoint(
        source,
        dict(source.weights),
        quantize=(4, 32),
        q_method="gptq",
        calibration=gptq.Calibration(num_seqs=4, seq_len=32),
        on_slow=said.append,
    )
    assert len(said) == 1, said
    m = SLOW.search(said[0])
    # 2 layers, then the embeddings and head: 2 groups left after the first.
    assert said[0].startswith("GPTQ on the CPU: about ") and m, said
    assert m["piece"] == "layer group 1" and float(m["left"]) == 2, said


# --- each command's --help: what it does, the long explanations in convert's ---


def _help_page(command, capsys):
    assert main([command, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone


def _words(text):
    return " ".join(text.split())


def test_each_help_says_what_its_command_does_and_points_to_convert(capsys):
    from flashnorm_mlx.cli import COMMANDS
    from flashnorm_mlx.cli.flags import QUANTIZED_FLAGS, QUANTIZED_POINTER

    descriptions = {}
    for command, (module, _) in COMMANDS.items():
        parser = __import__(
            f"flashnorm_mlx.cli.{module}", fromlist=["x"]
        ).setup_arg_parser()
        page = _help_page(command, capsys)
        descriptions[command] = _words(parser.description or "")
        assert len(descriptions[command]) >= 40, (command, parser.description)
        assert descriptions[command] in page, command
        long_texts = [_words(text) for _, text in QUANTIZED_FLAGS.values()]
        if command == "convert":  # the one place they are explained in full
            assert all(t in page for t in long_texts), page
            continue
        assert not any(t in page for t in long_texts), (command, page)
        assert _words(QUANTIZED_POINTER) in page, (command, page)
        assert len(page) < 8000, (command, len(page))
    assert len(set(descriptions.values())) == len(descriptions), descriptions


def test_the_default_way_for_a_quantized_source_shows_as_the_default(capsys):
    page = _help_page("generate", capsys)
    assert "file holds them (default)" in page, page
    assert "more memory (default: off)" in page, page  # not 'on': one of three ways
