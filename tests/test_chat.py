"""`chat`: KV cache kept across turns, checked against generation from scratch.

The reference for every reply is mlx-lm's `stream_generate` on the full
templated conversation with a fresh cache (greedy), so a turn that reused the
wrong cache entries would show as a different reply.
"""

import io
import json
import os
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
import tiny
from mlx_lm import stream_generate

from flashnorm_mlx.cli import main
from flashnorm_mlx.jobs.conversation import ChatSession, ContextOverflow, common_prefix
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK

STATS = re.compile(r"^(\d+) tokens, [\d.]+ tok/s \| prompt (\d+) tokens.* GB.*$", re.M)
SYSTEM = "You are a terse assistant."
LONG = (
    "Here is a rather long first message, so that the whole conversation is much "
    "longer than the tokens a second turn adds: the quick brown fox jumps over the "
    "lazy dog, again and again, until the story ends."
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("chat"), "gqa_untied")


@pytest.fixture(scope="module")
def loaded(model_dir):
    source = read_source(str(model_dir))
    model, _ = build_model(source, FLASHNORM)
    return model, source.tokenizer


def held(s: ChatSession) -> int:
    """Tokens the session's KV cache itself holds (its first layer's)."""
    return s.cache[0].offset if s.cache else 0


def user(text):
    return {"role": "user", "content": text}


def reference(model, tok, messages, max_tokens, processors=None):
    """(ids, streamed text) of a greedy reply from scratch on a fresh cache."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    out = list(
        stream_generate(
            model, tok, ids, max_tokens=max_tokens, logits_processors=processors
        )
    )
    return [r.token for r in out], "".join(r.text for r in out)


def printable_only(tok):
    """Allow only ids that decode to one printable ASCII character that encodes
    back to the same id, plus end-of-sequence: such replies survive the chat
    template's re-rendering token for token (random weights pick anything)."""
    allowed = list(tok.eos_token_ids)
    for i in range(256):
        ch = tok.decode([i])
        if len(ch) == 1 and " " <= ch <= "~" and tok.encode(ch) == [i]:
            allowed.append(i)
    mask = mx.full((tiny.VOCAB,), -1e9)
    mask[mx.array(allowed)] = 0.0
    return lambda tokens, logits: logits + mask


