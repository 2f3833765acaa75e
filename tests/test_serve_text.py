"""`flashnorm-mlx serve` on the embedded SmolLM2: the text of an answer is the
exact decoding of its tokens in context (echo, text_offset, streams, chat),
and the sampler fields are honoured or refused. One server for the module;
few greedy tokens per prompt because the CPU decodes ~6 tokens/s."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_process import Server
from test_serve import open_stream, sse_events

# One prompt a case (each answered twice, streamed twice: ~0.11 s a token
# here): the end of a word, mid-word, a trailing space, digits, digits and a
# trailing space, code ending in a newline, a newline inside, a number in prose.
PROMPTS = [
    "The capital of France is",
    "The capital of Fra",
    "Hello, my name is ",
    "1, 2, 3, 4,",
    "1, 2, 3, 4, ",
    "def fibonacci(n):\n",
    "Q: What is 2+2?\nA:",
    "In 1492, Columbus",
]
ASK = dict(model="default", max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def tok():
    from flashnorm_mlx.loading.source import read_source

    return read_source(None).tokenizer


@pytest.fixture(scope="module")
def ids_of(tok):
    """Token ids from their texts, for tokens whose text is theirs alone (a
    token's text encodes to it; the decoding of every id is the slow way)."""
    everyone = []

    def one(piece):
        ids = tok.encode(piece)
        if len(ids) == 1 and tok.decode(ids) == piece:
            return ids[0]
        if not everyone:
            everyone.extend(tok.decode([i]) for i in range(len(tok.get_vocab())))
        found = [i for i, text in enumerate(everyone) if text == piece]
        assert len(found) == 1, f"no single token decodes to {piece!r}: {found}"
        return found[0]

    return lambda pieces: [one(p) for p in pieces]


def _check_offsets(text, lp):
    for token, at in zip(lp["tokens"], lp["text_offset"]):
        assert text[at : at + len(token)] == token, (text, token, at)


@pytest.fixture(scope="module")
def answers(server):
    """{echo: [choice dicts]}: PROMPTS in one request each way, from the
    openai client (echo=True, logprobs=1 round-trips)."""
    client = server.client()
    out = {}
    for echo in (True, False):
        r = client.completions.create(**ASK, prompt=PROMPTS, echo=echo, logprobs=1)
        assert len(r.choices) == len(PROMPTS), r
        out[echo] = [c.model_dump() for c in r.choices]
    return out


def test_echo_text_is_the_decode_of_prompt_and_reply(answers, tok, ids_of):
    """Echo: text == decode(prompt ids + generated ids), offsets into it;
    without echo, the text after the prompt's."""
    for prompt, c, p in zip(PROMPTS, answers[True], answers[False]):
        lp, plp = c["logprobs"], p["logprobs"]
        prompt_ids = tok.encode(prompt)
        n = len(prompt_ids)
        assert len(lp["tokens"]) == n + len(plp["tokens"]), (prompt, lp, plp)
        gen = ids_of(lp["tokens"][n:])
        full = tok.decode(prompt_ids + gen)
        print(repr(prompt), "->", repr(c["text"][len(prompt) :]))
        assert c["text"] == full, (prompt, c["text"], full)
        assert "".join(lp["tokens"]) == full, (prompt, lp["tokens"])
        assert lp["text_offset"][n] == len(tok.decode(prompt_ids)), lp
        _check_offsets(c["text"], lp)
        # Without echo: what the prompt's text is followed by, offsets from 0.
        assert p["text"] == full[len(tok.decode(prompt_ids)) :], (prompt, p["text"])
        assert plp["tokens"] == lp["tokens"][n:], (plp, lp)
        assert plp["text_offset"][0] == 0, plp
        _check_offsets(p["text"], plp)


def _stream_text(port, path, body):
    """(concatenated text, [logprobs of each chunk]) of one stream."""
    conn, resp = open_stream(port, path, body)
    try:
        chunks = [json.loads(e) for e in sse_events(resp) if e != "[DONE]"]
    finally:
        conn.close()
    text, lps = "", []
    for c in chunks:
        for ch in c["choices"]:
            text += ch.get("text") or ch.get("delta", {}).get("content") or ""
            if ch.get("logprobs"):
                lps.append(ch["logprobs"])
    return text, lps


def test_streams_equal_the_answer_and_its_offsets(server, answers):
    """Streamed chunks concatenate to the same text, echo or not, and carry
    the same tokens and text offsets; the streams decode in one batch."""
    body = dict(ASK, logprobs=1)

    def stream(i):
        echo = i % 4 == 0  # some streams echo (scoring the prompt again), most not
        one = {**body, "prompt": PROMPTS[i], "echo": echo}
        return echo, _stream_text(server.port, "/v1/completions", one)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(stream, range(len(PROMPTS))))
    for i, (echo, (text, lps)) in enumerate(got):
        c = answers[echo][i]
        assert text == c["text"], (PROMPTS[i], echo, text, c["text"])
        for key in ("tokens", "text_offset"):
            streamed = [x for lp in lps for x in lp[key]]
            assert streamed == c["logprobs"][key], (PROMPTS[i], key, streamed, c)
        streamed = [x for lp in lps for x in lp["token_logprobs"]]
        for a, b in zip(streamed, c["logprobs"]["token_logprobs"]):
            assert (a is None and b is None) or abs(a - b) <= 1e-4, (streamed, c)


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Say hello."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What colour is the sky?"},
    ],
]


