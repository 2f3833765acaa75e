"""The adapter, template and prompt-cache flags of mlx-lm's commands (issue 35
items 3-5): each accepted by the commands named, with mlx-lm's own default,
read from mlx-lm's parsers (the reference)."""

import argparse
import importlib

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
        ],
    ),
    # mlx-lm's chat has no --prompt-cache-file: generate's default
    "chat": ("chat", ["--adapter-path", "--system-prompt"]),
    "serve": (
        "server",
        [
            "--adapter-path",
            "--chat-template",
            "--use-default-chat-template",
            "--chat-template-args",
        ],
    ),
    "verify": ("generate", ["--adapter-path"]),
    "bench": ("generate", ["--adapter-path"]),
    "convert": ("generate", ["--adapter-path"]),
    "cache-prompt": ("cache_prompt", ["--adapter-path"]),
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
