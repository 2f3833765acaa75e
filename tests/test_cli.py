"""The CLI end to end on tiny models, and its answers to bad input."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiny

from flashnorm_mlx.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("m"), "gqa_untied")


@pytest.mark.parametrize("mode", ["flashnorm", "stock"])
def test_generate_end_to_end(model_dir, mode, capsys):
    rc = main(["generate", str(model_dir), "-p", "hello", "-m", "6", "--mode", mode])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Generation: 6 tokens" in out, out
    assert "Prompt:" in out and "Peak memory:" in out, out


@pytest.mark.parametrize("mode", ["flashnorm", "stock"])
def test_generate_runs_every_mode_on_the_engine_asked(
    model_dir, mode, capsys, monkeypatch
):
    """--engine (and its aliases --compile/--no-compile) picks how decode steps
    run for either --mode, and the greedy text is the same on both engines."""
    from flashnorm_mlx import engine
    from flashnorm_mlx.cli import common

    built, real = [], common.build_model

    def recording(*a, **k):
        model, config = real(*a, **k)
        built.append(engine.engine_of(model))
        return model, config

    monkeypatch.setattr(common, "build_model", recording)
    texts = {}
    for flags, want in (
        (["--engine", "compiled"], "compiled"),
        (["--engine", "eager"], "eager"),
        (["--compile"], "compiled"),
        (["--no-compile"], "eager"),
    ):
        argv = ["generate", str(model_dir), "-p", "hello", "-m", "12", "--mode", mode]
        assert main([*argv, "--dtype", "float32", *flags]) == 0
        texts[flags[-1]] = capsys.readouterr().out.split("==========")[0]
        assert built[-1] == want, (flags, built)
    assert len(set(texts.values())) == 1, texts


def test_verify_json_end_to_end(model_dir, capsys):
    rc = main(["verify", str(model_dir), "--json", "--dtype", "float32", "-g", "8"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in (
        "max_abs_logit_diff",
        "max_rel_logit_diff",
        "kl",
        "greedy_match",
        "greedy_horizon",
        "dtype",
    ):
        assert key in r, r
    assert r["dtype"] == "float32" and r["greedy_horizon"] == 8, r
    assert r["max_rel_logit_diff"] < 1e-4 and r["greedy_match"] == 8, r


def test_verify_table_end_to_end(model_dir, capsys):
    assert main(["verify", str(model_dir), "-g", "4"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens agreeing" in out
    flat = " ".join(out.split())  # rich wraps at the width: the last words
    verdict = r"PASS: max \|logit diff\| / max \|logit\| \d\.\d+e-\d+ on the same"
    assert re.search(verdict + r" weights \(pass: up to 0\.0001\)$", flat), out


def _run(*args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "flashnorm_mlx", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _bad_inputs(tmp_path, model_dir):
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    corrupt = tiny.make_llama(tmp_path / "corrupt", tokenizer=False)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not safetensors")
    gpt2 = tmp_path / "gpt2"  # a family mlx-lm runs (as stock), its keys missing
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such"}))
    return {
        "missing path": ["verify", str(tmp_path / "nope")],
        "no config.json": ["verify", str(no_config)],
        "corrupt safetensors": ["verify", str(corrupt)],
        "unsupported model_type": ["generate", str(unknown), "-p", "x"],
        "stock family, config keys missing": ["generate", str(gpt2), "-p", "x"],
        "bad flag": ["generate", str(model_dir), "--max-tokens", "zero"],
        "unknown command": ["frobnicate"],
        "negative temperature": ["generate", str(model_dir), "--temp", "-1"],
        "empty prompt": ["generate", str(model_dir), "-p", ""],
        "junk gguf": ["verify", str(_junk_gguf(tmp_path))],
    }


def _junk_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + bytes(range(200)))
    return path


def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path, model_dir):
    for what, args in _bad_inputs(tmp_path, model_dir).items():
        r = _run(*args)
        err = r.stderr.strip().splitlines()
        assert r.returncode != 0, (what, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, (what, r.stderr)
        assert len(err) == 1 and "error" in err[0], (what, r.stderr)


# --- values no command can run with: refused in one line, before any loading ---

NONSENSE = {
    "--temp -1": ["generate", "--temp", "-1"],
    "--temp nan": ["generate", "--temp", "nan"],
    "--top-p 2": ["generate", "--top-p", "2"],
    "--top-p 0": ["chat", "--top-p", "0"],
    "-m 0": ["generate", "-m", "0"],
    "--seed -1": ["generate", "--seed", "-1"],
    "--q-bits without -q": ["generate", "--q-bits", "8"],
    "--q-group-size without -q": ["bench", "--q-group-size", "32"],
    "verify --q-bits without -q": ["verify", "--q-bits", "4"],
    "--max-context 1": ["chat", "--max-context", "1"],
    "verify -g 0": ["verify", "-g", "0"],
    "bench -g 1": ["bench", "-g", "1"],
    "bench -n 0": ["bench", "-n", "0"],
    "bench -p 0": ["bench", "-p", "0"],
    "bench --prefill-step-size 0": ["bench", "--prefill-step-size", "0"],
    "perplexity --seq-len 1": ["perplexity", "--seq-len", "1"],
    "perplexity -b 0": ["perplexity", "-b", "0"],
    "perplexity --num-seqs -1": ["perplexity", "--num-seqs", "-1"],
    "convert --q-bits without -q": ["convert", "-o", "x", "--q-bits", "4"],
    "--top-k -1": ["generate", "--top-k", "-1"],
    "--min-p 2": ["chat", "--min-p", "2"],
    "--min-tokens-to-keep 0": ["generate", "--min-tokens-to-keep", "0"],
    "--xtc-threshold 0.9": ["generate", "--xtc-threshold", "0.9"],
}
EMPTY_PROMPT = {
    "generate -p ''": ["generate", "-p", ""],
    "generate -p '  '": ["generate", "-p", "  "],
    "verify -p ''": ["verify", "-p", ""],
    "convert -o ''": ["convert", "-o", ""],
}


def _refusal(argv, capsys, monkeypatch):
    # The model must never be read: a refusal comes from the flags alone.
    import flashnorm_mlx.cli.common as common
    import flashnorm_mlx.loading as loading
    import flashnorm_mlx.loading.source as source

    def no_read(*a, **k):
        raise AssertionError("the model was read before the flags were checked")

    monkeypatch.setattr(source, "read_source", no_read)
    monkeypatch.setattr(common, "read_source", no_read)  # chat and generate read here
    # The other commands import it from loading once their flags are checked.
    monkeypatch.setattr(loading, "read_source", no_read)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's exit for bad flag values
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err, common


@pytest.mark.parametrize("what", list(NONSENSE) + list(EMPTY_PROMPT))
def test_nonsense_values_are_one_line_before_loading(what, capsys, monkeypatch):
    argv = {**NONSENSE, **EMPTY_PROMPT}[what]
    rc, err, _ = _refusal(argv, capsys, monkeypatch)
    assert rc in (1, 2), (what, rc, err)
    assert len(err) == 1 and "error:" in err[0], (what, err)
    flag = argv[-2] if what in NONSENSE else ""
    assert flag in err[0] or "empty" in err[0], (what, err)


def test_quantization_flags_apply_with_q():
    from flashnorm_mlx.cli import generate
    from flashnorm_mlx.cli.common import model_kwargs

    p = generate.setup_arg_parser()
    assert model_kwargs(p.parse_args(["-q"]))["quantize"] == (4, 64)
    assert model_kwargs(p.parse_args(["-q", "--q-bits", "8"]))["quantize"] == (8, 64)
    assert model_kwargs(p.parse_args([]))["quantize"] is None


OWN_COMMANDS = ["chat", "generate", "verify", "bench", "convert", "perplexity"]


@pytest.mark.parametrize("command", OWN_COMMANDS)
def test_help_has_text_and_default_for_every_flag(command):
    parser = __import__(
        f"flashnorm_mlx.cli.{command}", fromlist=["x"]
    ).setup_arg_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help" or (action.required and action.option_strings):
            continue
        text = formatter._get_help_string(action) or ""
        assert action.help, (command, action.option_strings or action.dest)
        assert "default" in text, (command, action.option_strings, text)
    page = parser.format_help()
    assert "(default: " in page, page


def test_help_through_the_entry_point_shows_defaults():
    r = _run("verify", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "(default: 32)" in text and "(default: 4)" in text, r.stdout


# --- verify says which comparison ran ----------------------------------------


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    """An unfolded 4-bit (group 32) checkpoint, like a quantized hub model."""
    import mlx.core as mx

    cfg = tiny.llama_config("gqa_untied")
    weights, spec = {}, {"group_size": 32, "bits": 4, "mode": "affine"}
    for k, v in tiny.llama_weights(cfg, seed=5).items():
        if v.ndim == 2 and v.shape[-1] % 32 == 0:
            w, s, b = mx.quantize(mx.array(v), group_size=32, bits=4)
            m = k[: -len(".weight")]
            weights.update({k: w, f"{m}.scales": s, f"{m}.biases": b})
        else:
            weights[k] = v
    cfg = {**cfg, "quantization": spec}
    return tiny.write_model(tmp_path_factory.mktemp("q"), cfg, weights, False)


def test_verify_defaults_to_the_stored_weights_and_says_so(quantized_dir, capsys):
    args = ["verify", str(quantized_dir), "--json", "-g", "8", "--dtype", "float32"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["comparison"] == "stored", r
    assert "same quantized weights" in r["comparison_note"], r
    assert r["quantized"] and "reference" not in r, r
    # On the same stored weights FlashNorm is exact: FlashNorm's difference alone.
    assert r["max_rel_logit_diff"] < 1e-4 and r["greedy_match"] == 8, r

    assert main([*args, "--dequantize"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["comparison"] == "float" and "dequantized" in d["comparison_note"], d
    assert not d["quantized"] and d["max_rel_logit_diff"] < 1e-4, d

    assert main([*args, "--requantize"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["comparison"] == "requantized", q
    assert "include quantization" in q["comparison_note"], q
    assert "4-bit group 32" in q["comparison_note"], q
    # Requantizing folded weights really does differ more (it is not FlashNorm).
    assert q["max_rel_logit_diff"] > 10 * r["max_rel_logit_diff"], (q, r)
    # ...so both are also scored against stock float32 on the source's weights.
    assert q["reference_stock_rel_diff"] > 0, q
    assert q["reference_flashnorm_rel_diff"] > 0, q

    assert main(["verify", str(quantized_dir), "-g", "2"]) == 0
    assert "comparison (stored)" in capsys.readouterr().out


def test_verify_in_float16_scores_both_against_stock_float32(
    quantized_dir, tmp_path, capsys
):
    """Two noisy runs compared with each other mislead: float16 FlashNorm and
    float16 stock are each compared with float32 stock on the same weights.
    The checkpoint stores float16 (norms too): float32 norms would promote
    the activations to float32, as mlx-lm's do (tests/test_dtype_rule.py)."""
    import mlx.core as mx

    half = tmp_path / "half"
    shutil.copytree(quantized_dir, half)
    w = mx.load(str(half / "model.safetensors"))
    floats = {k: v.astype(mx.float16) for k, v in w.items() if v.dtype == mx.float32}
    mx.save_safetensors(str(half / "model.safetensors"), {**w, **floats})
    args = ["verify", str(half), "--json", "-g", "4", "--dtype", "float16"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["dtype"] == "float16" and r["comparison"] == "stored", r
    f, s = r["reference_flashnorm_rel_diff"], r["reference_stock_rel_diff"]
    assert 0 < s < 0.05 and 0 < f < 0.05, r
    assert r["flashnorm_within_stock_error"] == (f <= s), r
    assert r["passed"] == (f <= 2 * s) and r["verdict"][:4] in ("PASS", "FAIL"), r
    assert main([a for a in args if a != "--json"]) == (0 if r["passed"] else 1)
    out = capsys.readouterr().out
    assert "against stock mlx-lm in float32 on the source's weights" in out, out
    assert ("within stock's own" in out) == (f <= s), out
    assert " ".join(out.split()).endswith(" ".join(r["verdict"].split())), out


def test_verify_of_a_float_source_says_float(model_dir, capsys):
    assert main(["verify", str(model_dir), "--json", "-g", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["comparison"] == "float" and "not quantized" in r["comparison_note"]
    assert main(["verify", str(model_dir), "--json", "-g", "2", "-q"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["comparison"] == "quantized" and "include quantization" in (
        r["comparison_note"]
    ), r


# --- long commands: a line per stage on stderr when it is not a terminal -------


def test_long_commands_print_stage_lines_when_piped(model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 8)
    runs = {
        "verify": (
            _run("verify", str(model_dir), "-g", "4"),
            ["built stock and FlashNorm", "prefilled", "decode step 4/4"],
        ),
        "bench": (
            _run(
                "bench",
                str(model_dir),
                "-p",
                "4",
                "-g",
                "2",
                "-n",
                "1",
                "--variants",
                "stock,flashnorm",
            ),
            ["building stock: done", "warm-up flashnorm: done", "round 1/1: flashnorm"],
        ),
        "perplexity": (
            _run(
                "perplexity",
                str(model_dir),
                "--data",
                str(text),
                "--seq-len",
                "8",
                "--num-seqs",
                "2",
                "-b",
                "1",
            ),
            ["built stock", "stock: 2/2 windows scored", "flashnorm: 2/2 windows"],
        ),
        "convert": (
            _run("convert", str(model_dir), "-o", str(tmp_path / "out")),
            ["folded 3 layer groups", "wrote 1 file(s)"],
        ),
    }
    for command, (r, wanted) in runs.items():
        assert r.returncode == 0, (command, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert all(l.startswith(f"flashnorm-mlx {command}: ") for l in lines), lines
        for want in wanted:
            assert any(want in l for l in lines), (command, want, lines)


# --- mlx-lm's flags: --model beside MODEL, and mlx-lm's sampler options --------

MODEL_COMMANDS = [*OWN_COMMANDS, "serve"]


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_command_takes_model_as_a_flag_too(command, capsys):
    parser = __import__(
        f"flashnorm_mlx.cli.{command}", fromlist=["x"]
    ).setup_arg_parser()
    extra = ["-o", "x"] if command == "convert" else []
    assert parser.parse_args(["--model", "some/dir", *extra]).model == "some/dir"
    assert parser.parse_args(["some/dir", *extra]).model == "some/dir"
    assert parser.parse_args(extra).model is None
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["a/dir", "--model", "b/dir", *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flashnorm-mlx {command}: error:")
    assert "MODEL given twice" in err[0], err


def test_generate_with_model_flag_end_to_end(model_dir, capsys):
    rc = main(["generate", "--model", str(model_dir), "-p", "hello", "-m", "3"])
    assert rc == 0 and "Generation: 3 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampler_flags_are_mlx_lms_with_its_defaults(command):
    import importlib
    import inspect

    from mlx_lm.sample_utils import make_sampler

    mlx_lm_generate = importlib.import_module("mlx_lm.generate")
    ours = __import__(f"flashnorm_mlx.cli.{command}", fromlist=["x"]).setup_arg_parser()
    ours = {a.dest: a for a in ours._actions}
    sampler_args = set(inspect.signature(make_sampler).parameters)
    theirs = [
        a for a in mlx_lm_generate.setup_arg_parser()._actions if a.dest in sampler_args
    ]
    assert {"top_k", "min_p", "top_p", "temp"} <= {a.dest for a in theirs}
    for a in theirs:
        assert a.dest in ours, (command, a.option_strings)
        assert ours[a.dest].option_strings[-1] == a.option_strings[-1], a.dest
        assert ours[a.dest].default == a.default, (a.dest, a.default)


def test_top_k_1_samples_the_greedy_tokens(model_dir, capsys):
    base = ["generate", str(model_dir), "-p", "hello", "-m", "8"]
    assert main(base) == 0
    greedy = capsys.readouterr().out.split("=" * 10)[0]
    assert main([*base, "--temp", "5", "--top-k", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out.split("=" * 10)[0] == greedy
    assert main([*base, "--temp", "5", "--min-p", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out.split("=" * 10)[0] == greedy


# --- the note on a quantized source: only where it changes what one gets ------


@pytest.mark.parametrize("mode", ["flashnorm", "stock"])
@pytest.mark.parametrize(
    "flags, says",
    [
        ([], None),  # as stored: the file's own function and bytes, nothing to say
        (["--dequantize"], "run in float32 (--dequantize): the file's results, about"),
        (["--requantize"], "rounded again (--requantize): results close to the file"),
        (["-q", "--q-group-size", "32"], "rounded again to 4-bit (-q): results differ"),
    ],
)
def test_a_quantized_source_gets_a_note_only_where_it_changes_things(
    quantized_dir, model_dir, mode, flags, says, capsys
):
    args = ["generate", str(quantized_dir), "--tokenizer", str(model_dir)]
    args += ["-p", "hi", "-m", "1", "--mode", mode, "--dtype", "float32", *flags]
    assert main(args) == 0
    notes = [l for l in capsys.readouterr().err.splitlines() if "note:" in l]
    if says is None:
        assert notes == [], notes
        return
    assert len(notes) == 1 and len(notes[0]) <= 160, notes
    assert notes[0].startswith("flashnorm-mlx: note: the model's 4-bit weights"), notes
    assert says in notes[0], notes
    if flags == ["--dequantize"]:  # 4-bit, float32 scales and biases a 32-group
        assert "about 5x the memory" in notes[0], notes  # 32 / (4 + 64/32) bits


# --- one error convention: a flag's error names the command, exit 2 ----------

FLAG_ERRORS = {
    "generate -p ''": (["generate", "-p", ""], "-p/--prompt is empty"),
    "verify -p ' '": (["verify", "-p", " "], "-p/--prompt is empty"),
    "bench unknown variant": (["bench", "--variants", "stock,foo"], "'foo'"),
    "bench repeated variant": (
        ["bench", "--variants", "stock,stock"],
        "--variants: stock is named twice",
    ),
    "bench --json folder": (["bench", "--json", "/no/such/x.json"], "--json"),
    "convert -o ''": (["convert", "-o", ""], "-o/--output is empty"),
    "convert --calib-seqs 0": (["convert", "-o", "x", "--calib-seqs", "0"], "calib"),
    "perplexity --data": (["perplexity", "--data", "/no/such.txt"], "--data"),
    # serve's own flag rules (flags.VALUE_RULES), before MLX loads.
    "serve --port": (["serve", "--port", "70000"], "--port must be from 0 to 65535"),
    "serve --max-connections-per-client": (
        ["serve", "--max-connections-per-client", "0"],
        "--max-connections-per-client must be at least 1",
    ),
    "serve --request-timeout": (
        ["serve", "--request-timeout", "0"],
        "--request-timeout must be more than 0",
    ),
    "serve --allowed-hosts": (
        ["serve", "--allowed-hosts", " , "],
        "--allowed-hosts must be one name or more",
    ),
    "serve --prefill-step-size": (
        ["serve", "--prefill-step-size", "0"],
        "--prefill-step-size must be at least 1",
    ),
    "serve --api-key": (["serve", "--api-key", " "], "must not be empty"),
}


@pytest.mark.parametrize("what", list(FLAG_ERRORS))
def test_flag_errors_name_the_command_and_exit_2(what, capsys, monkeypatch):
    argv, says = FLAG_ERRORS[what]
    rc, err, _ = _refusal(argv, capsys, monkeypatch)
    assert rc == 2, (what, rc, err)
    assert len(err) == 1 and err[0].startswith(f"flashnorm-mlx {argv[0]}: error:")
    assert says in err[0], (what, err)


# --- a bad flag is refused before MLX and mlx-lm load (seconds) ----------------

BAD_FLAGS = [
    ["generate", "--temp", "abc"],
    ["chat", "--top-p", "2"],
    ["bench", "-n", "x"],
    ["convert"],  # -o/--output is required
    ["verify", "-g", "0"],
    ["perplexity", "--data", "/no/such.txt"],
    ["serve", "--port", "abc"],
]


@pytest.mark.parametrize("argv", BAD_FLAGS, ids=" ".join)
def test_a_bad_flag_is_refused_without_importing_mlx(argv):
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flashnorm_mlx", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    timed = [l for l in r.stderr.splitlines() if l.startswith("import time:")]
    imported = [l.rsplit("|", 1)[-1].strip() for l in timed]
    heavy = [m for m in imported if m.split(".")[0] in ("mlx", "mlx_lm")]
    lines = [l for l in r.stderr.splitlines() if l not in timed]
    assert r.returncode == 2, (r.returncode, lines)
    assert len(lines) == 1 and lines[0].startswith(f"flashnorm-mlx {argv[0]}: error:")
    assert "flashnorm_mlx.cli.flags" in imported and not heavy, heavy


def test_the_flags_offer_the_librarys_names():
    """cli/flags.py copies the names its flags offer from modules that import
    MLX: each copy is the library's own."""
    import dataclasses

    from flashnorm_mlx import engine, loading, quant
    from flashnorm_mlx.cli import flags, mlx_lm_flags, serve
    from flashnorm_mlx.loading import rows
    from flashnorm_mlx.quant import gptq
    from flashnorm_mlx.serve import API_KEY_ENV, Settings

    assert flags.DTYPE_NAMES == tuple(loading.DTYPES)
    assert flags.RUN_MODES == loading.RUN_MODES
    assert flags.ENGINES == engine.ENGINES
    assert flags.VARIANT_NAMES == rows.NAMES
    assert (flags.Q_METHODS, flags.DEFAULT_Q_METHOD) == (
        gptq.METHODS,
        gptq.DEFAULT_METHOD,
    )
    calibration = gptq.Calibration()
    assert (flags.CALIB_SEQS, flags.CALIB_LEN) == (
        calibration.num_seqs,
        calibration.seq_len,
    )
    assert flags.API_KEY_ENV == API_KEY_ENV
    assert tuple(flags.QUANTIZED_FLAGS) == quant.QUANTIZED_WAYS
    held = {f.name for f in dataclasses.fields(Settings)}
    sampler = mlx_lm_flags.SAMPLER_FLAGS
    assert serve.SETTINGS_SAMPLER == tuple(d for d in sampler if d in held)


def test_no_command_is_usage_on_stderr_and_exit_2(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: flashnorm-mlx COMMAND"), err
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: flashnorm-mlx COMMAND")


# --- help that says what is true today ----------------------------------------


def test_top_level_help_names_every_architecture(capsys):
    from flashnorm_mlx.models import ARCHITECTURES

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split()).lower()
    for model_type in ARCHITECTURES:
        assert model_type in text, (model_type, text)


def test_the_family_lists_are_the_registrys():
    """models.ARCHITECTURES is the one list of covered families: the README's
    first paragraph counts it and its table lists exactly it, and commands.md's
    "Other families" names exactly it (the help: the test above). Adding a
    family is its registry line, then what this test asks of the docs."""
    import re

    from flashnorm_mlx.models import ARCHITECTURES

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    first = " ".join(readme.split("\n\n")[1].split())
    count = re.search(r"for (\d+) model types", first)
    assert count and int(count[1]) == len(ARCHITECTURES), (first, len(ARCHITECTURES))
    table = readme.split("### Supported architectures")[1].split("\n\n")[1]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    in_table = [t for cell in rows for t in re.findall(r"`([a-z0-9_]+)`", cell)]
    assert sorted(in_table) == sorted(ARCHITECTURES), sorted(
        set(in_table) ^ set(ARCHITECTURES)
    )
    other = (root / "docs" / "commands.md").read_text().split("## Other families")[1]
    covers = other.split("FlashNorm covers")[1].split("(the README's table)")[0]
    named = re.findall(r"`([a-z0-9_]+)`", covers)
    assert sorted(named) == sorted(ARCHITECTURES), sorted(
        set(named) ^ set(ARCHITECTURES)
    )


def test_serve_help_names_its_apis_and_the_kv_note_names_llama(capsys):
    """The top-level help names every POST API serve answers (serve/routes.py,
    serve/http.py), and commands.md's --max-kv-size note names Llama, whose
    mlx-lm class has its own make_cache (so mlx-lm ignores the flag there)."""
    from mlx_lm.models import llama

    assert main(["--help"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "serve" in x)
    for api in ("chat completions", "completions", "responses", "messages"):
        assert api in line, line
    assert hasattr(llama.Model, "make_cache")
    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "commands.md").read_text()
    note = " ".join(doc.split("One difference from mlx-lm")[1].split("\n\n")[0].split())
    assert "(Llama, Gemma 3" in note, note


def test_chat_help_names_every_compare_variant():
    from flashnorm_mlx.cli import chat
    from flashnorm_mlx.loading.rows import NAMES

    page = " ".join(chat.HELP.split())
    for variant in NAMES:
        assert variant in page, (variant, chat.HELP)


def test_a_required_flag_shows_no_default():
    from flashnorm_mlx.cli import convert

    parser = convert.setup_arg_parser()
    action = next(a for a in parser._actions if a.dest == "output")
    text = parser._get_formatter()._get_help_string(action)
    assert "default" not in text and "(required)" in text, text


def test_serve_takes_the_sampler_defaults_its_settings_hold():
    import dataclasses

    from flashnorm_mlx.cli import serve
    from flashnorm_mlx.serve import Settings

    held = {f.name for f in dataclasses.fields(Settings)}
    args = serve.setup_arg_parser().parse_args(["--top-p", "0.9"])
    for dest in serve._sampler_defaults():
        assert dest in held and hasattr(args, dest), dest
    assert args.top_p == 0.9
    if "top_k" in held:  # mlx_lm.server's --top-k and --min-p, as defaults
        args = serve.setup_arg_parser().parse_args(["--top-k", "5", "--min-p", "0.1"])
        assert (args.top_k, args.min_p) == (5, 0.1)