def test_chat_content_is_the_decode_of_its_tokens_in_context(server, tok, ids_of):
    client = server.client()
    for messages in CHATS:
        ask = dict(model="default", messages=messages, max_tokens=4, temperature=0)
        r = client.chat.completions.create(**ask, logprobs=True)
        content = r.choices[0].message.content
        pieces = [e.token for e in r.choices[0].logprobs.content]
        gen = ids_of(pieces)
        if r.choices[0].finish_reason == "stop":  # the end-of-sequence token
            assert gen[-1] in tok.eos_token_ids, pieces
            gen = gen[:-1]
        template = tok.apply_chat_template(messages, add_generation_prompt=True)
        want = tok.decode(template + gen)[len(tok.decode(template)) :]
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**ask, stream=True)
            if c.choices
        )
        print(repr(content))
        assert content == want == streamed, (content, want, streamed)


# --- the detokenizer alone -----------------------------------------------------


def test_detokenizer_holds_back_partial_characters(tok):
    """Pieces join to decode(context + ids) after decode(context), whatever
    the tokens split: a character across tokens comes whole with its last."""
    from flashnorm_mlx.serve.text import Detokenizer

    for context, text in [
        ("", "café ’ 日本語 🙂 done"),
        ("Say: ", "日本 is Japan"),
        ("x 日", "本 and more"),  # the context ends mid-character
        ("The capital of France is", " Paris."),
    ]:
        ctx = tok.encode(context) if context else []
        ids = tok.encode(context + text)[len(ctx) :]
        if tok.decode(ctx + ids) != context + text:
            ids = tok.encode(text)  # no shared token at the boundary
        d = Detokenizer(tok.decode, ctx)
        pieces = [d.add(t) for t in ids]
        pieces.append(d.flush())
        full = tok.decode(ctx + ids)
        before = tok.decode(ctx).rstrip("\ufffd")
        assert "".join(pieces) == full[len(before) :], (context, pieces, full)
        assert all("\ufffd" not in p for p in pieces), pieces
        # What each token would add (as for top logprobs) is what it adds.
        d = Detokenizer(tok.decode, ctx)
        for t in ids:
            assert d.piece(t) == d.add(t)


# --- sampler fields ------------------------------------------------------------


def _texts(server, asks, path="/v1/completions"):
    """Each body's text, sent together (decoded in one batch)."""

    def one(body):
        status, r = server.request("POST", path, body)
        assert status == 200, r
        c = r["choices"][0]
        return c["text"] if "text" in c else c["message"]["content"]

    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(one, asks))


def test_top_k_and_min_p_are_honoured(server):
    prompt = "My favourite colour is blue because"
    base = dict(prompt=prompt, max_tokens=4)
    greedy = _texts(server, [dict(base, temperature=0)])[0]
    hot = [dict(base, temperature=2.0, seed=s) for s in range(3)]
    asks = hot + [dict(a, top_k=1) for a in hot] + [dict(a, min_p=1.0) for a in hot]
    got = _texts(server, asks)  # in one batch
    print(greedy, got)
    assert any(t != greedy for t in got[:3]), got  # hot sampling wanders
    assert got[3:] == [greedy] * (len(asks) - 3), (greedy, got)
    # Streamed, and chat.
    text, _ = _stream_text(
        server.port, "/v1/completions", dict(hot[1], top_k=1, stream=True)
    )
    assert text == greedy, (text, greedy)
    chat = dict(messages=CHATS[1], max_tokens=4)
    want = _texts(server, [dict(chat, temperature=0)], "/v1/chat/completions")[0]
    got = _texts(
        server,
        [dict(chat, temperature=2.0, seed=1, top_k=1)]
        + [dict(chat, temperature=2.0, seed=3, min_p=1.0)],
        "/v1/chat/completions",
    )
    text, _ = _stream_text(
        server.port,
        "/v1/chat/completions",
        dict(chat, temperature=2.0, seed=5, top_k=1),
    )
    assert got + [text] == [want] * 3, (want, got, text)


