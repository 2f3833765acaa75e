"""The engines (flashnorm_mlx/engine.py): every mode on the compiled step.

References: the same model on the eager engine (greedy tokens identical over
128 steps on every tiny architecture, over 32 with each step's log-probabilities
on the embedded SmolLM2), mlx-lm as users
run it (stock, stock_fused, nonorm's class and FlashNorm on the compiled engine:
stock within 1e-5 of it in float32, greedy identical), a chat of three turns on
one prompt cache, and, under a faked GPU backend, the traced step itself: one
`decode_attention` per layer and no other attention, whatever the class.
"""

import mlx.core as mx
import pytest
import tiny
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache
from tiny import PROMPT

from flashnorm_mlx import engine
from flashnorm_mlx import kernels as K
from flashnorm_mlx.jobs.conversation import ChatSession
from flashnorm_mlx.loading import MODES, build_model, read_source
from flashnorm_mlx.models.blocks import Block
from flashnorm_mlx.modes import FLASHNORM, NONORM, STOCK, STOCK_FUSED

ENGINE = {True: "compiled", False: "eager"}
EVERY_CONFIG = pytest.mark.parametrize("make,cfg", tiny.every_config())


def greedy(model, prompt, n):
    out = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(t) for t, _ in out]


def greedy_logprobs(model, prompt, n):
    """The greedy tokens and each step's log-probabilities, (n, vocab)."""
    steps = list(generate_step(mx.array(prompt), model, max_tokens=n))
    return [int(t) for t, _ in steps], mx.stack([p for _, p in steps])


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
    on, _ = build_model(source, FLASHNORM, dtype=dtype, engine="compiled")
    off, _ = build_model(source, FLASHNORM, dtype=dtype, engine="eager")
    assert engine.is_compiled(on) and not engine.is_compiled(off)
    return on, off


@pytest.mark.parametrize("backend", [None, "metal", "cuda"])
def test_compiled_by_default_where_a_gpu_runs_the_model(tmp_path, monkeypatch, backend):
    """Not told, every norm handling compiles its step where Metal or CUDA runs
    it (the host sets the pace there), and none does on the CPU."""
    source = read_source(str(tiny.make_llama(tmp_path, tokenizer=False)))
    monkeypatch.setattr(K, "gpu_backend", lambda: backend)
    compiled = {
        name: engine.engine_of(build_model(source, mode)[0])
        for name, mode in MODES.items()
    }
    want = "compiled" if backend else "eager"
    assert compiled == {name: want for name in MODES}, compiled


# Families no compiled function serves yet: recurrent states (ArraysCache) are
# outside the whole step, and their blocks have no cache-free parts (design 2k,
# 2p).
RUN_EAGER = (
    tiny.make_qwen3_5,
    tiny.make_qwen3_5_moe,
    tiny.make_qwen3_next,
    tiny.make_nemotron_h,
)
# Granite 4 without RoPE: its attention blocks have no cache-free parts either,
# and its Mamba blocks' caches keep the whole step out (design 2r).
RUN_EAGER_CONFIGS = ("granitemoehybrid_dense",)


@EVERY_CONFIG
def test_compiled_step_gives_the_uncompiled_greedy_text(tmp_path, make, cfg):
    on, off = both(read_source(str(make(tmp_path, cfg, tokenizer=False))))
    a, b = greedy(on, PROMPT, 64), greedy(off, PROMPT, 64)
    assert a == b, f"{cfg}: first difference at step {first_difference(a, b)}"
    eager = make in RUN_EAGER or cfg in RUN_EAGER_CONFIGS
    assert compiled_ran(on) == (not eager) and not compiled_ran(off), cfg


