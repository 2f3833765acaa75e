"""mlx-lm's habits answered as mlx-lm answers them (issue 46 item 1): seeded
sampling, --verbose, cache-prompt's KV flags and --eos-token.

The reference is mlx-lm's own command on the same float32 folder, run as a
subprocess (`python -m mlx_lm generate`), never our own output."""

import functools
import subprocess
import sys

import pytest
import tiny

from flashnorm_mlx.cli import main


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A float32 tiny Llama (norm gains far from 1), head_dim 32: the KV
    quantization groups (32) divide it."""
    cfg = {
        **tiny.llama_config("gqa_untied"),
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    path = tmp_path_factory.mktemp("habits") / "m"
    return tiny.write_model(path, cfg, tiny.llama_weights(cfg, 3))


@functools.cache
def mlx_lm(*argv, cwd=None) -> str:
    """`mlx_lm generate ... --verbose False`'s reply (its stdout); a process
    (~1.3 s of CPU) for each argv, which two tests may ask for alike (its reply
    is the same for both --mode values)."""
    r = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", *argv, "--verbose", "False"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def ours(capsys, *argv) -> str:
    rc = main(["generate", *argv, "--verbose", "False"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


SAMPLING = ["--temp", "0.8", "--seed", "42", "-m", "32", "-p", "Hello"]


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    import mlx.core as mx
    from test_adapters import make_adapter

    # make_adapter draws lora_a before it seeds: seeded here, so the adapter
    # is the same whatever ran before. Our build fuses it into the weights and
    # mlx-lm runs LoRA layers, which round apart: an adapter that puts two
    # tokens within rounding of a tie can flip one draw (seed 46 does: "\r" for
    # "\n" as the first token, the rest alike).
    mx.random.seed(0)
    return make_adapter(model, tmp_path_factory.mktemp("habits") / "adapter")


@pytest.mark.parametrize("adapted", [False, True])
@pytest.mark.parametrize("mode", ["stock", "flashnorm"])
def test_a_seed_samples_mlx_lms_reply(model, adapter, mode, adapted, capsys):
    """mlx-lm seeds before it builds, and its build (LoRA layers included)
    draws from the generator: the same seed samples the same 32 tokens here,
    in both modes (float32), with and without --adapter-path."""
    extra = ["--adapter-path", str(adapter)] if adapted else []
    want = mlx_lm("--model", str(model), *SAMPLING, *extra)
    got = ours(capsys, str(model), "--mode", mode, *SAMPLING, *extra)
    print(f"mlx-lm: {want!r}\nours ({mode}): {got!r}")
    assert got == want
    other = ours(
        capsys, str(model), "--mode", mode, *SAMPLING[:3], "43", *SAMPLING[4:], *extra
    )
    assert other != want, "another seed sampled the same reply: the test sees nothing"


@pytest.mark.parametrize("value", ["False", "f", "FALSE", "F"])
def test_verbose_false_prints_the_reply_alone(model, value, capsys):
    rc = main(["generate", str(model), "-m", "4", "--verbose", value])
    out = capsys.readouterr().out
    assert rc == 0
    assert "=" * 10 not in out and "tokens-per-sec" not in out, out
    assert out.endswith("\n") and out.strip(), out


@pytest.mark.parametrize("value", ["True", "T", "yes", "1", "false", "no"])
def test_verbose_values_read_as_mlx_lm_reads_them(value):
    import importlib

    theirs = importlib.import_module("mlx_lm.generate").setup_arg_parser()
    mine = importlib.import_module("flashnorm_mlx.cli.generate").setup_arg_parser()
    want = theirs.parse_args(["--verbose", value]).verbose
    got = mine.parse_args(["--verbose", value]).verbose
    assert got == want, (value, got, want)


# --- cache-prompt's KV flags and --eos-token -----------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog, twice"


def cache_prompt(capsys, model, out, *flags) -> None:
    argv = ["cache-prompt", str(model), "--mode", "stock", "-p", PROMPT, "-o"]
    rc = main([*argv, str(out), *flags])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()


def from_file(capsys, model, path, *flags, reference=True):
    """(ours, mlx-lm's) greedy reply to a follow-up on the cached prompt; ours
    alone where `reference` is False (a test that needs no mlx-lm process)."""
    argv = ["--prompt-cache-file", str(path), "-p", "and again", "-m", "12", *flags]
    got = ours(capsys, str(model), "--mode", "stock", *argv)
    if not reference:
        return got
    want = mlx_lm("--model", str(model), *argv)
    print(f"mlx-lm: {want!r}\nours: {got!r}")
    return got, want


def held(path):
    from mlx_lm.models.cache import load_prompt_cache

    return load_prompt_cache(str(path), return_metadata=True)


KV_FILES = {
    "quantized": (
        ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0"],
        "QuantizedKVCache",
        ["--kv-group-size", "32"],
    ),
    "rotating": (["--max-kv-size", "16"], "RotatingKVCache", []),
}


@pytest.mark.parametrize("case", list(KV_FILES))
def test_cache_prompt_kv_flags_make_mlx_lms_cache(model, case, tmp_path, capsys):
    """The file holds the cache mlx-lm's cache_prompt makes with the flags
    (quantized, or rotating), and generate --prompt-cache-file answers from it
    as mlx-lm's generate does from the same file."""
    flags, kind, use = KV_FILES[case]
    path = tmp_path / "c.safetensors"
    cache_prompt(capsys, model, path, *flags)
    cache, _ = held(path)
    assert [type(c).__name__ for c in cache] == [kind] * len(cache)
    got, want = from_file(capsys, model, path, *use)
    assert got == want
    plain = tmp_path / "plain.safetensors"
    cache_prompt(capsys, model, plain)
    other = from_file(capsys, model, plain, reference=False)
    assert other != got, "the flags changed nothing"


def test_a_quantized_file_with_other_kv_flags_is_one_line(model, tmp_path, capsys):
    path = tmp_path / "c.safetensors"
    cache_prompt(capsys, model, path, *KV_FILES["quantized"][0])
    capsys.readouterr()
    argv = ["generate", str(model), "--mode", "stock", "--prompt-cache-file"]
    argv += [str(path), "-p", "x", "-m", "2"]
    for flags, word in (
        (["--kv-bits", "8", "--kv-group-size", "32"], "--kv-bits"),
        ([], "--kv-group-size"),  # mlx-lm's default 64, the file's 32
    ):
        rc = main([*argv, *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc != 0 and len(err) == 1 and word in err[0], err


def test_cache_prompt_eos_token_stops_generate_as_mlx_lm(model, tmp_path, capsys):
    """--eos-token is kept in the file's tokenizer_config (mlx-lm's key), and
    generate from the file stops at it, as mlx-lm's generate does."""
    plain = tmp_path / "plain.safetensors"
    cache_prompt(capsys, model, plain)
    text = from_file(capsys, model, plain, reference=False)
    # An ASCII character is its own byte-level token; one past the first token.
    ok = [c for c in text if c.isascii() and c.isprintable() and not c.isspace()]
    stop = next((c for c in ok if text.index(c) >= 1), None)
    assert stop is not None, f"no ASCII token to stop at in {text!r}"
    path = tmp_path / "eos.safetensors"
    cache_prompt(capsys, model, path, "--eos-token", stop)
    _, meta = held(path)
    assert meta["tokenizer_config"] == '{"eos_token": "%s"}' % stop
    got, want = from_file(capsys, model, path)
    assert got == want
    assert got.rstrip("\n") == text[: text.index(stop)], (got, text, stop)


def test_cache_prompt_eos_token_not_a_token_is_one_line(model, tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    argv = ["cache-prompt", str(model), "-p", "x", "-o", str(out)]
    rc = main([*argv, "--eos-token", "<nope>"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "<nope>" in err[0], err
    assert not out.exists()
