"""Continuous batching, logprobs and the API key of `flashnorm-mlx serve`.

Batching runs mlx-lm's BatchGenerator on our models: here a fixed schedule of
requests joining and leaving is checked token for token, and logprobs within
1e-5, against each request run alone (mlx-lm's generate_step, int cache
offsets, no padding). Logprobs and the key are checked over HTTP on a tiny
Llama server, against a direct forward pass of the same model in this process.
"""

import mlx.core as mx
import numpy as np
import openai
import pytest
import tiny
from serve_process import Server

from flashnorm_mlx import load
from flashnorm_mlx.cli import main
from flashnorm_mlx.serve import API_KEY_ENV, bind_warning, key_matches
from flashnorm_mlx.serve.scheduler import make_seeded_sampler

KEY = "sk-test-0123456789"

MODELS = {
    "llama": lambda p: tiny.make_llama(p, "gqa_untied", tokenizer=False),
    "qwen3": lambda p: tiny.make_qwen(p, "qwen3_untied", tokenizer=False),
    "openelm": lambda p: tiny.make_openelm(p, "odd_unshared"),
    # Sliding-window layers: mlx-lm's BatchRotatingKVCache.
    "mistral": lambda p: tiny.make_llama(p, "mistral_sliding", tokenizer=False),
    # Sandwich norms, local layers on BatchRotatingKVCache.
    "gemma3": lambda p: tiny.make_gemma3(p, "gemma3_tied", tokenizer=False),
}
# A batch sums in another order than one request alone: batched attention
# (the rotating cache keeps its window in another layout) and an optimized BLAS
# (OpenBLAS, blas.py, blocks a matmul by its rows: 4.5e-5 seen). Float32 agrees
# to rounding; a request that read another's cache would be off by O(1).

# Prompt lengths 1-23, reply lengths 2-12 (some finish early), and the step at
# which each request joins: all at once (batch 1, 3 and 8), or mid-flight.
LENGTHS = [5, 13, 1, 23, 8, 3, 17, 10]
MAX_TOKENS = [12, 4, 10, 6, 12, 2, 9, 12]
SCHEDULES = {
    "alone": [0],
    "three": [0, 0, 0],
    "eight": [0] * 8,
    "joining": [0, 0, 1, 2, 2, 4, 5, 7],
}


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, size=k)] for k in LENGTHS[:n]]


def _alone(model, prompt, max_tokens):
    """(tokens, logprob rows) of one greedy request: mlx-lm's generate_step."""
    from mlx_lm.generate import generate_step

    out = [], []
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=make_seeded_sampler(0, 1, 0),
    )
    for token, lp in steps:
        out[0].append(int(token))
        out[1].append(np.array(lp.astype(mx.float32)))
    return out