def test_capacity_grows_in_buckets_and_stays_exact(tmp_path):
    """A prompt of 250 then 20 steps crosses the 256-position bucket: the step
    retraces on the larger buffer and the tokens stay the uncompiled ones."""
    on, off = both(read_source(str(tiny.make_llama(tmp_path, tokenizer=False))))
    prompt = [(7 * i + 3) % 256 for i in range(250)]
    assert greedy(on, prompt, 20) == greedy(off, prompt, 20)
    shapes = {sig[2][0][2] for sig in on._decode_step.run.seen}  # kv capacities
    assert shapes == {256, 512}, shapes


def test_embedded_model_compiled_and_uncompiled_agree_over_32_steps():
    """The embedded SmolLM2-135M, 4-bit as stored: the same 32 greedy tokens on
    both engines, and every step's log-probabilities within float32 tolerance.
    32 steps show what 128 did at a quarter of the rows (~0.11 s each here):
    every step after the first runs the one trace of its KV bucket (256
    positions, the offset an array), and 5 + 128 positions never left the first
    bucket either; the tiny architectures run 128 steps, and the bucket's
    crossing is test_capacity_grows_in_buckets_and_stays_exact's."""
    source = read_source(None)
    on, off = both(source)
    prompt = source.tokenizer.encode("The three primary colours are")
    (a, la), (b, lb) = greedy_logprobs(on, prompt, 32), greedy_logprobs(off, prompt, 32)
    rel = (mx.abs(la - lb).max() / mx.abs(lb).max()).item()
    print(f"{source.tokenizer.decode(a)!r}: logprobs rel {rel:.2e}")
    assert a == b, f"first difference at step {first_difference(a, b)}"
    assert rel < tiny.f32_tol(), rel
    assert compiled_ran(on)


def test_batched_decode_compiles_block_parts_and_stays_exact(tmp_path):
    """serve's continuous batching runs mlx-lm's BatchKVCache (left padding,
    per-sequence offsets), which the whole step cannot serve: the blocks'
    cache-free parts run compiled, with the uncompiled model's tokens."""
    from mlx_lm.generate import batch_generate

    from flashnorm_mlx import load

    path = tiny.make_llama(tmp_path, "gqa_untied")
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    got = {}
    for compile in (True, False):
        model, tok = load(str(path), dtype=mx.float32, engine=ENGINE[compile])
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
def test_every_mode_on_the_compiled_engine_is_mlx_lm(tmp_path, make, cfg):
    """stock, stock_fused and FlashNorm on the compiled engine: mlx-lm's eager
    greedy tokens over 32 cached steps; stock within 1e-5 (float32, relative) of
    mlx-lm's logits, and mlx-lm's own class ran the whole compiled step."""
    source = read_source(str(make(tmp_path, cfg, tokenizer=False)))
    mlx_lm, _ = build_model(source, STOCK, dtype=mx.float32, engine="eager")
    tokens = greedy(mlx_lm, PROMPT, 32)
    want = _teacher_forced(mlx_lm, PROMPT, tokens[:-1])
    for mode in (STOCK, STOCK_FUSED, FLASHNORM):
        model, _ = build_model(source, mode, dtype=mx.float32, engine="compiled")
        assert engine.is_compiled(model), mode
        got = _teacher_forced(model, PROMPT, tokens[:-1])
        rel = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        print(f"{cfg} {mode}: compiled vs mlx-lm rel {rel:.2e}")
        assert mx.argmax(got, axis=-1).tolist() == tokens, (mode, cfg)
        assert greedy(model, PROMPT, 32) == tokens, (mode, cfg)
        if mode is STOCK:
            assert rel < 1e-5, rel
        # No whole step on other caches, nor on windows kept in the mask
        # (mlx-lm's mistral3 wrapper: sliding layers on plain KVCaches).
        if all(
            type(c) is KVCache for c in make_prompt_cache(model)
        ) and not engine._windowed_by_mask(model):
            assert model._decode_step.run.seen, (mode, cfg)


