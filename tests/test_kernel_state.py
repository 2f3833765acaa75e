"""Each kernel gets its input arrays under the right names, and the kernels' host
caches hold no stale or foreign entry (docs/design.md section 3c).

Reference: the arguments themselves. A recording kernel factory stands in for
`_common.make_kernel`, so these run on any build, GPU or not.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
import tiny

from flashnorm_mlx import kernels as K
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK


class Recorder:
    """`_common.make_kernel` that records each launch's names and arrays and
    returns zero outputs of the shapes the launch asks for."""

    def __init__(self):
        self.calls = []

    def __call__(self, name, body, inputs, outputs, **flags):
        names = tuple(inputs)

        def launch(inputs=None, output_shapes=(), output_dtypes=(), **_):
            assert len(inputs) == len(names), (name, names, len(inputs))
            self.calls.append((name, dict(zip(names, inputs))))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return launch


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()  # a new factory object: the plans' caches miss for it
    monkeypatch.setattr(K._common, "make_kernel", rec)
    return rec


def _named(recorder):
    assert len(recorder.calls) == 1, recorder.calls
    return recorder.calls[0][1]


def _check(got: dict, want: dict, const=("params",)):
    """Every name bound to the very array given for it; besides them only the
    kernel's constants (`const`)."""
    wrong = sorted(n for n, a in want.items() if got.get(n) is not a)
    assert not wrong, f"names bound to the wrong arrays: {wrong} (got {sorted(got)})"
    assert set(got) == set(want) | set(
        const
    ), f"inputs {sorted(got)}, want {sorted(want)}"


def _arrays(*shapes, dtype=mx.float32):
    k = mx.random.split(mx.random.key(len(shapes)), len(shapes))
    return [mx.random.normal(s, key=kk).astype(dtype) for s, kk in zip(shapes, k)]


def test_kernel_inputs_pairs_names_with_arrays_and_drops_none():
    a, b = mx.array([1.0]), mx.array([2.0])
    names, arrays = K._common.kernel_inputs(("a", a), ("gone", None), ("b", b))
    assert names == ("a", "b") and arrays[0] is a and arrays[1] is b