def _batched(model, prompts, max_tokens, join_at, cached=None):
    """Run `prompts` through one BatchGenerator, request i joining at step
    join_at[i]; cached[i] (optional) is a KV cache already holding a prefix of
    prompt i, as the prompt cache hands one over. Returns each request's
    (tokens, logprob rows) and the largest batch decoded in one step."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=7
    )
    uids, out, biggest, step = {}, {}, 0, 0
    try:
        while step <= max(join_at) or gen._generation_batch or gen._prompt_batch.uids:
            for i, at in enumerate(join_at):
                if at == step:
                    c, done = (cached or {}).get(i, (None, 0))
                    (uid,) = gen.insert(
                        [prompts[i][done:]],
                        max_tokens=[max_tokens[i]],
                        caches=[c] if c else None,
                        all_tokens=[prompts[i][:done]],
                        samplers=[make_seeded_sampler(0, 1, 0)],
                    )
                    uids[uid] = i
            _, responses = gen.next()
            biggest = max(biggest, len(responses))
            for r in responses:
                toks, rows = out.setdefault(uids[r.uid], ([], []))
                toks.append(r.token)
                rows.append(np.array(r.logprobs.astype(mx.float32)))
            step += 1
            assert step < 200, "the schedule did not finish"
    finally:
        gen.close()
    return [out[i] for i in range(len(join_at))], biggest


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {name: make(root / name) for name, make in MODELS.items()}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", list(MODELS))
def test_batched_greedy_equals_each_request_alone(models, name, schedule):
    model, _ = load(str(models[name]), dtype=mx.float32)
    join_at = SCHEDULES[schedule]
    n = len(join_at)
    prompts, max_tokens = _prompts(n), MAX_TOKENS[:n]
    # One joiner arrives with a prompt-cache hit: its first 4 tokens prefilled.
    cached = {}
    if n == 8:
        from mlx_lm.models.cache import make_prompt_cache

        c = make_prompt_cache(model)
        model(mx.array(prompts[3][:4])[None], cache=c)
        cached[3] = (c, 4)
    got, biggest = _batched(model, prompts, max_tokens, join_at, cached)
    worst = 0.0
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        want = _alone(model, p, m)
        assert got[i][0] == want[0], (name, schedule, i, got[i][0], want[0])
        d = max(float(np.abs(a - b).max()) for a, b in zip(got[i][1], want[1]))
        worst = max(worst, d)
    print(f"{name} {schedule}: batch up to {biggest}, max |logprob diff| {worst:.2e}")
    # Batched for real: short prompts start decoding while long ones prefill.
    assert biggest >= {"alone": 1, "three": 3, "eight": 6, "joining": 5}[schedule]
    assert worst <= tiny.f32_tol(), worst


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("name", list(MODELS))
def test_half_precision_batches_stay_finite(models, name, dtype):
    model, _ = load(str(models[name]), dtype=dtype)
    join_at = SCHEDULES["joining"]
    got, _ = _batched(model, _prompts(8), MAX_TOKENS, join_at)
    bad = [
        i for i, (_, rows) in enumerate(got) if not np.isfinite(np.stack(rows)).all()
    ]
    assert not bad, f"{name} {dtype}: requests {bad} have non-finite logprobs"


# --- a tiny Llama server: logprobs and the API key ------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("serve-llama"), "gqa_untied")


@pytest.fixture(scope="module")
def server(llama_dir):
    # float32, the key from the environment variable
    s = Server(
        str(llama_dir), "--dtype", "float32", env={API_KEY_ENV: KEY}, api_key=KEY
    )
    yield s
    s.kill()


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The same model in this process: (model, tokenizer, log_softmax(ids))."""
    model, tok = load(str(llama_dir), dtype=mx.float32)

    def logprobs(ids):
        logits = model(mx.array(ids)[None])[0].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return model, tok, logprobs


def _greedy(logprobs, ids, n):
    """n greedy tokens by full forward passes (no cache): ids, their rows."""
    ids, rows = list(ids), []
    for _ in range(n):
        row = logprobs(ids)[-1]
        rows.append(row)
        ids.append(int(row.argmax()))
    return ids[len(ids) - n :], rows


def test_echo_scores_the_prompt_as_lm_eval_reads_it(server, reference):
    _, tok, logprobs = reference
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 256, size=14)]
    # lm-evaluation-harness's local-completions: token ids in a list, echo,
    # and max_tokens 0 (or 1: then the reply's token comes last).
    for max_tokens in (0, 1):
        r = server.client().completions.create(
            model="tiny",
            prompt=[prompt],
            max_tokens=max_tokens,
            echo=True,
            logprobs=5,
            temperature=0,
        )
        lp = r.choices[0].logprobs
        want = logprobs(prompt + _greedy(logprobs, prompt, max_tokens)[0])
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
        assert len(lp.token_logprobs) == len(prompt) + max_tokens, lp
        ids = prompt + _greedy(logprobs, prompt, max_tokens)[0]
        direct = [want[i - 1, ids[i]] for i in range(1, len(ids))]
        diff = np.abs(np.array(lp.token_logprobs[1:]) - direct).max()
        print(f"max_tokens {max_tokens}: max |logprob - direct| {diff:.2e}")
        assert diff <= 1e-4, (lp.token_logprobs, direct)
        for i, top in enumerate(lp.top_logprobs[1:], 1):
            # Tokens that decode to the same text share one key (OpenAI's shape).
            best = np.append(np.sort(want[i - 1])[::-1][:5], direct[i - 1])
            near = [np.abs(best - v).min() for v in top.values()]
            assert max(near) <= 1e-4 and abs(max(top.values()) - best[0]) <= 1e-4, (
                i,
                top,
                best,
            )
        # The text is the decoding of every token; each token's, its piece of it.
        assert r.choices[0].text == tok.decode(ids), (r.choices[0].text, ids)
        _pieces_of(r.choices[0].text, lp)


def _pieces_of(text, lp):
    """Tokens are consecutive pieces of the text, text_offset where each starts
    (a character split over tokens comes with the token that completes it)."""
    assert "".join(lp.tokens) == text, (lp.tokens, text)
    for token, at in zip(lp.tokens, lp.text_offset):
        assert text[at : at + len(token)] == token, (text, token, at)


