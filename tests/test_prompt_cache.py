"""Prompt-cache files: `cache-prompt`, then `generate`/`chat --prompt-cache-file`.

The reference is the same command on the whole prompt, without a file; a file
made by mlx-lm's own cache_prompt runs in either mode, and the reference is
then mlx-lm's own generate from that file.
"""

import io
import re
import sys

import mlx.core as mx
import pytest
import tiny

from flashnorm_mlx.cli import main

PREFIX, QUERY = "Once upon a time, in a far land, ", "a dragon said"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return tiny.make_llama(path, "gqa_untied")
    return tiny.make_qwen(path, "qwen3_untied")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("m"), "gqa_untied")


def _generate(capsys, *argv) -> str:
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out.split("\n==========")[0]


def _cache(capsys, model_dir, f, *flags, prompt=PREFIX):
    argv = ["cache-prompt", str(model_dir), *flags, "-p", prompt, "-o", str(f)]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "prompt tokens cached" in out, out
    return f


def _one_line_refusal(capsys, argv) -> str:
    rc = main(argv)
    _, err = capsys.readouterr()
    # The build's own notes (float16 is slow on a CPU) may come first.
    lines = [l for l in err.strip().splitlines() if "flashnorm-mlx: note:" not in l]
    assert rc != 0 and len(lines) == 1, (rc, lines)
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("mode", ["flashnorm", "stock"])
def test_cached_prompt_gives_the_whole_prompt_s_text(model_dir, tmp_path, capsys, mode):
    run = [str(model_dir), "--mode", mode, "--dtype", "float32", "-m", "24"]
    f = _cache(capsys, model_dir, tmp_path / "p.safetensors", *run[1:5])
    cached = _generate(capsys, *run, "-p", QUERY, "--prompt-cache-file", str(f))
    whole = _generate(capsys, *run, "-p", PREFIX + QUERY)
    alone = _generate(capsys, *run, "-p", QUERY)
    print(f"cached {cached!r}\nwhole  {whole!r}\nquery alone {alone!r}")
    assert cached == whole
    assert alone != whole  # the cached prefix matters to the text


def test_flashnorm_caches_hold_stock_s_keys_and_values(model_dir):
    """Why a file could cross modes and still is refused: FlashNorm's K and V
    equal stock's up to float32 rounding (docs/design.md sections 2a, 2d)."""
    from mlx_lm.models.cache import make_prompt_cache

    from flashnorm_mlx.loading import build_model, read_source
    from flashnorm_mlx.modes import FLASHNORM, STOCK

    source = read_source(str(model_dir))
    ids = mx.array([list(range(3, 40))])
    caches = {}
    for mode in (STOCK, FLASHNORM):
        model, _ = build_model(source, mode, dtype=mx.float32)
        caches[mode.name] = make_prompt_cache(model)
        model(ids, cache=caches[mode.name])
    worst = 0.0
    for s, f in zip(caches["stock"], caches["flashnorm"]):
        for a, b in ((s.keys, f.keys), (s.values, f.values)):
            a, b = a[..., : s.offset, :], b[..., : f.offset, :]
            assert a.shape == b.shape
            worst = max(worst, (mx.abs(a - b).max() / mx.abs(a).max()).item())
    print(f"max relative K/V difference, FlashNorm vs stock: {worst:.2e}")
    assert 0 < worst < tiny.f32_tol(1e-5)


def _mlx_lm_file(model, f, monkeypatch, capsys):
    """mlx-lm's own cache_prompt of PREFIX on `model` into `f`."""
    from mlx_lm import cache_prompt

    argv = ["cache_prompt", "--model", str(model), "--prompt", PREFIX]
    monkeypatch.setattr(sys, "argv", [*argv, "--prompt-cache-file", str(f)])
    cache_prompt.main()
    capsys.readouterr()
    return f


def test_mlx_lm_s_own_cache_file_continues_as_mlx_lm_s_generate(
    llama, tmp_path, capsys, monkeypatch
):
    """Issue 60 item 7: an mlx-lm cache file holds stock's K and V, which
    FlashNorm caches too, so it runs in the default mode (and in stock): the
    reply is `mlx_lm generate --prompt-cache-file`'s from the same file."""
    from test_mlx_lm_habits import mlx_lm

    f = _mlx_lm_file(llama, tmp_path / "mlx_lm.safetensors", monkeypatch, capsys)
    use = ["-p", QUERY, "--prompt-cache-file", str(f), "-m", "24", "--temp", "0"]
    want = mlx_lm("--model", str(llama), *use)
    got = {}
    for mode, flags in (("default", []), ("stock", ["--mode", "stock"])):
        rc = main(["generate", str(llama), *flags, *use, "--verbose", "False"])
        got[mode], err = capsys.readouterr()
        assert rc == 0, err
    print(f"mlx-lm: {want!r}\nours: {got}")
    assert got == {"default": want, "stock": want}


def test_an_mlx_lm_file_with_recurrent_layers_asks_for_stock(tmp_path):
    """Where a layer holds recurrent state (LFM2's convolutions), FlashNorm
    does not take an mlx-lm file: one line naming --mode stock."""
    from flashnorm_mlx import load, prompt_cache
    from flashnorm_mlx.loading import LoadError
    from flashnorm_mlx.modes import FLASHNORM

    model, _ = load(str(tiny.make_lfm2(tmp_path / "lfm2")), dtype=mx.float32)
    with pytest.raises(LoadError) as e:
        prompt_cache.fit("f.safetensors", [], {"model": "m"}, model, FLASHNORM)
    line = str(e.value)
    print(line)
    assert "recurrent state" in line and "--mode stock" in line, line
    assert "\n" not in line


