"""Families FlashNorm does not cover run as stock: mlx-lm's own class on the
weights, one note line, in every command; FlashNorm asked of them is one error.

The reference is mlx-lm itself (`mlx_lm.load` and its generation loop) on the
same folder, never our own stock path.
"""

import json

import mlx.core as mx
import pytest
import tiny
import tiny_stock
from serve_process import Server

from flashnorm_mlx import models
from flashnorm_mlx.cli import main
from flashnorm_mlx.errors import ShardError, UnsupportedModel
from flashnorm_mlx.jobs import speed
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, NONORM, STOCK, STOCK_FUSED
from flashnorm_mlx.parallel import sharding

FAMILIES = tuple(tiny_stock.CONFIGS)  # olmo2, granite, starcoder2, olmoe
PROMPT = "hello world"
TOKENS = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("uncovered")
    return {f: tiny_stock.make(root / f, f) for f in FAMILIES}


def _mlx_lm_greedy(path, max_tokens=TOKENS):
    """(text, token ids) of mlx-lm's own load and greedy generation."""
    from mlx_lm import load, stream_generate

    model, tok = load(str(path))
    text, ids = "", []
    for r in stream_generate(model, tok, PROMPT, max_tokens=max_tokens):
        text += r.text
        ids.append(r.token)
    return text, ids


def _quantized(model) -> set:
    return {n for n, m in model.named_modules() if "Quantized" in type(m).__name__}


def _generated(out: str) -> str:
    return out[: out.index("\n==========")]


def _note_lines(err: str, model_type: str):
    return [l for l in err.splitlines() if f"model_type {model_type!r}" in l]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_is_mlx_lms_greedy_text_with_one_note(folders, family, capsys):
    want, ids = _mlx_lm_greedy(folders[family])
    assert len(set(ids)) >= 4, ids  # a text that shows a wrong step
    argv = ["generate", str(folders[family]), "-p", PROMPT, "-m", str(TOKENS)]
    assert main([*argv, "--temp", "0", "--ignore-chat-template"]) == 0
    out, err = capsys.readouterr()
    assert _generated(out) == want, (_generated(out), want, ids)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and _note_lines(err, family), err
    assert "does not cover" in lines[0] and "stock" in lines[0], err