def test_several_prompts_in_one_request_get_one_choice_each(server, reference):
    _, _, logprobs = reference
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 256, size=n)] for n in (6, 11, 2)]
    # As lm-evaluation-harness sends a batch of loglikelihood requests.
    r = server.client().completions.create(
        model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1
    )
    assert [c.index for c in r.choices] == [0, 1, 2], r.choices
    for p, c in zip(prompts, r.choices):
        want = logprobs(p)
        direct = [want[i - 1, p[i]] for i in range(1, len(p))]
        got = c.logprobs.token_logprobs
        assert got[0] is None and len(got) == len(p), got
        assert np.abs(np.array(got[1:]) - direct).max() <= 1e-4, (got, direct)
    assert r.usage.prompt_tokens == sum(map(len, prompts)), r.usage


def test_completion_logprobs_equal_a_direct_forward_pass(server, reference):
    _, tok, logprobs = reference
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 256, size=9)]
    ids, rows = _greedy(logprobs, prompt, 6)
    r = server.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=6, logprobs=3, temperature=0
    )
    lp = r.choices[0].logprobs
    _pieces_of(r.choices[0].text, lp)
    # What the prompt is followed by (its last character may be cut in two).
    text, before = tok.decode(prompt + ids), tok.decode(prompt).rstrip("\ufffd")
    assert before + r.choices[0].text == text, (r.choices[0].text, text)
    direct = [row[t] for row, t in zip(rows, ids)]
    diff = np.abs(np.array(lp.token_logprobs) - direct).max()
    print(f"max |logprob - direct| {diff:.2e}")
    assert diff <= 1e-4, (lp.token_logprobs, direct)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Up to 3 + the chosen one; fewer where tokens decode to the same text.
        assert chosen == max(top.values()) and 1 <= len(top) <= 4, (chosen, top)


def test_chat_logprobs_streamed_or_not(server, reference):
    _, tok, logprobs = reference
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids, rows = _greedy(logprobs, prompt, 5)
    ask = dict(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
    )
    client = server.client()
    r = client.chat.completions.create(**ask)
    content = r.choices[0].logprobs.content
    stop = next((i + 1 for i, t in enumerate(ids) if t in tok.eos_token_ids), 5)
    assert len(content) == stop, (content, ids)
    ended = ids[stop - 1] in tok.eos_token_ids
    pieces = "".join(e.token for e in content[: stop - ended])
    assert pieces == r.choices[0].message.content, (pieces, r.choices[0].message)
    for e, t, row in zip(content, ids, rows):
        assert e.bytes == list(e.token.encode()), e
        assert abs(e.logprob - row[t]) <= 1e-4, (e.logprob, row[t])
        assert len(e.top_logprobs) == 4, e
        assert e.logprob == max(x.logprob for x in e.top_logprobs), e
    streamed = [
        e
        for chunk in client.chat.completions.create(**ask, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in content
    ]


def test_batch_max_and_batched_answers_over_http(server):
    client = server.client()
    prompts = [[7 + i] * (3 + 4 * i) for i in range(4)]

    def ask(p):
        return client.completions.create(
            model="tiny", prompt=p, max_tokens=100, temperature=0, logprobs=0
        )

    alone = [ask(p) for p in prompts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, prompts))
    got = [r.model_extra["timings"]["batch_max"] for r in together]
    print("batch_max alone", [r.model_extra["timings"]["batch_max"] for r in alone])
    print("batch_max together", got)
    assert all(r.model_extra["timings"]["batch_max"] == 1 for r in alone)
    assert max(got) >= 2, got  # 4 on the embedded model (tests/test_serve.py)
    for a, b in zip(alone, together):
        assert a.choices[0].text == b.choices[0].text, (a, b)
        la, lb = (
            a.choices[0].logprobs.token_logprobs,
            b.choices[0].logprobs.token_logprobs,
        )
        assert np.abs(np.array(la) - np.array(lb)).max() <= 1e-5, (la, lb)


def test_each_request_keeps_its_own_settings_in_a_batch(server):
    """Seeded sampling, stop strings and max tokens per request, the same
    alone as in one batch with requests that set them otherwise."""
    client = server.client()
    asks = [
        dict(prompt="abcabc", temperature=1.0, top_p=0.9, seed=7, max_tokens=30),
        dict(prompt="xyz", temperature=0.7, seed=8, max_tokens=25),
        dict(prompt="hello", temperature=0, max_tokens=12),
        dict(prompt="q" * 9, temperature=0, max_tokens=3),
    ]
    alone = [client.completions.create(model="tiny", **a).choices[0].text for a in asks]
    # A stop string from the middle of the greedy answer cuts it there.
    text = alone[2]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2])
    asks[2]["stop"] = [stop]
    want = alone[:2] + [text[: text.index(stop)]] + alone[3:]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(
            pool.map(lambda a: client.completions.create(model="tiny", **a), asks)
        )
    got = [r.choices[0].text for r in together]
    print("batch_max", [r.model_extra["timings"]["batch_max"] for r in together])
    assert got == want, (got, want, stop)
    assert together[3].usage.completion_tokens <= 3, together[3].usage


