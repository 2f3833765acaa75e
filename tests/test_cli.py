"""The CLI end to end on tiny models, and its answers to bad input."""

import json
import os
import subprocess
import sys

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
    assert "greedy tokens agreeing" in capsys.readouterr().out


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
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return {
        "missing path": ["verify", str(tmp_path / "nope")],
        "no config.json": ["verify", str(no_config)],
        "corrupt safetensors": ["verify", str(corrupt)],
        "unsupported model_type": ["generate", str(gpt2), "-p", "x"],
        "bad flag": ["generate", str(model_dir), "--max-tokens", "zero"],
        "unknown command": ["frobnicate"],
    }


def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path, model_dir):
    for what, args in _bad_inputs(tmp_path, model_dir).items():
        r = _run(*args)
        err = r.stderr.strip().splitlines()
        assert r.returncode != 0, (what, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, (what, r.stderr)
        assert err and "error" in err[-1], (what, r.stderr)
        if what not in ("bad flag", "unknown command"):  # argparse prints usage too
            assert len(err) == 1, (what, r.stderr)
