"""What a new user trips over (issue 46 item 3): chat's /compare shows the
texts and prefills once, the prefill line leaves the transcript, a mistyped
command names the closest one, the package says which families it runs."""

import io
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest
import tiny

import flashnorm_mlx
from flashnorm_mlx.cli import chat as chat_cli
from flashnorm_mlx.cli import main
from flashnorm_mlx.jobs.conversation import ChatSession
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("first"), "gqa_untied", seed=5)


# --- a mistyped command --------------------------------------------------------


@pytest.mark.parametrize(
    "typed, want", [("generat", "generate"), ("cache_prompt", "cache-prompt")]
)
def test_a_mistyped_command_names_the_closest_one(typed, want, capsys):
    assert main([typed]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"did you mean '{want}'?" in err[0], err


def test_a_command_far_from_every_one_gets_no_guess(capsys):
    assert main(["xyzzy"]) == 2
    err = capsys.readouterr().err
    assert "did you mean" not in err and "choose from" in err, err


def test_a_mistyped_chat_command_names_the_closest_one():
    assert "(did you mean /compare?)" in chat_cli.unknown_command("/comapre")
    assert "did you mean" not in chat_cli.unknown_command("/xyzzy")


# --- the package names its families ---------------------------------------------

# model_type -> the family's name in the summary ("Qwen2/Qwen3" names both)
FAMILY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
FAMILY.update({"qwen3": "Qwen3", "openelm": "OpenELM", "gemma3_text": "Gemma 3"})
FAMILY.update({"phi3": "Phi-3", "smollm3": "SmolLM3", "qwen3_moe": "Qwen3-MoE"})
FAMILY.update({"mixtral": "Mixtral", "gpt_oss": "gpt-oss"})
FAMILY.update({"ministral3": "Ministral 3", "qwen3_5": "Qwen3.5"})
FAMILY.update({"qwen3_5_moe": "Qwen3.5", "qwen3_next": "Qwen3-Next"})
FAMILY.update({"lfm2": "LFM2", "lfm2_moe": "LFM2-MoE", "nemotron_h": "Nemotron-H"})
FAMILY.update({"gemma4_text": "Gemma 4", "glm4_moe": "GLM-4.5"})
FAMILY.update({"llama4_text": "Llama 4", "llama4": "Llama 4"})
FAMILY.update({"granitemoehybrid": "Granite 4", "deepseek_v3": "DeepSeek V3"})
FAMILY.update({"kimi_k2": "Kimi K2"})


def test_summary_and_docstring_name_every_family():
    from flashnorm_mlx.models import ARCHITECTURES

    toml = (ROOT / "pyproject.toml").read_text()  # tomllib: Python 3.11 on
    summary = re.search(r'^description = "(.*)"$', toml, re.M).group(1)
    doc = " ".join(flashnorm_mlx.__doc__.split())
    for model_type in ARCHITECTURES:
        name = FAMILY.get(model_type, model_type)
        assert name in summary, (model_type, summary)
        assert name in doc, (model_type, doc)
    assert "for Llama and OpenELM" not in summary + doc


# --- the prefill line leaves the transcript ------------------------------------


def screen(raw: str) -> list:
    """The lines a terminal shows for `raw`: colours dropped, "\\r" back to the
    line's start, ESC[2K erasing the line (what RichUI writes)."""
    raw = re.sub(r"\x1b\[[0-9;]*m", "", raw)
    lines, col = [""], 0
    for part in re.split(r"(\r|\n|\x1b\[2K)", raw):
        if part == "\n":
            lines.append("")
            col = 0
        elif part == "\r":
            col = 0
        elif part == "\x1b[2K":
            lines[-1] = ""
        elif part:
            cur = lines[-1]
            lines[-1] = cur[:col] + part + cur[col + len(part) :]
            col += len(part)
    return lines


def test_the_reading_line_is_gone_once_the_reply_starts():
    from rich.console import Console

    ui = chat_cli.RichUI()
    buf = io.StringIO()
    ui.console = Console(file=buf, force_terminal=True, width=60, highlight=False)
    ui.prefill_notice("reading the message (24/37 prompt tokens; Ctrl-C drops it)")
    assert "reading the message" in screen(buf.getvalue())[-1]  # shown meanwhile
    ui.text("Paris is")
    ui.text(" the capital.")
    ui.end_reply(None)
    shown = screen(buf.getvalue())
    print(shown)
    assert shown == ["Paris is the capital.", ""], shown


# --- /compare -------------------------------------------------------------------


def test_compare_shows_each_variants_text(model_dir, monkeypatch, capsys):
    """Greedy on float32 weights: mlx-lm, stock, stock_fused and FlashNorm
    regenerate the chat's own reply, on one line; nonorm (not the same function)
    is shown too."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/compare\n/quit\n"))
    rc = main(["chat", str(model_dir), "-m", "6", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    reply = out.splitlines()[0]
    groups = re.findall(r'^  ([\w, -]+): "(.*)"$', out, re.M)
    print(out, groups)
    names = {n.strip(): text for names, text in groups for n in names.split(",")}
    assert set(names) == {"mlx-lm", "stock", "stock_fused", "nonorm", "flashnorm"}
    same = [n for n in ("mlx-lm", "stock", "stock_fused") if names[n] == reply]
    assert names["flashnorm"] == " ".join(reply.split()) and len(same) == 3, names


def test_one_prefill_then_each_variant_decodes_what_a_full_run_decodes(model_dir):
    """The shared prefill (the chat model's cache after prompt[:-1], copied per
    row) regenerates the tokens a run from the whole prompt gives, for a
    row other than the chat's own; the copies leave the shared cache as
    it was."""
    from flashnorm_mlx.timing import time_generation

    source = read_source(str(model_dir))
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    session = ChatSession(model, source.tokenizer, max_tokens=8)
    session.send("Tell me about the fox")
    prompt, n = session.last_prompt_ids, len(session.last_reply_ids)
    compare = chat_cli.CompareRows(source, FLASHNORM, model, {"dtype": mx.float32})
    base = compare._prefill(prompt)
    held = [(c.offset, mx.array(c.keys)) for c in base]
    for m in (stock, model):
        got = compare._regenerate(m, prompt, n, base)["tokens"]
        want = time_generation(m, mx.array(prompt), n)["tokens"]
        assert got == want == session.last_reply_ids, (got, want)
    for c, (offset, keys) in zip(base, held):
        assert c.offset == offset == len(prompt) - 1
        assert mx.array_equal(c.keys, keys).item()
