"""The compiled decode step (flashnorm_mlx/decode.py).

References: the same model uncompiled (greedy tokens identical over 128 steps,
every tiny architecture and the embedded SmolLM2), stock mlx-lm's own class
(`stock_compiled` within 1e-5 of stock in float32, greedy identical), and a
chat of three turns on one prompt cache, compiled and not.
"""

import mlx.core as mx
import pytest
import tiny
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from flashnorm_mlx import decode
from flashnorm_mlx import kernels as K
from flashnorm_mlx.chat import ChatSession
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.models.blocks import Block

PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 180, 64, 11, 2]
CONFIGS = (
    [("llama", c, tiny.make_llama) for c in tiny.LLAMA_CONFIGS]
    + [("qwen", c, tiny.make_qwen) for c in tiny.QWEN_CONFIGS]
    + [("openelm", c, tiny.make_openelm) for c in tiny.OPENELM_CONFIGS]
)
EVERY_CONFIG = pytest.mark.parametrize(
    "make,cfg", [pytest.param(m, c, id=f"{a}-{c}") for a, c, m in CONFIGS]
)


def greedy(model, prompt, n):
    out = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(t) for t, _ in out]


def first_difference(a, b) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
    )


def compiled_ran(model) -> bool:
    """Did single-token steps go through a compiled function (the whole step,
    or, for caches it cannot serve, the blocks' parts)?"""
    step = model.__dict__.get("_decode_step")
    if step is not None and step.run.seen:
        return True
    parts = [l.__dict__.get("_parts") for l in model.layers if isinstance(l, Block)]
    return any(p and p["heads"].seen for p in parts)


def both(source, dtype=mx.float32):
    on, _ = build_model(source, "flashnorm", dtype=dtype, compile=True)
    off, _ = build_model(source, "flashnorm", dtype=dtype, compile=False)
    assert decode.is_compiled(on) and not decode.is_compiled(off)
    return on, off


@pytest.mark.parametrize("backend", [None, "metal", "cuda"])
def test_compiled_by_default_where_a_gpu_runs_the_model(tmp_path, monkeypatch, backend):
    """Not told, FlashNorm compiles its step where Metal or CUDA runs it (the
    host sets the pace there), not on the CPU; stock_compiled always, stock never."""
    source = read_source(str(tiny.make_llama(tmp_path, tokenizer=False)))
    monkeypatch.setattr(K, "gpu_backend", lambda: backend)
    compiled = {
        mode: decode.is_compiled(build_model(source, mode)[0])
        for mode in ("flashnorm", "stock", "stock_compiled")
    }
    assert compiled == {
        "flashnorm": backend is not None,
        "stock": False,
        "stock_compiled": True,
    }, compiled


@EVERY_CONFIG
def test_compiled_step_gives_the_uncompiled_greedy_text(tmp_path, make, cfg):
    on, off = both(read_source(str(make(tmp_path, cfg, tokenizer=False))))
    a, b = greedy(on, PROMPT, 128), greedy(off, PROMPT, 128)
    assert a == b, f"{cfg}: first difference at step {first_difference(a, b)}"
    assert compiled_ran(on) and not compiled_ran(off), cfg


def test_capacity_grows_in_buckets_and_stays_exact(tmp_path):
    """A prompt of 250 then 20 steps crosses the 256-position bucket: the step
    retraces on the larger buffer and the tokens stay the uncompiled ones."""
    on, off = both(read_source(str(tiny.make_llama(tmp_path, tokenizer=False))))
    prompt = [(7 * i + 3) % 256 for i in range(250)]
    assert greedy(on, prompt, 20) == greedy(off, prompt, 20)
    shapes = {sig[2][0][2] for sig in on._decode_step.run.seen}  # kv capacities
    assert shapes == {256, 512}, shapes


def test_embedded_model_compiled_and_uncompiled_agree_over_128_tokens():
    source = read_source(None)  # the embedded SmolLM2-135M, 4-bit as stored
    on, off = both(source)
    prompt = source.tokenizer.encode("The three primary colours are")
    a, b = greedy(on, prompt, 128), greedy(off, prompt, 128)
    print(source.tokenizer.decode(a))
    assert a == b
    assert compiled_ran(on)


def test_batched_decode_compiles_block_parts_and_stays_exact(tmp_path):
    """serve's continuous batching runs mlx-lm's BatchKVCache (left padding,
    per-sequence offsets), which the whole step cannot serve: the blocks'
    cache-free parts run compiled, with the uncompiled model's tokens."""
    from mlx_lm.generate import batch_generate

    from flashnorm_mlx.loading import load

    path = tiny.make_llama(tmp_path, "gqa_untied")
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    got = {}
    for compile in (True, False):
        model, tok = load(str(path), dtype=mx.float32, compile=compile)
        r = batch_generate(model, tok, prompts, max_tokens=24, return_token_ids=True)
        got[compile] = r.token_ids
        parts = [l.__dict__.get("_parts") for l in model.layers]
        assert all(p and p["heads"].seen for p in parts) == compile, compile
        assert "_decode_step" not in model.__dict__  # no whole step: batched cache
    assert got[True] == got[False]


def _teacher_forced(model, prompt, tokens):
    """Prompt logits, then one row per cached single-token step fed `tokens`."""
    cache = make_prompt_cache(model)
    rows = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for t in tokens:
        rows.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return mx.stack(rows).astype(mx.float32)