BAD_LOGPROBS = {  # (path, body, param)
    "chat top_logprobs 21": (
        "/v1/chat/completions",
        {"logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    "chat top_logprobs without logprobs": (
        "/v1/chat/completions",
        {"top_logprobs": 2},
        "top_logprobs",
    ),
    "chat logprobs a number": ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    "completions logprobs 6": ("/v1/completions", {"logprobs": 6}, "logprobs"),
    # (completions' "logprobs": true is mlx_lm.server's shape, taken: test_serve_agents)
    "completions logprobs a string": ("/v1/completions", {"logprobs": "2"}, "logprobs"),
    "echo a string": ("/v1/completions", {"echo": "yes"}, "echo"),
    "max_tokens 0 without echo": ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    "several prompts streamed": (
        "/v1/completions",
        {"prompt": [[1, 2], [3]], "stream": True},
        "prompt",
    ),
    "65 prompts": ("/v1/completions", {"prompt": [[1]] * 65}, "prompt"),
    "an empty list of prompts": ("/v1/completions", {"prompt": []}, "prompt"),
    "a bad prompt among good ones": (
        "/v1/completions",
        {"prompt": ["a", [1, 10**9]]},
        "prompt",
    ),
}


def test_bad_logprobs_fields_are_400(server):
    wrong = []
    auth = {"Authorization": f"Bearer {KEY}"}
    for name, (path, extra, param) in BAD_LOGPROBS.items():
        body = {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}
        status, reply, _ = server.request_auth("POST", path, {**body, **extra}, auth)
        err = reply.get("error", {})
        if status != 400 or err.get("param") != param or not err.get("message"):
            wrong.append((name, status, reply))
    assert not wrong, "\n".join(map(str, wrong))


def test_api_key_is_required_everywhere_but_health(server):
    malformed = [
        None,  # no header
        f"Bearer {KEY[:-1]}x",  # wrong key, same length
        f"Bearer {KEY}0",  # another length
        "Bearer short",
        f"Basic {KEY}",
        KEY,  # no scheme
        "Bearer",
        "Bearer ",
    ]
    wrong = []
    for header in malformed:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions")]:
            headers = {"Authorization": header} if header is not None else {}
            body = {"prompt": "hi", "max_tokens": 1} if method == "POST" else None
            status, reply, auth = server.request_auth(method, path, body, headers)
            err = reply.get("error") if isinstance(reply, dict) else None
            ok = (
                status == 401
                and auth == "Bearer"
                and isinstance(err, dict)
                and set(err) == {"message", "type", "param", "code"}
                and err["code"] == "invalid_api_key"
            )
            if not ok:
                wrong.append((header, method, path, status, reply))
    assert not wrong, "\n".join(map(str, wrong))
    status, health, _ = server.request_auth("GET", "/health")
    assert status == 200 and health["status"] == "ok", health
    with pytest.raises(openai.AuthenticationError):
        server.client(key="not-the-key").models.list()
    r = server.client().completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1, r
    assert "Traceback" not in "\n".join(server.lines)


def test_key_matching_and_the_warning():
    assert key_matches(f"Bearer {KEY}", KEY) and key_matches(f"bearer  {KEY} ", KEY)
    for h in (None, "", f"Bearer {KEY}x", f"Token {KEY}", "Bearer", f"{KEY}"):
        assert not key_matches(h, KEY), h
    w = bind_warning("0.0.0.0")
    assert "no authentication" in w and API_KEY_ENV in w and "--api-key" in w, w
    assert bind_warning("0.0.0.0", KEY) is None


def test_empty_api_key_is_one_line(capsys, monkeypatch):
    rc = main(["serve", "--api-key", " ", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "API key" in err[0], (rc, err)
    monkeypatch.setenv(API_KEY_ENV, "")
    rc = main(["serve", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and API_KEY_ENV in err[0], (rc, err)
    rc = main(["serve", "--prefill-step-size", "0"])  # would never prefill
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--prefill-step-size" in err[0], (rc, err)
