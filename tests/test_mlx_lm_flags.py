"""The adapter, template and prompt-cache flags of mlx-lm's commands (issue 35
items 3-5): each accepted by the commands named, with mlx-lm's own default,
read from mlx-lm's parsers (the reference)."""

import argparse
import importlib
import io

import pytest

# flashnorm-mlx command -> (mlx-lm module whose parser sets the default, flags)
FLAGS = {
    "generate": (
        "generate",
        [
            "--adapter-path",
            "--extra-eos-token",
            "--system-prompt",
            "--prefill-response",
            "--chat-template-config",
            "--use-default-chat-template",
            "--prompt-cache-file",
            "--prefill-step-size",
            "--trust-remote-code",
            "--verbose",
        ],
    ),
    # mlx-lm's chat has no --prompt-cache-file: generate's default
    "chat": (
        "chat",
        [
            "--adapter-path",
            "--system-prompt",
            "--prefill-step-size",
            "--trust-remote-code",
        ],
    ),
    "serve": (
        "server",
        [
            "--adapter-path",
            "--chat-template",
            "--use-default-chat-template",
            "--chat-template-args",
            "--trust-remote-code",
            "--prompt-cache-bytes",
            "--log-level",
        ],
    ),
    "verify": ("generate", ["--adapter-path"]),
    "bench": ("generate", ["--adapter-path"]),
    "convert": ("generate", ["--adapter-path"]),
    "cache-prompt": (
        "cache_prompt",
        [
            "--adapter-path",
            "--trust-remote-code",
            "--eos-token",
            "--max-kv-size",
            "--kv-bits",
            "--kv-group-size",
            "--quantized-kv-start",
        ],
    ),
}
EXTRA = {"chat": ("generate", ["--prompt-cache-file"])}


class _Parser(Exception):
    pass


def mlx_lm_parser(module: str) -> argparse.ArgumentParser:
    """mlx-lm's parser of a command; server builds its own inside main()."""
    mod = importlib.import_module(f"mlx_lm.{module}")
    if hasattr(mod, "setup_arg_parser"):
        return mod.setup_arg_parser()
    real = argparse.ArgumentParser.parse_args

    def grab(self, *a, **k):
        raise _Parser(self)

    argparse.ArgumentParser.parse_args = grab
    try:
        mod.main()
    except _Parser as e:
        return e.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"mlx_lm.{module}.main() built no parser")


def ours(command: str) -> argparse.ArgumentParser:
    from flashnorm_mlx.cli import COMMANDS

    return importlib.import_module(
        f"flashnorm_mlx.cli.{COMMANDS[command][0]}"
    ).setup_arg_parser()


def _action(parser, flag):
    return next((a for a in parser._actions if flag in a.option_strings), None)


def _default(parser, flag):
    """The value a run without the flag gets (a string default goes through type)."""
    a = _action(parser, flag)
    d = a.default
    if isinstance(d, str) and a.type is not None and callable(a.type):
        d = a.type(d)
    return list(d) if isinstance(d, tuple) else d


CASES = [(c, m, f) for c, (m, fs) in {**FLAGS}.items() for f in fs] + [
    (c, m, f) for c, (m, fs) in EXTRA.items() for f in fs
]


@pytest.mark.parametrize("command, module, flag", CASES)
def test_flag_is_accepted_with_mlx_lm_s_default(command, module, flag):
    p, ref = ours(command), mlx_lm_parser(module)
    mine, theirs = _action(p, flag), _action(ref, flag)
    assert mine is not None, f"{command} lacks {flag}"
    assert theirs is not None, f"mlx_lm.{module} has no {flag}"
    got, want = _default(p, flag), _default(ref, flag)
    print(f"{command} {flag}: ours {got!r}, mlx-lm {want!r}")
    assert got == want
    assert mine.dest == theirs.dest and mine.nargs == theirs.nargs