def test_logit_bias_and_penalties_are_honoured(server, tok):
    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    base = dict(prompt=prompt, max_tokens=4, temperature=0)
    (banana,) = tok.encode(" banana")
    plain, biased, penalised, repeated = _texts(
        server,
        [
            base,
            dict(base, logit_bias={str(banana): 100}),
            dict(base, frequency_penalty=2.0),
            dict(base, repetition_penalty=5.0, repetition_context_size=64),
        ],
    )
    print([plain, biased, penalised, repeated])
    assert plain.startswith(" 9,"), plain
    assert biased == " banana" * 4, biased
    assert penalised != plain and repeated != plain, (plain, penalised, repeated)


SAMPLER_400 = {  # name: (path, extra fields, param)
    "negative top_k": ("/v1/completions", {"top_k": -1}, "top_k"),
    "top_k a float": ("/v1/completions", {"top_k": 1.5}, "top_k"),
    "min_p above 1": ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    "min_p a string": ("/v1/completions", {"min_p": "x"}, "min_p"),
    "min_tokens_to_keep 0": ("/v1/completions", {"min_tokens_to_keep": 0}, None),
    "presence_penalty 3": ("/v1/completions", {"presence_penalty": 3}, None),
    "frequency_penalty a string": (
        "/v1/chat/completions",
        {"frequency_penalty": "x"},
        "frequency_penalty",
    ),
    "negative repetition_penalty": (
        "/v1/completions",
        {"repetition_penalty": -1},
        "repetition_penalty",
    ),
    "logit_bias a list": ("/v1/completions", {"logit_bias": [1]}, "logit_bias"),
    "logit_bias a bad token": (
        "/v1/completions",
        {"logit_bias": {"10000000": 1}},
        "logit_bias",
    ),
    "logit_bias too big": (
        "/v1/chat/completions",
        {"logit_bias": {"5": 101}},
        "logit_bias",
    ),
    # Refused rather than silently ignored:
    "best_of 2": ("/v1/completions", {"best_of": 2}, "best_of"),
    "suffix": ("/v1/completions", {"suffix": "end"}, "suffix"),
    "xtc": ("/v1/completions", {"xtc_probability": 0.5}, "xtc_probability"),
    "unknown response_format": (
        "/v1/chat/completions",
        {"response_format": {"type": "xml"}},
        "response_format",
    ),
    "min_tokens": ("/v1/completions", {"min_tokens": 3}, "min_tokens"),
    "ignore_eos": ("/v1/chat/completions", {"ignore_eos": True}, "ignore_eos"),
    "typical_p": ("/v1/completions", {"typical_p": 0.5}, "typical_p"),
}


def test_bad_or_unsupported_sampler_fields_are_400(server):
    wrong = []
    body = {"messages": CHATS[1], "prompt": "x", "max_tokens": 1}
    for name, (path, extra, param) in SAMPLER_400.items():
        status, reply = server.request("POST", path, {**body, **extra})
        err = reply.get("error", {}) if isinstance(reply, dict) else {}
        if status != 400 or not err.get("message"):
            wrong.append((name, status, reply))
        elif param is not None and err.get("param") != param:
            wrong.append((name, status, reply))
    assert not wrong, "\n".join(map(str, wrong))
    # Their neutral values are accepted.
    neutral = dict(
        top_k=0,
        min_p=0,
        best_of=1,
        suffix="",
        xtc_probability=0,
        min_tokens=0,
        ignore_eos=False,
        typical_p=1,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
    )
    status, r = server.request("POST", "/v1/completions", {**body, **neutral})
    assert status == 200, r
    chat = {**body, **neutral, "response_format": {"type": "text"}}
    for k in ("best_of", "suffix"):
        chat.pop(k)
    status, r = server.request("POST", "/v1/chat/completions", chat)
    assert status == 200, r