def test_mismatched_files_are_one_line(llama, tmp_path, capsys):
    f = _cache(capsys, llama, tmp_path / "p.safetensors", "--dtype", "float32")
    other = tiny.make_llama(tmp_path / "other", "gqa_untied", seed=3)
    use = ["-p", QUERY, "-m", "2", "--prompt-cache-file", str(f)]
    cases = {
        "another model": [str(other), "--dtype", "float32"],
        "--mode flashnorm; this run has --mode stock": [
            str(llama),
            "--mode",
            "stock",
            "--dtype",
            "float32",
        ],
        "float32 weights; this run has float16": [str(llama), "--dtype", "float16"],
        "float32, 8-bit group 64": [
            str(llama),
            "--dtype",
            "float32",
            "-q",
            "--q-bits",
            "8",
        ],
    }
    for words, run in cases.items():
        line = _one_line_refusal(capsys, ["generate", *run, *use])
        assert words in line, (words, line)


@pytest.mark.parametrize(
    "damage", ["junk", "truncated", "not a cache", "empty"], ids=str
)
def test_corrupt_file_is_one_line(llama, tmp_path, capsys, damage):
    f = _cache(capsys, llama, tmp_path / "p.safetensors", "--dtype", "float32")
    data = f.read_bytes()
    if damage == "junk":
        f.write_bytes(b"\x00" * 8 + b"nonsense" * 10)
    elif damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "not a cache":  # a safetensors file, but model weights
        mx.save_safetensors(str(f), {"w": mx.zeros((2, 2))})
    else:
        f.write_bytes(b"")
    argv = ["generate", str(llama), "-p", QUERY, "--prompt-cache-file", str(f)]
    line = _one_line_refusal(capsys, argv)
    print(line)
    assert str(f) in line, line


def test_cache_prompt_refuses_bad_output_before_loading(llama, tmp_path, capsys):
    f = _cache(capsys, llama, tmp_path / "p.safetensors")
    before = f.read_bytes()
    line = _one_line_refusal(
        capsys, ["cache-prompt", str(llama), "-p", "x", "-o", str(f)]
    )
    assert "exists" in line and f.read_bytes() == before
    missing = tmp_path / "no" / "p.safetensors"
    line = _one_line_refusal(
        capsys, ["cache-prompt", str(llama), "-p", "x", "-o", str(missing)]
    )
    assert "no such folder" in line and not missing.parent.exists()
    _cache(capsys, llama, f, "--force", prompt="another prompt")
    assert f.read_bytes() != before
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]  # no temporaries


LINE = re.compile(r"^\d+ tokens, .* GB.*\n", re.M)  # a reply's stats line
STATS = re.compile(
    r"^(\d+) tokens, .* prompt (\d+) tokens(?: \(\+(\d+) cached\))?", re.M
)


def test_chat_reuses_a_cached_system_prompt(llama, tmp_path, capsys, monkeypatch):
    """A file made with --system-prompt S: chat --system-prompt S prefills only
    what follows it, and replies as without the file."""
    system = "You are a terse assistant who answers in one word. " * 3
    f = _cache(
        capsys,
        llama,
        tmp_path / "p.safetensors",
        "--system-prompt",
        system,
        prompt="Hi",
    )
    outs = {}
    for name, extra in (("plain", []), ("cached", ["--prompt-cache-file", str(f)])):
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\nMore\n"))
        argv = ["chat", str(llama), "-m", "6", "--system-prompt", system, *extra]
        assert main(argv) == 0
        outs[name] = capsys.readouterr().out
    plain, cached = STATS.findall(outs["plain"]), STATS.findall(outs["cached"])
    print(outs)
    replies = {k: LINE.split(v) for k, v in outs.items()}
    assert replies["plain"] == replies["cached"] and len(replies["plain"]) == 3
    assert not plain[0][2] and int(cached[0][2]) > len(system)  # bytes: 1 token each
    assert int(cached[0][1]) + int(cached[0][2]) == int(plain[0][1])


def test_chat_refuses_an_mlx_lm_file_it_cannot_seed(
    llama, tmp_path, capsys, monkeypatch
):
    from mlx_lm import cache_prompt

    f = tmp_path / "mlx_lm.safetensors"
    argv = ["cache_prompt", "--model", str(llama), "--prompt", PREFIX]
    monkeypatch.setattr(sys, "argv", [*argv, "--prompt-cache-file", str(f)])
    cache_prompt.main()
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    argv = ["chat", str(llama), "--mode", "stock", "--prompt-cache-file", str(f)]
    line = _one_line_refusal(capsys, argv)
    assert "no token ids" in line, line


def test_a_model_replaced_at_the_same_path_is_one_line(tmp_path, capsys):
    """The name alone cannot tell: the file's K/V shapes are checked against
    the model's own (one probe token)."""
    path = tiny.make_llama(tmp_path / "m", "gqa_untied")
    f = _cache(capsys, path, tmp_path / "p.safetensors", "--dtype", "float32")
    import shutil

    shutil.rmtree(path)
    tiny.make_llama(path, "mha_tied")  # 4 key/value heads, not 2
    argv = ["generate", str(path), "--dtype", "float32", "-p", QUERY]
    line = _one_line_refusal(capsys, [*argv, "--prompt-cache-file", str(f)])
    assert "heads" in line, line


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_cache_file_with_a_draft_is_one_line(llama, tmp_path, capsys, command):
    """The file holds the model's layers only, so a draft would start with an
    empty cache: refused with the flags, before anything loads."""
    f = _cache(capsys, llama, tmp_path / "p.safetensors")
    argv = [command, str(llama), "--prompt-cache-file", str(f)]
    line = _one_line_refusal(capsys, [*argv, "--draft-model", str(llama)])
    assert "--prompt-cache-file and --draft-model" in line, line
