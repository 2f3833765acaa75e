"""serve with a draft model or KV cache options: one request at a time
(docs/design.md section 3f). References: greedy ids from mlx-lm's
`generate_step` in this process, on `--mode stock` (mlx-lm's class) with the
same cache options, and without the draft."""

import threading

import pytest
import tiny
from serve_process import Server

PROMPT = "the quick brown fox jumps"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-draft")
    cfg = {**tiny.llama_config("gqa_untied"), "head_dim": 64}
    target = tiny.write_model(root / "target", cfg, tiny.llama_weights(cfg, 0))
    small = {**cfg, "num_hidden_layers": 1}
    draft = tiny.write_model(root / "draft", small, tiny.llama_weights(small, 1))
    return target, draft


def reference(path, mode: str, tokens: int, *, max_kv_size=None, **kv) -> str:
    """The greedy reply text to PROMPT: mlx-lm's generate_step on our build of
    `path` in `mode`, with `decoding.make_cache` and mlx-lm's KV settings."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from flashnorm_mlx import load
    from flashnorm_mlx.decode_options import make_cache

    model, tok = load(str(path), mode=mode, dtype=mx.float32)
    prompt = tok.encode(PROMPT)
    cache = make_cache(model, max_kv_size)
    steps = generate_step(
        mx.array(prompt), model, max_tokens=tokens, prompt_cache=cache, **kv
    )
    ids = [int(t) for t, _ in steps]
    ids = ids[: next((i for i, t in enumerate(ids) if t in tok.eos_token_ids), tokens)]
    return tok.decode(prompt + ids)[len(tok.decode(prompt)) :]


def complete(server, tokens: int) -> dict:
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    status, r = server.request("POST", "/v1/completions", body)
    assert status == 200, r
    return r


def test_a_draft_serves_the_greedy_text_one_request_at_a_time(pair):
    """Two requests at once, each with the draft: both get the greedy text
    without the draft; the log says unbatched and counts accepted tokens."""
    target, draft = pair
    want = reference(target, "flashnorm", 32)
    s = Server(str(target), "--dtype", "float32", "--draft-model", str(draft))
    try:
        answers = [None, None]

        def ask(i):
            answers[i] = complete(s, 32)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in answers:
            assert r["choices"][0]["text"] == want, (r, want)
            assert r["timings"]["batch_max"] == 1, r["timings"]
        again = complete(s, 32)  # from the prompt cache pool, draft layers too
        assert again["choices"][0]["text"] == want, again
        log = s.log()
        assert "--draft-model" in log and "one at a time, unbatched" in log, log
        assert log.count("draft ") >= 3 and " accepted, " in log, log
    finally:
        s.kill()


@pytest.mark.parametrize(
    "flags, kv",
    [
        (["--max-kv-size", "32"], dict(max_kv_size=32)),
        (
            ["--kv-bits", "8", "--quantized-kv-start", "16"],
            dict(kv_bits=8, kv_group_size=64, quantized_kv_start=16),
        ),
    ],
    ids=["rotating", "quantized"],
)
def test_kv_options_serve_stocks_text(pair, flags, kv):
    """48 tokens past the window / the quantization start: FlashNorm's answer
    is stock's (mlx-lm's class) with the same cache options, run in this
    process; the plain cache answers otherwise where the window cut."""
    target, _ = pair
    want = reference(target, "stock", 48, **kv)
    s = Server(str(target), "--dtype", "float32", *flags)
    try:
        r = complete(s, 48)
        assert r["choices"][0]["text"] == want, (r, want)
        assert "one at a time, unbatched" in s.log(), s.log()
    finally:
        s.kill()
    if "max_kv_size" in kv:
        assert reference(target, "stock", 48) != want, "the window changed nothing"