@pytest.mark.parametrize("with_y", [True, False])
@pytest.mark.parametrize("with_gain", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_residual_inputs_by_name(recorder, with_y, with_gain, norm):
    h, y, ms_y, gain = _arrays((2, 3, 64), (2, 3, 64), (2, 3, 1), (64,))
    y, ms_y = (y, mx.abs(ms_y) + 1) if with_y else (None, None)
    gain = gain if with_gain else None
    fn = (
        K.block_residual.residual_norm_kernel
        if norm
        else K.block_residual.residual_kernel
    )
    fn(h, y, ms_y, 1e-5, gain)
    want = {"h": h, "y": y, "ms_y": ms_y, "gain": gain}
    _check(_named(recorder), {n: a for n, a in want.items() if a is not None})


@pytest.mark.parametrize("with_gain", [True, False])
def test_post_residual_inputs_by_name(recorder, with_gain):
    h, y, ms_y, post_gain, gain = _arrays(
        (1, 2, 32), (1, 2, 32), (1, 2, 1), (32,), (32,)
    )
    gain = gain if with_gain else None
    K.post_norm.post_residual_kernel(h, y, ms_y, post_gain, 1e-6, gain)
    want = dict(h=h, y=y, ms_y=ms_y, post_gain=post_gain, gain=gain)
    _check(_named(recorder), {n: a for n, a in want.items() if a is not None})


def test_glu_and_attention_inputs_by_name(recorder):
    gate_up, ms = _arrays((1, 2, 16), (1, 2, 1))
    K.glu.deferred_glu_kernel(gate_up, ms)
    _check(_named(recorder), dict(gate_up=gate_up, ms=ms), const=())
    recorder.calls.clear()
    q, k, v = _arrays((1, 4, 1, 8), (1, 2, 6, 8), (1, 2, 6, 8))
    offset = mx.array([5], mx.int32)
    K.attention.decode_attention_kernel(q, k, v, offset, 0.5)
    _check(_named(recorder), dict(q=q, k=k, v=v, offset=offset), const=("scale",))


@pytest.mark.parametrize("mode", ["llama", "bias", "qk_norm"])
def test_epilogue_inputs_by_name(recorder, mode):
    hq, hkv, h = 2, 1, 8
    width = (hq + 2 * hkv) * h
    qkv, ms, bias, qg, kg = _arrays((1, 3, width), (1, 3, 1), (width,), (h,), (h,))
    ms = mx.abs(ms) + 1
    angles = K.rope_angles(nn.RoPE(h), h)
    inv = angles.inv_freq
    kw = dict(bias=bias) if mode == "bias" else {}
    if mode == "qk_norm":
        kw = dict(q_gain=qg, k_gain=kg)
    offset = mx.array([2, 4], mx.int32)
    K.epilogue.qkv_epilogue_kernel(qkv, ms, offset, K.Epilogue(hq, hkv, angles, **kw))
    got = _named(recorder)
    assert mx.array_equal(got["offset"], offset), got["offset"]  # a reshaped view
    want = dict(qkv=qkv, ms=ms, offset=got["offset"], inv_freq=inv, **kw)
    _check(got, want)


# --- the host caches: state on what owns it, never another model's or stale ---


def _qk_norms(model):
    for layer in model.layers:
        yield layer.self_attn.q_norm
        yield layer.self_attn.k_norm


def _scale_qk_gains(models, factor):
    for m in models:
        for norm in _qk_norms(m):
            norm.weight = norm.weight * factor


def _rel(a, b):
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def test_epilogue_gains_follow_weights_and_stay_per_model(tmp_path):
    """Reference: stock mlx-lm Qwen3 on the same weights. Two FlashNorm models
    with different QK-norm gains, called in turn, each match their own stock;
    and after one model's gains are replaced, it matches its stock again (the
    twins' RoPE-with-gain factors live on each attention's `Epilogue`)."""
    source = read_source(str(tiny.make_qwen(tmp_path, "qwen3_untied")))
    flash_a, flash_b = (
        build_model(source, FLASHNORM, dtype=mx.float32)[0] for _ in "ab"
    )
    stock_a, stock_b = (build_model(source, STOCK, dtype=mx.float32)[0] for _ in "ab")
    factor = mx.random.uniform(
        0.3, 3.0, (flash_a.layers[0].self_attn.q_norm.weight.size,)
    )
    _scale_qk_gains([flash_b, stock_b], factor)
    x = mx.array([[5, 17, 99, 3, 250, 42, 7]])
    tol = tiny.f32_tol()
    for step in range(2):  # in turn: a model must never read the other's state
        errs = {"a": _rel(flash_a(x), stock_a(x)), "b": _rel(flash_b(x), stock_b(x))}
        assert max(errs.values()) < tol, f"call {step}: rel errors {errs} > {tol:.1e}"
    assert _rel(stock_a(x), stock_b(x)) > 100 * tol  # the gains do matter
    _scale_qk_gains([flash_a, stock_a], 1 / factor)  # a's gains replaced
    err = _rel(flash_a(x), stock_a(x))
    assert err < tol, f"after new gains: rel error {err:.2e} > {tol:.1e} (stale?)"


def test_rope_tables_memo_hits_only_its_own_keys():
    inv = K.rope_angles(nn.RoPE(8), 8)
    other = K.rope_angles(nn.RoPE(8, base=500.0), 8)
    # The same angle array with other rotated dims or factor makes other tables.
    fewer = K.RopeAngles(inv.inv_freq[:2], 4)
    scaled = K.RopeAngles(inv.inv_freq, 8, 1.5)
    tables = K.epilogue._LastTables()
    first = tables(300, 2, inv, 8)
    assert tables(int("300"), 2, inv, 8)[0] is first[0]  # an equal int offset hits
    assert tables(300, 2, K.rope_angles(nn.RoPE(8), 8), 8)[0] is first[0]  # shared
    for args in (
        (301, 2, inv, 8),
        (300, 3, inv, 8),
        (300, 2, other, 8),
        (300, 2, fewer, 8),
        (300, 2, scaled, 8),
        (300, 2, inv, 12),  # a wider head: 4 more pass-through dims
    ):
        got = tables(*args)
        want = K.epilogue._compute_rope_tables(*args)
        assert all(mx.array_equal(g, w).item() for g, w in zip(got, want)), args
    pos = mx.array([3, 9], mx.int32)
    held = tables(pos, 1, inv, 8)
    assert tables(pos, 1, inv, 8)[0] is held[0]
    again = tables(mx.array([4, 9], mx.int32), 1, inv, 8)  # another array: recomputed
    assert not mx.array_equal(again[0], held[0]).item()


def test_picking_is_state_the_picker_reads():
    """`picking` must reach callers that hold `pick` itself, and end with its block."""
    pick = K._common.pick
    kernel, ops = (lambda: "kernel"), (lambda: "ops")
    before = pick("residual", kernel, ops)
    with K.picking(lambda op, k, o: k):
        assert pick("residual", kernel, ops) is kernel
        with K.picking(lambda op, k, o: o):
            assert pick("residual", kernel, ops) is ops
        assert pick("residual", kernel, ops) is kernel
    assert pick("residual", kernel, ops) is before
