"""Speculative decoding and KV cache options (docs/design.md section 3f).

References: the same command without a draft (greedy text must not change),
`--mode stock` (mlx-lm's own class) with the same cache options, and mlx's own
`mx.quantize` for the KV bits and group sizes offered."""

import json

import numpy as np
import pytest
import tiny

from flashnorm_mlx.cli import main
from flashnorm_mlx.modes import FLASHNORM, MODES

DRAFT_FLAGS = ("draft_model", "num_draft_tokens")
KV_FLAGS = ("max_kv_size", "kv_bits", "kv_group_size", "quantized_kv_start")


def _tiny(path, kind: str, seed: int, **extra):
    """A float32 tiny Llama or Qwen3 in HF layout; `extra` overrides its config."""
    cfg = tiny.llama_config("gqa_untied") if kind == "llama" else None
    if cfg is None:
        cfg = tiny.qwen_config("qwen3_untied")
    cfg = {**cfg, **extra}
    w = tiny.llama_weights(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    for i in range(cfg["num_hidden_layers"] if kind == "qwen3" else 0):
        for norm in ("q_norm", "k_norm"):  # QK-norm gains far from 1
            gain = rng.uniform(0.25, 4.0, cfg["head_dim"]).astype(np.float32)
            w[f"model.layers.{i}.self_attn.{norm}.weight"] = gain
    return tiny.write_model(path, cfg, w)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (target, draft): the draft another random model (other seed,
    one layer fewer) with the same tokenizer; head_dim 64 so that the default
    --kv-group-size divides it."""
    out = {}
    for kind in ("llama", "qwen3"):
        root = tmp_path_factory.mktemp(kind)
        target = _tiny(root / "target", kind, 0, head_dim=64, num_hidden_layers=3)
        draft = _tiny(root / "draft", kind, 1, head_dim=64, num_hidden_layers=2)
        out[kind] = (target, draft)
    return out


def _generate(capsys, model, *flags, prompt="the quick brown fox", tokens=48):
    argv = ["generate", str(model), "-p", prompt, "-m", str(tokens)]
    rc = main([*argv, "--dtype", "float32", "--ignore-chat-template", *flags])
    out = capsys.readouterr()
    assert rc == 0, out.err
    text, stats = out.out.split("=" * 10)
    return text, stats


# --- flags -------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_flags_are_mlx_lms_with_its_defaults(command):
    """Every draft and KV cache flag, spelled and defaulted as mlx_lm.generate's."""
    import importlib

    theirs = importlib.import_module("mlx_lm.generate").setup_arg_parser()
    theirs = {a.dest: a for a in theirs._actions}
    cli = importlib.import_module(f"flashnorm_mlx.cli.{command}")
    ours = {a.dest: a for a in cli.setup_arg_parser()._actions}
    for dest in DRAFT_FLAGS + KV_FLAGS:
        assert dest in ours, (command, dest)
        assert ours[dest].option_strings == theirs[dest].option_strings, dest
        assert ours[dest].default == theirs[dest].default, (dest, ours[dest].default)
    args = cli.setup_arg_parser().parse_args(
        ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "7"]
    )
    assert (args.kv_bits, args.kv_group_size, args.quantized_kv_start) == (4, 32, 7)


def test_kv_bits_and_group_sizes_are_what_mx_quantize_takes():
    """The flags offer exactly the settings mlx can quantize a KV cache with."""
    import mlx.core as mx

    from flashnorm_mlx import limits

    def takes(bits, group):
        try:
            mx.eval(mx.quantize(mx.ones((2, 256)), group_size=group, bits=bits))
            return True
        except ValueError:
            return False

    bits = tuple(b for b in range(1, 17) if takes(b, 64))
    groups = tuple(g for g in (8, 16, 32, 64, 128, 256) if takes(4, g))
    assert (limits.KV_BITS, limits.GROUP_SIZES) == (bits, groups)