# A value for each flag, parsed as mlx-lm parses it.
VALUES = {
    "--adapter-path": (["a"], "a"),
    "--extra-eos-token": (["x", "y"], ["x", "y"]),
    "--system-prompt": (["s"], "s"),
    "--prefill-response": (["r"], "r"),
    "--chat-template-config": (['{"k": 1}'], {"k": 1}),
    "--use-default-chat-template": ([], True),
    "--prompt-cache-file": (["f"], "f"),
    "--chat-template": (["{{ x }}"], "{{ x }}"),
    "--chat-template-args": (
        ['{"enable_thinking": false}'],
        {"enable_thinking": False},
    ),
    "--prefill-step-size": (["256"], 256),
    "--trust-remote-code": ([], True),
    "--prompt-cache-bytes": (["4GB"], 4 * 10**9),
    "--log-level": (["DEBUG"], "DEBUG"),
    "--verbose": (["F"], False),
    "--eos-token": (["<|im_end|>"], "<|im_end|>"),
    "--max-kv-size": (["64"], 64),
    "--kv-bits": (["4"], 4),
    "--kv-group-size": (["32"], 32),
    "--quantized-kv-start": (["0"], 0),
}


@pytest.mark.parametrize("command, module, flag", CASES)
def test_flag_takes_a_value_as_mlx_lm_does(
    command, module, flag, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the adapter folder and cache file exist
    (tmp_path / "a").mkdir()
    (tmp_path / "f").write_bytes(b"")
    argv, want = VALUES[flag]
    extra = ["-o", "out"] if command == "convert" else []
    if command == "cache-prompt":
        extra = ["-p", "x", "-o", "out"]
    args = ours(command).parse_args([flag, *argv, *extra])
    got = getattr(args, _action(ours(command), flag).dest)
    assert (list(got) if isinstance(got, tuple) else got) == want


@pytest.mark.parametrize(
    "size, want", [("4GB", 4 * 10**9), ("1.5G", 15 * 10**8), ("500M", 5 * 10**8)]
)
def test_byte_sizes_read_as_mlx_lm_reads_them(size, want):
    from mlx_lm.utils import _parse_size

    from flashnorm_mlx.limits import byte_size

    assert byte_size(size) == _parse_size(size) == want


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--prompt-cache-bytes", "4TB"], "not a size"),
        (["--prompt-cache-bytes", "0"], "at least 1 byte"),
        (["--log-level", "loud"], "invalid choice"),
    ],
)
def test_bad_serve_flags_are_one_line_and_exit_2(argv, words, capsys):
    from flashnorm_mlx.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and argv[0] in err[0], err