def test_chat_of_three_turns_same_replies_compiled_and_not(tmp_path):
    """The prompt cache kept (and trimmed) across turns works compiled."""
    from flashnorm_mlx import load

    path = tiny.make_llama(tmp_path, "gqa_untied")
    replies = {}
    for compile in (True, False):
        model, tok = load(str(path), dtype=mx.float32, engine=ENGINE[compile])
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
    """Each shape's first step checks every kernel form eagerly; the trace that
    follows calls the kernels, never a twin in their place, and says nothing."""
    source = read_source(str(make(tmp_path, cfg, tokenizer=False)))
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32, engine="compiled")
    greedy(model, PROMPT, 6)
    traced = {op for op, tracing in fake_kernels["kernel"] if tracing}
    twins_traced = {op for op, tracing in fake_kernels["twin"] if tracing}
    assert traced == set(OPS), traced
    assert not twins_traced, f"twins ran in the trace instead of {twins_traced}"
    assert not K.failures() and "note:" not in capsys.readouterr().err
    assert model._decode_step.run.seen


def test_a_check_that_cannot_run_in_a_trace_switches_nothing_off(fake_kernels, capsys):
    """Under tracing an unchecked form runs its twin, for that call only: no
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
    model, _ = build_model(source, FLASHNORM, dtype=mx.float32, engine="compiled")
    greedy(model, PROMPT, 4)
    assert compiled_ran(model)
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()


def _attention_without_sdpa(q, k, v, offset, scale=1.0):
    """decode_attention's math in plain ops, no MLX attention: so every
    scaled_dot_product_attention a traced step calls is the model's own."""
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q.astype(mx.float32) * scale) @ k.astype(mx.float32).swapaxes(-1, -2)
    s = mx.where(mx.arange(k.shape[2]) <= offset, s, -mx.inf)
    return (mx.softmax(s, axis=-1) @ v.astype(mx.float32)).astype(q.dtype)


@pytest.mark.parametrize("mode", MODES.values(), ids=str)
@pytest.mark.parametrize(
    "make,cfg",
    [
        (tiny.make_llama, "gqa_untied"),
        (tiny.make_qwen, "qwen3_untied"),
        (tiny.make_openelm, "shared"),
    ],
    ids=["llama", "qwen3", "openelm"],
)
def test_every_mode_traces_one_decode_attention_per_layer(
    fake_kernels, monkeypatch, tmp_path, make, cfg, mode
):
    """On the compiled engine the four norm handlings differ in the norms alone:
    each traced step calls `decode_attention` once per layer and no MLX
    attention, masked or not (mlx-lm's classes included), and keeps mlx-lm's
    greedy tokens."""
    attn, sdpa = [], []
    real_sdpa = mx.fast.scaled_dot_product_attention

    def kernel(*a):
        attn.append(K._common._TRACING)
        return _attention_without_sdpa(*a)

    def recorded_sdpa(*a, mask=None, **k):
        sdpa.append((K._common._TRACING, mask is not None))
        return real_sdpa(*a, mask=mask, **k)

    monkeypatch.setattr(K.attention, "decode_attention_kernel", kernel)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recorded_sdpa)
    source = read_source(str(make(tmp_path, cfg, tokenizer=False)))
    reference, _ = build_model(source, STOCK, dtype=mx.float32, engine="eager")
    want = greedy(reference, PROMPT, 5)
    model, _ = build_model(source, mode, dtype=mx.float32, engine="compiled")
    attn.clear(), sdpa.clear()
    got = greedy(model, PROMPT, 5)  # prefill, an eager first step, then one trace
    layers = len(model.layers)
    traced_sdpa = [masked for tracing, masked in sdpa if tracing]
    print(f"{mode}: {attn.count(True)} traced decode_attention, sdpa {traced_sdpa}")
    assert attn.count(True) == layers, (mode, attn, layers)
    assert traced_sdpa == [], f"{mode}: MLX attention in the trace {traced_sdpa}"
    assert model._decode_step.run.seen, mode
    if mode is not NONORM:  # the bound is not stock's function
        assert got == want, (mode, got, want)