@EVERY_CONFIG
def test_stock_compiled_is_stock(tmp_path, make, cfg):
    """mlx-lm's own class given the compiled step: stock's logits (float32, 1e-5
    relative) and greedy tokens over 32 cached steps."""
    source = read_source(str(make(tmp_path, cfg, tokenizer=False)))
    stock, _ = build_model(source, "stock", dtype=mx.float32)
    compiled, _ = build_model(source, "stock_compiled", dtype=mx.float32)
    assert decode.is_compiled(compiled) and not decode.is_compiled(stock)
    tokens = greedy(stock, PROMPT, 32)
    a = _teacher_forced(stock, PROMPT, tokens[:-1])
    b = _teacher_forced(compiled, PROMPT, tokens[:-1])
    rel = (mx.abs(a - b).max() / mx.abs(a).max()).item()
    print(f"{cfg}: stock_compiled vs stock rel {rel:.2e}")
    assert rel < 1e-5, rel
    assert mx.argmax(b, axis=-1).tolist() == tokens
    if cfg != "mistral_sliding":  # rotating caches: no whole step for mlx-lm's
        assert compiled._decode_step.run.seen, cfg


def test_chat_of_three_turns_same_replies_compiled_and_not(tmp_path):
    """The prompt cache kept (and trimmed) across turns works compiled."""
    from flashnorm_mlx.loading import load

    path = tiny.make_llama(tmp_path, "gqa_untied")
    replies = {}
    for compile in (True, False):
        model, tok = load(str(path), dtype=mx.float32, compile=compile)
        session = ChatSession(model, tok, max_tokens=12)
        got = []
        for text in ("Hello there", "And then?", "Say it again"):
            stats = session.send(text)
            got.append((stats.reply, stats.reply_ids, stats.cached_tokens))
        replies[compile] = got
        assert compiled_ran(model) == compile
    assert replies[True] == replies[False]
    assert replies[True][1][2] > 0  # the second turn did reuse the cache


# --- kernels inside the compiled step, under a faked GPU backend -------------------

OPS = {
    "qkv_epilogue": K.epilogue,
    "residual": K.block_residual,
    "residual_norm": K.block_residual,
    "deferred_glu": K.glu,
    "decode_attention": K.attention,
}


@pytest.fixture
def fake_kernels(monkeypatch):
    """A GPU backend that is not there, each op's kernel a stand-in computing its
    twin's math (so it traces like a kernel launch would), recording whether it
    ran inside a trace; the twins, as the picker calls them, recorded apart."""
    monkeypatch.setattr(K._common, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv("FLASHNORM_KERNELS", raising=False)
    monkeypatch.setattr(K._common, "FAILED", {})
    K._common._first_use_checked.cache_clear()
    calls = {"kernel": [], "twin": []}
    for op, module in OPS.items():
        twin = getattr(module, f"{op}_ops")

        def kernel(*a, op=op, twin=twin):
            calls["kernel"].append((op, K._common._TRACING))
            return twin(*a)

        def picked_twin(*a, op=op, twin=twin):
            calls["twin"].append((op, K._common._TRACING))
            return twin(*a)

        monkeypatch.setattr(module, f"{op}_kernel", kernel)
        monkeypatch.setattr(module, f"{op}_ops", picked_twin)
    yield calls
    K._common._first_use_checked.cache_clear()


@pytest.mark.parametrize(
    "make,cfg",
    [(tiny.make_llama, "gqa_untied"), (tiny.make_openelm, "shared")],
    ids=["llama", "openelm"],
)
def test_kernels_survive_compilation(fake_kernels, tmp_path, make, cfg, capsys):
    """Each shape's first step checks every kernel variant eagerly; the trace that
    follows calls the kernels, never a twin in their place, and says nothing."""
    source = read_source(str(make(tmp_path, cfg, tokenizer=False)))
    model, _ = build_model(source, "flashnorm", dtype=mx.float32, compile=True)
    greedy(model, PROMPT, 6)
    traced = {op for op, tracing in fake_kernels["kernel"] if tracing}
    twins_traced = {op for op, tracing in fake_kernels["twin"] if tracing}
    assert traced == set(OPS), traced
    assert not twins_traced, f"twins ran in the trace instead of {twins_traced}"
    assert not K.failures() and "note:" not in capsys.readouterr().err
    assert model._decode_step.run.seen


def test_a_check_that_cannot_run_in_a_trace_switches_nothing_off(fake_kernels, capsys):
    """Under tracing an unchecked variant runs its twin, for that call only: no
    failure is recorded, and the next eager call checks and picks the kernel."""
    h, y = mx.ones((1, 1, 8)), mx.full((1, 1, 8), 0.5)
    traced = mx.compile(lambda h, y: K.residual(h, y, None, 1e-5))
    with K.tracing():  # a real trace: a check here could not evaluate
        out = traced(h, y)
    assert fake_kernels["twin"] == [("residual", True)], fake_kernels
    assert not K.failures() and capsys.readouterr().err == ""
    K.residual(h, y, None, 1e-5)  # eager: checked beside the twin, then kernel
    K.residual(h, y, None, 1e-5)
    assert [c for c in fake_kernels["kernel"] if not c[1]] == [("residual", False)] * 2
    mx.eval(out)


@pytest.mark.parametrize("cfg", ["gqa_untied", "mistral_sliding"])
def test_a_dropped_compiled_model_frees_at_once(tmp_path, cfg):
    """The model owns its compiled step (and its blocks their parts) without a
    reference cycle: bench and verify build several models, and a dropped one
    must free its weights then, not at the next garbage collection."""
    import gc
    import weakref

    source = read_source(str(tiny.make_llama(tmp_path, cfg, tokenizer=False)))
    model, _ = build_model(source, "flashnorm", dtype=mx.float32, compile=True)
    greedy(model, PROMPT, 4)
    assert compiled_ran(model)
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()