@pytest.mark.parametrize("flag", ["--chat-template-config", "--chat-template-args"])
@pytest.mark.parametrize("value", ["{bad", "[1]"])
def test_bad_template_json_is_one_line_and_exit_2(flag, value, capsys):
    from flashnorm_mlx.cli import main

    command = "serve" if flag == "--chat-template-args" else "generate"
    assert main([command, flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


@pytest.mark.parametrize(
    "flag, words",
    [
        ("--adapter-path", "no such adapter folder"),
        ("--prompt-cache-file", "no such file"),
    ],
)
def test_missing_path_is_one_line_and_exit_2(flag, words, tmp_path, capsys):
    from flashnorm_mlx.cli import main

    assert main(["generate", flag, str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


# --- what --trust-remote-code and --prefill-step-size do ----------------------


@pytest.fixture(scope="module")
def own_code(tmp_path_factory):
    """A tiny Llama whose tokenizer class lives in the folder's own Python file
    (transformers' auto_map), so it loads only where that code is trusted."""
    import json

    import tiny

    path = tiny.make_llama(tmp_path_factory.mktemp("own-code"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "shouting.ShoutingTokenizerFast"]}
    config["tokenizer_class"] = "ShoutingTokenizerFast"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "shouting.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class ShoutingTokenizerFast(PreTrainedTokenizerFast):\n"
        "    def decode(self, *a, **k):\n"
        "        return super().decode(*a, **k).upper()\n"
    )
    return path


def test_trust_remote_code_loads_the_folders_own_tokenizer(own_code):
    from flashnorm_mlx.loading import read_source

    tok = read_source(str(own_code), trust_remote_code=True).tokenizer
    assert type(tok._tokenizer).__name__ == "ShoutingTokenizerFast"
    assert tok.decode(tok.encode("hello")) == "HELLO"


@pytest.mark.parametrize("command", ["generate", "chat", "cache-prompt"])
def test_each_command_trusts_only_with_the_flag(
    own_code, command, tmp_path, monkeypatch, capsys
):
    from flashnorm_mlx.cli import main

    argv = [command, str(own_code), "--dtype", "float32"]
    argv += {
        "generate": ["-p", "hi", "-m", "2"],
        "chat": ["-m", "2"],
        "cache-prompt": ["-p", "hi", "-o", str(tmp_path / "c.safetensors")],
    }[command]
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/quit\n"))
    assert main([*argv, "--trust-remote-code"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    if command == "cache-prompt":
        (tmp_path / "c.safetensors").unlink()
    assert main(argv) == 1  # untrusted: transformers refuses, in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trust-remote-code" in err[0], err


def test_serve_trusts_only_with_the_flag(own_code):
    """The server's tokenizer is the folder's own class (its /tokenizer_info
    names it); without the flag the server does not start, in one line."""
    import subprocess
    import sys

    from serve_process import Server

    server = Server(str(own_code), "--dtype", "float32", "--trust-remote-code")
    try:
        status, info = server.request("GET", "/tokenizer_info")
        assert status == 200 and info["tokenizer_class"] == "ShoutingTokenizerFast"
    finally:
        server.kill()
    cmd = [sys.executable, "-m", "flashnorm_mlx", "serve", str(own_code), "--port", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [l for l in r.stderr.splitlines() if "error" in l]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "--trust-remote-code" in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_prefill_step_size_reaches_the_prefill(command, tmp_path, monkeypatch, capsys):
    """The flag's value is the step mlx-lm's generate_step prefills with, and
    the text is the default's (the reference: the same run without it)."""
    import tiny

    from flashnorm_mlx.cli import main

    generation = importlib.import_module("mlx_lm.generate")  # not mlx_lm.generate()
    seen = []
    real = generation.generate_step

    def spy(*a, **k):
        seen.append(k.get("prefill_step_size"))
        return real(*a, **k)

    monkeypatch.setattr(generation, "generate_step", spy)
    path = tiny.make_llama(tmp_path)
    argv = [command, str(path), "-m", "3", "--dtype", "float32"]
    if command == "generate":
        argv += ["-p", "the quick brown fox jumps over"]

    def run(*flags):
        seen.clear()
        monkeypatch.setattr("sys.stdin", io.StringIO("the quick brown fox\n/quit\n"))
        assert main([*argv, *flags]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out.split("=" * 10)[0]  # generate's stats after
        return [l for l in out.splitlines() if "tok/s" not in l], list(seen)

    text, steps = run("--prefill-step-size", "4")
    default_text, default_steps = run()
    assert text == default_text and "".join(text).strip(), (text, default_text)
    assert steps and set(steps) == {4}, steps
    assert set(default_steps) == {2048}, default_steps


@pytest.mark.parametrize("trust", [False, True])
def test_a_hub_download_fetches_python_files_only_when_trusted(trust, monkeypatch):
    """mlx-lm's hub download (faked: no network here) is asked for the repo's
    Python files with --trust-remote-code, and never without it."""
    import mlx_lm.utils

    from flashnorm_mlx.loading import source

    asked = []
    monkeypatch.setattr(
        mlx_lm.utils,
        "_download",
        lambda repo, allow_patterns: asked.append(allow_patterns),
    )
    source.resolve("org/some-model", trust)
    assert len(asked) == 1 and ("*.py" in asked[0]) == trust, asked


@pytest.mark.parametrize(
    "flag, why",
    [(["--image", "a.png"], "text models only"), (["-qa"], "nvfp4/mxfp8")],
)
def test_image_and_quantize_activations_are_one_line_each(flag, why, capsys):
    """mlx_lm generate's --image and --quantize-activations: taken by name and
    refused in one line saying why, before any model is read."""
    from flashnorm_mlx.cli import main

    try:
        rc = main(["generate", "-p", "hi", *flag])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and why in err[0], (rc, err)
