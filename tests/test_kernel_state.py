"""Each kernel gets its input arrays under the right names, and the kernels' host
caches hold no stale or foreign entry (docs/design.md section 3c).

Reference: the arguments themselves. A recording kernel factory stands in for
`_common.make_kernel`, so these run on any build, GPU or not.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

from flashnorm_mlx import kernels as K


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
    inv = K.epilogue.rope_inv_freq(nn.RoPE(h), h)
    kw = dict(bias=bias) if mode == "bias" else {}
    if mode == "qk_norm":
        kw = dict(q_gain=qg, k_gain=kg)
    offset = mx.array([2, 4], mx.int32)
    K.epilogue.qkv_epilogue_kernel(qkv, ms, offset, K.Epilogue(hq, hkv, inv, **kw))
    got = _named(recorder)
    assert mx.array_equal(got["offset"], offset), got["offset"]  # a reshaped view
    want = dict(qkv=qkv, ms=ms, offset=got["offset"], inv_freq=inv, **kw)
    _check(got, want)