BAD_VALUES = [
    (["generate", "--kv-bits", "7"], "--kv-bits"),
    (["chat", "--kv-bits", "9"], "--kv-bits"),
    (["serve", "--kv-group-size", "16"], "--kv-group-size"),
    (["generate", "--max-kv-size", "4"], "--max-kv-size"),
    (["generate", "--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["chat", "--draft-model", "d", "--max-kv-size", "64"], "do not go together"),
    (["serve", "--kv-bits", "4", "--max-kv-size", "64"], "do not go together"),
]


@pytest.mark.parametrize(
    "argv, says", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES]
)
def test_bad_values_are_one_line_before_mlx(argv, says):
    """Refused by the flags alone: exit 2, one line, MLX never imported."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flashnorm_mlx", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    timed = [l for l in r.stderr.splitlines() if l.startswith("import time:")]
    heavy = [l for l in timed if l.rsplit("|", 1)[-1].strip().startswith("mlx")]
    lines = [l for l in r.stderr.splitlines() if l not in timed]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, lines)
    assert says in lines[0] and lines[0].startswith(f"flashnorm-mlx {argv[0]}: error:")
    assert not heavy, heavy


# --- speculative decoding -----------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_a_draft_keeps_the_greedy_text(pairs, kind, engine, capsys):
    """Greedy text with a draft equals the text without one, on both engines;
    the acceptance line counts what mlx-lm's from_draft flags say."""
    target, draft = pairs[kind]
    flags = ["--engine", engine]
    alone, stats = _generate(capsys, target, *flags)
    assert "Draft:" not in stats
    for k in ("3", "5"):
        drafted, stats = _generate(
            capsys, target, *flags, "--draft-model", str(draft), "--num-draft-tokens", k
        )
        assert drafted == alone, (kind, engine, k, alone, drafted)
        line = next(l for l in stats.splitlines() if l.startswith("Draft:"))
        accepted, proposed = map(int, line.split()[1].split("/"))
        assert 0 <= accepted < proposed, line  # another random model: not all
        assert f"of {k} drafted" in line, line


def test_a_draft_equal_to_the_model_has_every_token_accepted(pairs, capsys):
    """The model as its own draft: every proposal is the model's own greedy
    token, so the tally must say all accepted, k per step."""
    target, _ = pairs["llama"]
    flags = ["--draft-model", str(target), "--num-draft-tokens", "3"]
    _, stats = _generate(capsys, target, *flags, tokens=13)
    line = next(l for l in stats.splitlines() if l.startswith("Draft:"))
    # 13 tokens: steps of 3 drafts + 1 own token (4, 4, 4) then 1 draft proposed.
    assert line.startswith("Draft: 10/10 draft tokens accepted (100.0%)"), line
    assert "2.50 per step" in line, line


def test_draft_tally_replays_mlx_lms_steps():
    from flashnorm_mlx.decode_options import DraftTally

    t = DraftTally(num_draft_tokens=2, max_tokens=7)
    for f in [True, False, False, True, True, False, True]:  # 1+1, 0+1, 2+1, 1
        t.add(f)
    assert t.counts() == (4, 2 + 2 + 2 + 1, 4)
    bad = DraftTally(num_draft_tokens=1, max_tokens=9)
    for f in [True, True]:
        bad.add(f)
    with pytest.raises(ValueError):
        bad.counts()


def test_a_draft_with_another_vocabulary_is_one_line(pairs, tmp_path, capsys):
    target, draft = pairs["llama"]
    other = tmp_path / "other"
    other.mkdir()
    for f in draft.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append(
        {**tok["added_tokens"][-1], "id": 259, "content": "<|extra|>"}
    )
    (other / "tokenizer.json").write_text(json.dumps(tok))
    argv = ["generate", str(target), "-p", "hi", "-m", "4", "--draft-model", str(other)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another vocabulary" in err[0], err


# --- KV cache options ----------------------------------------------------------

KV_CASES = {
    "rotating": ["--max-kv-size", "32"],
    "quantized": ["--kv-bits", "8", "--quantized-kv-start", "16"],
}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("case", list(KV_CASES))
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_kv_options_flashnorm_matches_stock(
    pairs, kind, case, engine, capsys, monkeypatch
):
    """64 greedy tokens past the rotation point / the quantization start:
    FlashNorm's text is stock's (mlx-lm's class) with the same cache, and the
    cache at the end is the kind asked for."""
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    from flashnorm_mlx.cli import decoding

    made, real = [], decoding.generation_kwargs

    def keep(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(decoding, "generation_kwargs", keep)
    target, _ = pairs[kind]
    flags = [*KV_CASES[case], "--engine", engine]
    texts = {}
    for mode in ("flashnorm", "stock"):
        texts[mode], _ = _generate(capsys, target, *flags, "--mode", mode, tokens=64)
        want = RotatingKVCache if case == "rotating" else QuantizedKVCache
        cache = made[-1]["prompt_cache"]
        assert all(type(c) is want for c in cache), [type(c) for c in cache]
        assert cache[0].offset >= 64, cache[0].offset
    assert texts["flashnorm"] == texts["stock"], texts
    if case == "rotating":  # the window changed what the model saw
        plain, _ = _generate(capsys, target, "--engine", engine, tokens=64)
        assert plain != texts["flashnorm"], "the rotating cache changed nothing"


def test_a_group_size_the_head_dim_refuses_is_one_line(pairs, capsys):
    target, _ = pairs["llama"]  # head_dim 64
    argv = ["generate", str(target), "-p", "hi", "-m", "4", "--kv-bits", "4"]
    assert main([*argv, "--kv-group-size", "128"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-group-size 128 does not divide" in err[0], err


# --- chat: the same options over a kept cache -----------------------------------


def _chat(monkeypatch, capsys, model, *flags, turns=("hello", "and more", "again")):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t + "\n" for t in turns)))
    rc = main(["chat", str(model), "-m", "24", "--dtype", "float32", *flags])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.splitlines()
    stats = [l for l in lines if " tok/s | prompt " in l]
    assert len(stats) == len(turns), out.out
    return [l for l in lines if l not in stats], stats


@pytest.mark.parametrize("kv", ["plain", "quantized"])
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_chat_with_a_draft_keeps_the_replies(pairs, engine, kv, monkeypatch, capsys):
    """Three turns on one kept cache (the draft's layers in it too), its KV
    cache quantized from token 16 on (within the first prompt) or not: the
    replies of a chat without the draft, and a draft count per reply. (A start
    crossed while generating is crossed later with a draft, whose steps
    advance k + 1 tokens: docs/design.md section 3f.)"""
    target, draft = pairs["llama"]
    flags = ["--engine", engine]
    if kv == "quantized":
        flags += ["--kv-bits", "8", "--quantized-kv-start", "16"]
    alone, plain = _chat(monkeypatch, capsys, target, *flags)
    assert not any("draft" in s for s in plain), plain
    drafted, stats = _chat(
        monkeypatch, capsys, target, *flags, "--draft-model", str(draft)
    )
    assert drafted == alone, (alone, drafted)
    assert all(" | draft " in s and " accepted, " in s for s in stats), stats
    # The draft's layers hold what the model's hold: each turn reuses as much.
    prompts = [s.split(" | ")[1].split(",")[0] for s in stats]
    assert prompts == [s.split(" | ")[1].split(",")[0] for s in plain], (stats, plain)


@pytest.mark.parametrize("case", list(KV_CASES))
def test_chat_kv_options_flashnorm_matches_stock(pairs, case, monkeypatch, capsys):
    """Three turns of 24 tokens cross --max-kv-size 32 and the quantization
    start at 16: FlashNorm's replies are stock's with the same options."""
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    from flashnorm_mlx.jobs.conversation import ChatSession

    sessions, init = [], ChatSession.__post_init__
    monkeypatch.setattr(
        ChatSession, "__post_init__", lambda s: (sessions.append(s), init(s))[1]
    )
    target, _ = pairs["qwen3"]
    replies = {
        mode: _chat(monkeypatch, capsys, target, *KV_CASES[case], "--mode", mode)[0]
        for mode in ("flashnorm", "stock")
    }
    assert replies["flashnorm"] == replies["stock"], replies
    want = RotatingKVCache if case == "rotating" else QuantizedKVCache
    for s in sessions:
        assert all(type(c) is want for c in s.cache), [type(c) for c in s.cache]
        assert s.cache[0].offset > 32, s.cache[0].offset


# --- bench --draft-model ----------------------------------------------------------


def test_bench_with_a_draft_reports_both_ways(pairs, tmp_path, capsys):
    """The model alone against with the draft: same tokens, both speeds, an
    acceptance rate below 1 for another random model, exactly 1 for itself."""
    target, draft = pairs["llama"]
    base = [
        "bench",
        str(target),
        "-p",
        "8",
        "-g",
        "16",
        "-n",
        "1",
        "--dtype",
        "float32",
    ]
    for d, rate in ((draft, None), (target, 1.0)):
        out = tmp_path / "draft.json"
        assert main([*base, "--draft-model", str(d), "--json", str(out)]) == 0
        text = capsys.readouterr().out
        r = json.loads(out.read_text())
        assert r["same_tokens"] is True, r
        assert "same tokens with and without the draft: yes" in text, text
        assert r["alone_decode_tps"]["median"] > 0 < r["draft_decode_tps"]["median"]
        assert 0 <= r["accepted"] <= r["proposed"] > 0, r
        if rate is None:
            assert r["acceptance_rate"] < 1, r
        else:
            assert r["acceptance_rate"] == rate, r
        assert f"draft tokens accepted: {r['accepted']}/{r['proposed']}" in text


def test_bench_refuses_a_draft_with_another_vocabulary(pairs, tmp_path, capsys):
    target, _ = pairs["llama"]
    cfg = {**tiny.llama_config("gqa_untied"), "vocab_size": 320}
    other = tiny.write_model(tmp_path / "other", cfg, tiny.llama_weights(cfg, 2))
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append(
        {**tok["added_tokens"][-1], "id": 259, "content": "<|extra|>"}
    )
    (other / "tokenizer.json").write_text(json.dumps(tok))
    argv = ["bench", str(target), "-g", "4", "-n", "1", "--draft-model", str(other)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another vocabulary" in err[0], err


def test_kv_bits_on_sliding_window_layers_is_one_line(tmp_path, capsys):
    """mlx-lm cannot quantize a rotating cache (RotatingKVCache.to_quantized):
    refused before generating, not a traceback at --quantized-kv-start."""
    model = tiny.make_llama(tmp_path / "m", "mistral_sliding")
    argv = ["generate", str(model), "-p", "hi", "-m", "4", "--kv-bits", "4"]
    assert main([*argv, "--kv-group-size", "32"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sliding-window layers" in err[0], err


def test_the_embedded_model_drafts_for_its_float32_copy(tmp_path, capsys):
    """SmolLM2: its float32 copy (convert --dequantize) as the model, the
    embedded 4-bit as its draft: the greedy text of the copy alone, and a
    count with most drafts accepted (a 4-bit copy mostly agrees). A prompt the
    model continues (without the chat template a question ends at once: one
    token, the end of turn), for 12 tokens: 3 drafted per step."""
    from flashnorm_mlx.loading.source import default_model_path

    target = tmp_path / "f32"
    assert (
        main(["convert", "--dequantize", "--dtype", "float32", "-o", str(target)]) == 0
    )
    capsys.readouterr()
    prompt = "Once upon a time,"
    alone, said = _generate(capsys, target, prompt=prompt, tokens=12)
    assert "Generation: 12 tokens" in said, said
    draft = str(default_model_path())
    drafted, stats = _generate(
        capsys, target, "--draft-model", draft, prompt=prompt, tokens=12
    )
    assert drafted == alone, (alone, drafted)
    line = next(l for l in stats.splitlines() if l.startswith("Draft:"))
    accepted, proposed = map(int, line.split()[1].split("/"))
    assert proposed > 0 and accepted >= proposed // 2, line


def test_the_flag_copies_are_the_librarys():
    """cli/mlx_lm_flags.py's numbers (it imports no MLX) are decode_options.py's and
    mlx-lm's."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    from flashnorm_mlx import decode_options
    from flashnorm_mlx.cli import mlx_lm_flags as flags

    assert flags.KV_KEEP == decode_options.KV_KEEP
    assert flags.DEFAULT_QUANTIZED_KV_START == DEFAULT_QUANTIZED_KV_START
    kv = decode_options.KVOptions()
    assert (kv.kv_group_size, kv.quantized_kv_start) == (64, DEFAULT_QUANTIZED_KV_START)


def test_a_draft_under_a_multi_rank_launch_is_refused(pairs, monkeypatch, capsys):
    from flashnorm_mlx.cli import decoding
    from flashnorm_mlx.parallel import distributed

    target, draft = pairs["llama"]
    monkeypatch.setattr(distributed, "current", lambda: object())
    args = decoding.KVOptions()  # any object: the refusal comes first
    args.draft_model = str(draft)
    with pytest.raises(decoding.UserError, match="mlx.launch"):
        decoding.draft_model(args, None, str(target), FLASHNORM)


@pytest.mark.parametrize("mode", ["stock", "flashnorm"])
def test_the_draft_is_built_in_the_mode_asked(pairs, mode, capsys, monkeypatch):
    """Model and draft both in --mode (stock: mlx-lm's class), through the one
    loader; stock's greedy text is its own with the draft too."""
    from flashnorm_mlx.cli import common

    built, real = [], common.build_model

    def recording(source, m, **k):
        built.append((source.name, m))
        return real(source, m, **k)

    monkeypatch.setattr(common, "build_model", recording)
    target, draft = pairs["qwen3"]
    alone, _ = _generate(capsys, target, "--mode", mode, tokens=24)
    flags = ["--mode", mode, "--draft-model", str(draft)]
    drafted, _ = _generate(capsys, target, *flags, tokens=24)
    assert drafted == alone, (alone, drafted)
    assert built[-2:] == [(str(target), MODES[mode]), (str(draft), MODES[mode])], built