def test_the_compiled_engine_asked_runs_eager_and_the_note_says_so(folders, capsys):
    from flashnorm_mlx import engine

    source = read_source(str(folders["olmo2"]), need_tokenizer=False)
    model, _ = build_model(source, STOCK, engine="compiled")
    assert engine.engine_of(model) == "eager"
    argv = ["generate", str(folders["olmo2"]), "-p", PROMPT, "-m", "2"]
    assert main([*argv, "--engine", "compiled"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eager engine" in err[0], err


def test_config_values_of_such_a_family_are_checked_for_types_alone():
    """Another family's fields may be 0 or negative where ours must not be."""
    from dataclasses import dataclass
    from typing import List, Optional

    from flashnorm_mlx.errors import LoadError
    from flashnorm_mlx.loading.config_checks import check_config

    @dataclass
    class Args:
        hidden_size: int
        first_k_dense_replace: int = 1
        attention_dropout: float = 0.1

    legit = {"hidden_size": 64, "first_k_dense_replace": 0, "attention_dropout": 0.0}
    check_config(legit, "config.json", [Args], ranges=False)
    with pytest.raises(LoadError, match="first_k_dense_replace is 0"):
        check_config(legit, "config.json", [Args])
    with pytest.raises(LoadError, match='hidden_size is "big": expected int'):
        check_config({**legit, "hidden_size": "big"}, "c", [Args], ranges=False)
    with pytest.raises(LoadError, match="hidden_size is missing"):
        check_config({}, "config.json", [Args], ranges=False)

    @dataclass
    class Shipped:  # mlx-lm's hints; the values as checkpoints write them
        pattern: Optional[List[str]] = None
        top_k: int = 2

    check_config({"pattern": "M-*", "top_k": [2, 4]}, "c", [Shipped], ranges=False)
    for bad, why in [
        ({"pattern": 3}, "pattern is 3: expected list"),
        ({"top_k": "2"}, 'top_k is "2": expected int'),
        ({"top_k": ["a"]}, r'top_k is \["a"\]: expected int'),
    ]:
        with pytest.raises(LoadError, match=why):
            check_config(bad, "c", [Shipped], ranges=False)


@pytest.mark.parametrize("family", tuple(tiny_stock.SHIPPED))
def test_configs_as_checkpoints_write_them_run_where_mlx_lm_loads_them(
    family, tmp_path
):
    """A field's form comes from the checkpoints people ship, not only from
    mlx-lm's type hint (tiny_stock.SHIPPED): our checks must not refuse what
    mlx-lm's own load takes. Reference: `mlx_lm.load` of the same folder."""
    from mlx_lm import load

    folder = tiny_stock.make(tmp_path / family, family)
    model, _ = build_model(read_source(str(folder), need_tokenizer=False), STOCK)
    ref, _ = load(str(folder))
    tokens = mx.array([[5, 17, 99, 3, 250, 42]])
    got, want = model(tokens), ref(tokens)
    err = mx.abs(got - want).max().item()
    assert err == 0.0 and mx.abs(want).max().item() > 0, (family, err)


def test_nemotron_h_with_its_pattern_string_generates_mlx_lms_text(tmp_path, capsys):
    """Nemotron-H's `hybrid_override_pattern` is a string ("M-*-") in every
    shipped checkpoint; it once stopped with 'expected list'. FlashNorm covers
    it now (models/nemotron_h.py): the default mode, no stock note."""
    folder = tiny_stock.make(tmp_path / "nemotron_h", "nemotron_h")
    assert isinstance(tiny_stock.config("nemotron_h")["hybrid_override_pattern"], str)
    want, ids = _mlx_lm_greedy(folder)
    assert len(set(ids)) >= 4, ids
    argv = ["generate", str(folder), "-p", PROMPT, "-m", str(TOKENS), "--temp", "0"]
    assert main([*argv, "--ignore-chat-template"]) == 0
    out, err = capsys.readouterr()
    assert _generated(out) == want, (_generated(out), want)
    assert not _note_lines(err, "nemotron_h"), err
    assert models.run_mode(tiny_stock.config("nemotron_h")) is FLASHNORM


def test_the_mode_defaults_to_stock_and_flashnorm_asked_is_one_error(folders, capsys):
    path = str(folders["olmo2"])
    argv = ["generate", path, "-p", PROMPT, "-m", "2"]
    assert main([*argv, "--mode", "flashnorm"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert "error: --mode flashnorm" in err and "'olmo2'" in err, err
    assert all(mt in err for mt in models.ARCHITECTURES), err  # the covered ones
    assert models.run_mode({"model_type": "olmo2"}) is STOCK
    assert models.run_mode({"model_type": "llama"}) is FLASHNORM


def test_build_model_takes_a_mode_and_refuses_one_needing_our_cover(folders):
    """A library caller's build_model: a mode built with FlashNorm's cover of
    a family it does not cover is models.not_covered's one line, as --mode's;
    a mode's name is a TypeError naming the fix (names become Modes once,
    where the model is read: models.run_mode)."""
    source = read_source(str(folders["olmo2"]), need_tokenizer=False)
    for mode in (FLASHNORM, NONORM, STOCK_FUSED):
        with pytest.raises(UnsupportedModel) as e:
            build_model(source, mode)
        said = str(e.value)
        assert said.startswith(f"--mode {mode}: FlashNorm does not cover"), said
        assert "'olmo2'" in said and "\n" not in said, said
    with pytest.raises(TypeError, match=r"takes a modes\.Mode .*not 'stock'"):
        build_model(source, "stock")


def test_convert_refuses_in_one_line_and_writes_nothing(folders, tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["convert", str(folders["granite"]), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to fold" in err[0] and "'granite'" in err[0]
    assert not out.exists() and list(tmp_path.iterdir()) == [], err


def test_bench_shows_mlx_lm_and_stock_and_says_why_the_rest_are_absent(folders, capsys):
    source = read_source(str(folders["starcoder2"]), need_tokenizer=False)
    r = speed.run_bench(source, prompt_tokens=6, gen_tokens=3, trials=1)
    assert list(r["variants"]) == ["mlx-lm", "stock"], list(r["variants"])
    assert set(r["absent"]) == {"stock_fused", "nonorm", "flashnorm"}, r["absent"]
    assert all(s["logits_finite"] for s in r["variants"].values()), r["variants"]
    stock = r["variants"]["stock"]  # untied: a step reads one embedding row
    table = tiny.VOCAB * tiny_stock.config("starcoder2")["hidden_size"] * 4
    assert stock["weight_bytes"] - stock["decode_bytes_per_token"] == table, stock
    why = [n for n in r["notes"] if "absent" in n]
    assert len(why) == 1 and "'starcoder2'" in why[0], r["notes"]
    with pytest.raises(speed.BenchError, match="'starcoder2'"):
        speed.run_bench(source, ["stock", "nonorm"], 6, 3, 1)
    # The table as the command prints it: the two rows, the reason under it.
    argv = ["bench", str(folders["starcoder2"]), "-p", "6", "-g", "3", "-n", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # Table rows: a variant, then its engine (a wrapped note line may start
    # with "mlx-lm's").
    rows = [
        l.split()[0]
        for l in out.splitlines()
        if l.split()[1:2] in (["eager"], ["compiled"])
    ]
    assert rows == ["mlx-lm", "stock"], out
    assert "flashnorm are absent" in " ".join(out.split()), out


def test_verify_says_there_is_nothing_to_compare(folders, capsys):
    assert main(["verify", str(folders["olmo2"])]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and out.startswith("nothing to compare"), out
    assert main(["verify", str(folders["olmo2"]), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model_type"] == "olmo2" and r["comparison"] == "stock alone", r


def test_perplexity_scores_stock_alone_with_the_note(folders, capsys):
    argv = ["perplexity", str(folders["granite"]), "--num-seqs", "2"]
    assert main([*argv, "--seq-len", "24", "--json"]) == 0
    cap = capsys.readouterr()
    r = json.loads(cap.out)
    assert "stock" in r and "flashnorm" not in r, r
    assert r["stock"] > 1 and r["comparison"] == "stock alone", r
    assert len(_note_lines(cap.err, "granite")) == 1, cap.err
    assert main([*argv, "--mode", "flashnorm"]) == 1
    err = capsys.readouterr().err
    assert "error: --mode flashnorm" in err, err


def test_cache_prompt_then_generate_from_it(folders, tmp_path, capsys):
    path, f = str(folders["starcoder2"]), tmp_path / "p.safetensors"
    assert main(["cache-prompt", path, "-p", PROMPT, "-o", str(f)]) == 0
    assert "(stock)" in capsys.readouterr().out
    argv = ["generate", path, "-p", "x", "-m", "4", "--prompt-cache-file", str(f)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Generation: 4 tokens" in out and len(_note_lines(err, "starcoder2")) == 1


@pytest.mark.parametrize("family", ["olmo2", "olmoe"])  # olmoe: 3-D experts
def test_mlx_lm_quantized_checkpoint_loads_as_mlx_lm_loads_it(
    folders, family, tmp_path, capsys
):
    from mlx_lm import convert, load

    q = tmp_path / "q4"
    convert(str(folders[family]), str(q), quantize=True, q_group_size=32, q_bits=4)
    want, _ = _mlx_lm_greedy(q)
    capsys.readouterr()  # convert's own lines
    source = read_source(str(q))
    model, _ = build_model(source, STOCK, dtype=mx.float32)
    ref, _ = load(str(q))
    ours, theirs = _quantized(model), _quantized(ref)  # experts too, for olmoe
    assert ours == theirs and len(theirs) > 10, (ours ^ theirs, theirs)
    argv = ["generate", str(q), "-p", PROMPT, "-m", str(TOKENS), "--temp", "0"]
    assert main([*argv, "--ignore-chat-template"]) == 0
    assert _generated(capsys.readouterr().out) == want


def test_q_quantizes_as_mlx_lm_convert_does(folders, tmp_path, capsys):
    """-q on such a family is mlx-lm's own quantization, its class's
    quant_predicate included (Granite keeps o_proj and lm_head at 8 bits)."""
    from mlx_lm import convert

    q = tmp_path / "q4"
    convert(str(folders["granite"]), str(q), quantize=True, q_group_size=64, q_bits=4)
    want, _ = _mlx_lm_greedy(q)
    capsys.readouterr()
    argv = ["generate", str(folders["granite"]), "-p", PROMPT, "-m", str(TOKENS)]
    argv += ["--temp", "0", "--ignore-chat-template", "-q", "--q-group-size", "64"]
    assert main(argv) == 0
    assert _generated(capsys.readouterr().out) == want
    source = read_source(str(folders["granite"]))
    model, config = build_model(source, STOCK, quantize=(4, 64))
    assert model.lm_head.bits == 8 and model.model.layers[0].mlp.up_proj.bits == 4
    assert config["quantization"]["lm_head"]["bits"] == 8, config["quantization"]


def test_a_model_type_mlx_lm_cannot_load_is_one_error(tmp_path, capsys):
    cfg = {**tiny.llama_config("gqa_untied"), "model_type": "no_such_family"}
    path = tiny.write_model(tmp_path / "m", cfg, tiny.llama_weights(cfg))
    assert main(["generate", str(path), "-p", "x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported model_type 'no_such_family'" in err[0], err
    with pytest.raises(UnsupportedModel, match="cannot load it"):
        models.check_runnable(cfg)
    assert str(path / "config.json") in err[0], err  # the file that says it


def test_a_folder_looks_up_mlx_lms_class_once(tmp_path, folders, monkeypatch):
    """Reading a folder asks mlx-lm for its class once (the import is the
    cost): the check that anything can run it and the config's types are one
    lookup, for an uncovered family and a covered one alike."""
    calls = []
    lookup = models.stock_model_classes
    monkeypatch.setattr(
        models, "stock_model_classes", lambda c: calls.append(c) or lookup(c)
    )
    read_source(str(folders["granite"]), need_tokenizer=False)
    llama = tiny.make_llama(tmp_path / "llama", "gqa_untied", tokenizer=False)
    read_source(str(llama), need_tokenizer=False)
    assert [c["model_type"] for c in calls] == ["granite", "llama"], calls


def test_tensor_parallel_uses_mlx_lms_own_shard_or_says_it_has_none(folders):
    """A family FlashNorm does not cover is split by its class's own `shard`
    (none of these three has one: one line), never by ours, which assumes
    Llama's layers."""
    group = mx.distributed.init()
    source = read_source(str(folders["granite"]), need_tokenizer=False)
    with pytest.raises(ShardError, match="no tensor-parallel shard"):
        build_model(source, STOCK, group=group)

    calls = []
    model, _ = build_model(source, STOCK)
    model.shard = lambda g: calls.append(g)  # mlx-lm's own, where a class has one
    sharding.shard_model(model, group, "granite", own=True)
    assert calls == [group], calls


def test_serve_answers_a_chat_completion_as_mlx_lm_would(folders):
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    s = Server(str(folders["granite"]))
    try:
        assert len(_note_lines(s.log(), "granite")) == 1, s.log()
        _, health = s.request("GET", "/health")
        assert health["mode"] == "stock", health
        messages = [{"role": "user", "content": PROMPT}]
        status, r = s.request(
            "POST",
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 8, "temperature": 0},
        )
        assert status == 200, r
        model, tok = load(str(folders["granite"]))
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
        ids = ids[: next((i for i, t in enumerate(ids) if t in tok.eos_token_ids), 8)]
        want = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
        assert r["choices"][0]["message"]["content"] == want, (r, want)
        # The page's Compare has no FlashNorm model to build: a 400 saying so.
        body = {"messages": messages, "max_tokens": 4}
        status, r = s.request("POST", "/compare", body)
        assert status == 400 and "nothing to compare" in str(r), (status, r)
    finally:
        s.kill()


def test_chat_runs_it_and_compare_times_mlx_lm_and_stock(folders, monkeypatch, capsys):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/compare\n/quit\n"))
    assert main(["chat", str(folders["olmo2"]), "-m", "4"]) == 0
    out, err = capsys.readouterr()
    assert len(_note_lines(err, "olmo2")) == 1, err
    line = next(l for l in out.splitlines() if l.startswith("decode tok/s"))
    cells = line.split(": ", 1)[1].split("; ")[0].split(" | ")
    assert [c.split()[0] for c in cells] == ["mlx-lm", "stock"], line
    assert "flashnorm are absent" in line, line


def test_bench_draft_runs_both_as_stock(folders, capsys):
    path = str(folders["olmo2"])
    argv = ["bench", path, "--draft-model", path, "-p", "4", "-g", "6", "-n", "1"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert len(_note_lines(err, "olmo2")) == 1, err
    assert "same tokens with and without the draft: yes" in out, out


def test_an_uncovered_draft_of_a_flashnorm_model_runs_as_stock(
    folders, tmp_path, monkeypatch, capsys
):
    """--mode flashnorm with a draft FlashNorm does not cover: the model as
    asked, the draft as stock (models.run_mode's or_stock), said in one note."""
    from flashnorm_mlx.cli import common

    built, real = [], common.build_model

    def recording(source, mode, **kw):
        built.append(mode)
        return real(source, mode, **kw)

    monkeypatch.setattr(common, "build_model", recording)
    target = tiny.make_llama(tmp_path / "llama", "gqa_untied")
    draft = str(folders["olmo2"])
    argv = ["generate", str(target), "-p", PROMPT, "-m", "4", "--temp", "0"]
    assert main([*argv, "--mode", "flashnorm", "--draft-model", draft]) == 0
    err = capsys.readouterr().err
    assert built == [FLASHNORM, STOCK], built
    assert len(_note_lines(err, "olmo2")) == 1, err