class InterruptAt:
    """Logits processor that raises KeyboardInterrupt on its n-th call (a Ctrl-C
    landing inside a model step), once."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, tokens, logits):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt
        return logits


def test_second_turn_prefills_only_new_tokens(loaded):
    model, tok = loaded
    proc = [printable_only(tok)]
    s = ChatSession(model, tok, SYSTEM, max_tokens=10, logits_processors=proc)
    msgs1 = [{"role": "system", "content": SYSTEM}, user(LONG)]
    full1 = tok.apply_chat_template(msgs1, add_generation_prompt=True)
    t1 = s.send(LONG)
    ref1, _ = reference(model, tok, msgs1, 10, proc)
    assert t1.reply_ids == ref1, (t1.reply_ids, ref1)
    assert (t1.prompt_tokens, t1.cached_tokens) == (len(full1), 0), t1
    n1 = held(s)  # what the KV cache itself holds
    assert n1 == len(s.cache_ids) == len(full1) + len(t1.reply_ids), (
        n1,
        len(s.cache_ids),
        len(full1),
        len(t1.reply_ids),
    )

    msgs2 = s.messages + [user("And then?")]
    full2 = tok.apply_chat_template(msgs2, add_generation_prompt=True)
    assert full2[:n1] == s.cache_ids, "turn 1 cache is not a prefix of turn 2"
    t2 = s.send("And then?")
    print(
        f"turn 2: prefilled {t2.prompt_tokens}, cached {t2.cached_tokens}, "
        f"full conversation {len(full2)}"
    )
    assert t2.prompt_tokens == len(full2) - n1 > 0, (t2.prompt_tokens, len(full2), n1)
    assert (t2.cached_tokens, t2.trimmed_tokens) == (n1, 0), t2
    assert 4 * t2.prompt_tokens < len(full2), (t2.prompt_tokens, len(full2))
    ref2, _ = reference(model, tok, msgs2, 10, proc)
    assert t2.reply_ids == ref2, (t2.reply_ids, ref2)
    assert held(s) == len(full2) + len(ref2), (held(s), len(full2))
    assert t2.generation_tokens == len(ref2) and t2.peak_memory_gb > 0, t2
    assert t2.finish_reason in ("stop", "length") and t2.prompt_tps > 0, t2


def test_rerendered_history_trims_the_cache(loaded):
    """A template that renders earlier turns differently: reuse only the common
    prefix, and still answer exactly as from scratch."""
    model, tok = loaded
    s = ChatSession(model, tok, SYSTEM, max_tokens=6)
    s.send(LONG)
    old = list(s.cache_ids)
    s.messages[-1]["content"] = "A different reply."  # as a re-rendering would
    msgs2 = s.messages + [user("Why?")]
    full2 = tok.apply_chat_template(msgs2, add_generation_prompt=True)
    t2 = s.send("Why?")
    shared = common_prefix(old, full2)
    assert t2.cached_tokens == shared < len(old), (t2.cached_tokens, shared, len(old))
    assert t2.trimmed_tokens == len(old) - shared, (t2.trimmed_tokens, len(old), shared)
    assert t2.prompt_tokens == len(full2) - shared, (t2.prompt_tokens, len(full2))
    ref2, _ = reference(model, tok, msgs2, 6)
    assert t2.reply_ids == ref2, (t2.reply_ids, ref2)


def test_reset_clears_history_and_cache(loaded):
    model, tok = loaded
    s = ChatSession(model, tok, SYSTEM, max_tokens=4)
    s.send(LONG)
    s.reset()
    assert s.messages == [{"role": "system", "content": SYSTEM}], s.messages
    assert held(s) == 0 and s.cache_ids == [], held(s)
    t = s.send("Hi")
    full = s.render([{"role": "system", "content": SYSTEM}, user("Hi")])
    assert (t.prompt_tokens, t.cached_tokens) == (len(full), 0), t


@pytest.mark.parametrize("at", [1, 4])
def test_ctrl_c_keeps_session_consistent(loaded, at):
    """at=1: interrupted before the first token (turn dropped); at=4: mid-reply
    (partial reply kept). Either way the cache matches the history."""
    model, tok = loaded
    stop = InterruptAt(-1)
    s = ChatSession(model, tok, SYSTEM, max_tokens=8, logits_processors=[stop])
    s.send(LONG)
    stop.n, stop.calls = at, 0
    before, cached_before = list(s.messages), list(s.cache_ids)
    t = s.send("Go on.")
    assert t.finish_reason == "interrupted", t
    assert held(s) == len(s.cache_ids), (held(s), len(s.cache_ids))
    if at == 1:
        assert t.reply_ids == [] and s.messages == before, (t.reply_ids, s.messages)
        # Back to the part of the old cache this turn reused; nothing of it fed.
        assert s.cache_ids == cached_before[: t.cached_tokens], (
            len(s.cache_ids),
            t.cached_tokens,
        )
    else:
        # Call k samples token k-1; token k-2 was the last one handed out.
        assert len(t.reply_ids) == at - 2, t.reply_ids
        assert s.messages[-1] == {"role": "assistant", "content": t.reply}, s.messages
        assert s.messages[-2] == user("Go on."), s.messages
    stop.n = -1  # no more interrupts
    msgs = s.messages + [user("Finish.")]
    t2 = s.send("Finish.")
    ref, _ = reference(model, tok, msgs, 8)
    assert t2.reply_ids == ref, (t2.reply_ids, ref)


class Calls:
    """The model, recording the length of each input; with `stop_at`, Ctrl-C
    lands on that prefill chunk (input longer than one token) once it ran."""

    def __init__(self, model, stop_at=None):
        self.model, self.stop_at, self.lengths = model, stop_at, []

    def __getattr__(self, name):  # make_cache, layers, ... for mlx-lm
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None, **kw):
        out = self.model(inputs, cache=cache, **kw)
        self.lengths.append(inputs.shape[1])
        chunks = sum(n > 1 for n in self.lengths)
        if inputs.shape[1] > 1 and chunks == self.stop_at:
            self.stop_at = None
            raise KeyboardInterrupt
        return out


def test_ctrl_c_in_the_prefill_drops_the_turn_and_trims_the_cache(loaded):
    model, tok = loaded
    calls = Calls(model)
    s = ChatSession(calls, tok, SYSTEM, max_tokens=6, prefill_step_size=4)
    s.send(LONG)
    before, cached_before = list(s.messages), list(s.cache_ids)
    calls.stop_at, calls.lengths = 3, []
    t = s.send(LONG + " And more.")
    assert t.finish_reason == "interrupted" and t.reply_ids == [], t
    assert t.prefilled_tokens == 8 < t.prompt_tokens, t  # two chunks of 4 fed
    assert s.messages == before, s.messages  # the message is dropped
    assert s.cache_ids == cached_before[: t.cached_tokens], len(s.cache_ids)
    assert held(s) == len(s.cache_ids), (held(s), len(s.cache_ids))
    line = t.line()
    assert "tok/s" not in line and f"8 of {t.prompt_tokens} prompt tokens" in line
    t2 = s.send("Finish.")
    ref, _ = reference(model, tok, s.messages[:-1], 6)
    assert t2.reply_ids == ref, (t2.reply_ids, ref)


def test_the_prefill_runs_in_growing_chunks_up_to_the_step_size(loaded):
    """Chunks timed to PREFILL_CHUNK_S (a Ctrl-C waits for one): on a tiny
    model each is fast, so they double, in powers of two, up to the cap."""
    model, tok = loaded
    calls = Calls(model)
    s = ChatSession(calls, tok, SYSTEM, max_tokens=1, prefill_step_size=16)
    t = s.send(LONG)
    chunks, step = [], 4  # all but the last prompt token; mlx-lm feeds that one
    while sum(chunks) < t.prompt_tokens - 1:
        chunks.append(min(step, t.prompt_tokens - 1 - sum(chunks)))
        step = min(2 * step, 16)
    assert len(chunks) > 4, chunks
    n = len(chunks)
    assert calls.lengths[:n] == chunks and set(calls.lengths[n:]) == {1}, calls.lengths
    assert t.prompt_tps > 0, t


def test_context_overflow_refuses_or_drops_turns(loaded):
    model, tok = loaded
    limit = 90
    s = ChatSession(model, tok, SYSTEM, max_tokens=8, max_context=limit)
    with pytest.raises(ContextOverflow, match="refused"):
        s.send(LONG)  # ~180 tokens: never fits
    assert s.messages == [{"role": "system", "content": SYSTEM}], s.messages
    dropped = 0
    for i in range(4):
        t = s.send(f"Message number {i}.")
        dropped += t.dropped_messages
        assert held(s) <= limit, (i, held(s), limit)
        assert t.generation_tokens <= t.max_tokens <= 8, t
    assert dropped > 0, "four turns of ~30 tokens never outgrew 90 tokens?"
    assert s.messages[0]["role"] == "system", s.messages


# --- the CLI -------------------------------------------------------------------


def run_cli(monkeypatch, capsys, args, stdin):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(["chat", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def replies(out):
    """The text before each stats line (each reply ends with one newline)."""
    return re.split(r"^\d+ tokens, .* GB.*\n", out, flags=re.M)[:-1]


def test_cli_two_turns_match_reference(loaded, model_dir, monkeypatch, capsys):
    model, tok = loaded
    rc, out, err = run_cli(
        monkeypatch, capsys, [str(model_dir), "-m", "8", "--temp", "0"], "Hello\nMore\n"
    )
    assert rc == 0, (rc, err)
    stats = STATS.findall(out)
    assert len(stats) == 2, out
    ids1, text1 = reference(model, tok, [user("Hello")], 8)
    eos = tok.eos_token_ids
    a1 = {"role": "assistant", "content": tok.decode([t for t in ids1 if t not in eos])}
    ids2, text2 = reference(model, tok, [user("Hello"), a1, user("More")], 8)
    assert replies(out) == [text1 + "\n", text2 + "\n"], (out, text1, text2)
    assert [int(g) for g, _ in stats] == [len(ids1), len(ids2)], (stats, ids1, ids2)
    full1 = tok.apply_chat_template([user("Hello")], add_generation_prompt=True)
    assert int(stats[0][1]) == len(full1), (stats, len(full1))


def test_cli_stock_mode_gives_the_same_replies(model_dir, monkeypatch, capsys):
    outs = {}
    for mode in ("flashnorm", "stock"):
        args = [str(model_dir), "-m", "6", "--mode", mode, "--system-prompt", SYSTEM]
        rc, out, err = run_cli(monkeypatch, capsys, args, "Hi\nWhat?\n")
        assert rc == 0 and len(STATS.findall(out)) == 2, (mode, rc, out, err)
        outs[mode] = replies(out)
    assert outs["stock"] == outs["flashnorm"], outs


def test_cli_commands(model_dir, monkeypatch, capsys):
    stdin = "/help\nHi\n/reset\nHi\n/bogus\n/quit\nnever sent\n"
    rc, out, err = run_cli(monkeypatch, capsys, [str(model_dir), "-m", "4"], stdin)
    assert rc == 0, (rc, err)
    assert "/reset" in out and "/quit" in out, out  # the help text
    assert "unknown command /bogus" in out, out
    stats = STATS.findall(out)
    assert len(stats) == 2, out  # nothing after /quit
    assert stats[0] == stats[1], stats  # after /reset: the same full prefill
    assert "cached" not in out, out
    first, second = replies(out)
    first = first.split("conversation.\n")[-1]  # after the help text
    second = second.split("(conversation reset)\n")[-1]
    assert first == second and first.strip(), out


def test_cli_context_overflow_message(model_dir, monkeypatch, capsys):
    args = [str(model_dir), "-m", "8", "--max-context", "40"]
    rc, out, err = run_cli(monkeypatch, capsys, args, LONG + "\nHi\n")
    assert rc == 0, (rc, err)
    assert "message refused" in out and "holds 40" in out, out
    assert "Traceback" not in out + err, err
    assert len(STATS.findall(out)) == 1, out  # the short message still gets a reply


def test_cli_subprocess_piped_stdin_exits_0_on_eof(model_dir):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = ["-m", "4", "--temp", "0.7", "--top-p", "0.9", "--seed", "1"]
    r = subprocess.run(
        [sys.executable, "-m", "flashnorm_mlx", "chat", str(model_dir), *args],
        input="Hello\n\nHow are you?\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert len(STATS.findall(r.stdout)) == 2, r.stdout
    assert "Traceback" not in r.stderr, r.stderr


def test_cli_model_without_chat_template(model_dir, tmp_path, capsys):
    plain = shutil.copytree(model_dir, tmp_path / "plain")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    rc = main(["chat", str(plain)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "no chat template" in err[0], (rc, err)


# --- /compare: the last reply regenerated by every bench variant --------------

COMPARE = re.compile(
    r"^decode tok/s, last reply regenerated \((\d+) tokens.*?(\d+)-token prompt.*: "
    r"mlx-lm ([\d.]+) \| stock ([\d.]+) \| "
    r"stock_fused ([\d.]+) \| nonorm ([\d.]+) \| "
    r"flashnorm ([\d.]+)$",
    re.M,
)
RATIO = re.compile(r"\d\.\d+x")


def test_compare_regenerates_the_last_reply_on_the_same_prompt(model_dir, loaded):
    from flashnorm_mlx.timing import compare_decode_speed

    model, tok = loaded
    session = ChatSession(model, tok, max_tokens=6)
    session.send("Hello")
    prompt, reply = session.last_prompt_ids, session.last_reply_ids
    assert prompt == tok.apply_chat_template(
        [user("Hello")], add_generation_prompt=True
    )
    source = read_source(str(model_dir))
    stock, _ = build_model(source, STOCK)
    r = compare_decode_speed({"flashnorm": model, "stock": stock}, prompt, len(reply))
    for name, t in r.items():
        # Greedy on the same prompt: the same tokens as the chat's reply (float
        # FlashNorm equals stock), exactly as many, and a real speed.
        assert t["tokens"] == reply, (name, t["tokens"], reply)
        assert t["generated_tokens"] == len(reply) and t["decode_tps"] > 0, t


def test_cli_compare_prints_five_speeds(model_dir, monkeypatch, capsys):
    """One run each: the speeds, no ratio (a ratio of single runs is noise
    shown as a result, timing.round_ratios), said in one line; and the
    norm-removed row's text explained."""
    from flashnorm_mlx.cli.chat import NOISE, NONORM

    stdin = "/compare\nHi\n/compare\n/quit\n"
    rc, out, err = run_cli(monkeypatch, capsys, [str(model_dir), "-m", "8"], stdin)
    assert rc == 0, (rc, err)
    assert "needs a reply" in out, out  # nothing to compare before the first reply
    found = COMPARE.findall(out)
    assert len(found) == 1, out
    n, prompt_len, *speeds = found[0]
    assert all(float(x) > 0 for x in speeds), found
    stats = STATS.findall(out)
    assert int(n) == int(stats[0][0]) and int(prompt_len) == int(stats[0][1]), (
        found,
        stats,
    )
    flat = " ".join(out.split())
    assert " ".join(NOISE.split()) in flat and "within noise" in NOISE, out
    assert " ".join(NONORM.split()) in flat, out
    assert not RATIO.findall(flat.replace(" ".join(NOISE.split()), "")), out


def test_a_long_prefill_says_where_it_is_as_it_moves(monkeypatch):
    """After PREFILL_NOTICE_S the notice comes, then moves: before every chunk
    on a terminal's one line, at most every PREFILL_EVERY_S in a pipe; its
    words hold no parentheses (the terminal's line once nested two)."""
    from flashnorm_mlx.cli import chat

    clock = [0.0]
    monkeypatch.setattr(chat.time, "perf_counter", lambda: clock[0])
    for ui, every in ((chat.PlainUI(), chat.PREFILL_EVERY_S), (chat.PlainUI(), 0.0)):
        ui.EVERY_S = every
        said = []
        ui.prefill_notice = said.append
        for t, done in ((0, 0), (1, 18), (3, 40), (5, 80), (14, 120)):
            clock[0] = float(t)
            ui.prefilling(done, 444)
        want = ["40", "120"] if every else ["40", "80", "120"]
        assert [s.split(":")[1].split("/")[0].strip() for s in said] == want, said
        assert all("(" not in s and s.endswith("Ctrl-C drops it") for s in said)
    assert chat.RichUI.EVERY_S == 0.0
