"""mlx-lm's private names and internal fields (flashnorm_mlx/mlx_lm_compat.py),
one test each: if an mlx-lm upgrade changes one, its test fails naming the
mlx-lm version and the name. Reference: mlx-lm's own public API on the same
objects (its models, `initialize_rope`, `load_tokenizer`, `KVCache`)."""

import inspect

import mlx.core as mx
import pytest
import tiny
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from flashnorm_mlx import mlx_lm_compat as compat

VERSION = compat.version()


def changed(what: str) -> str:
    return f"mlx-lm {VERSION} changed {what}: update flashnorm_mlx/mlx_lm_compat.py"


def test_get_classes_gives_stock_model_classes():
    from mlx_lm.models import llama, qwen3

    for mt, module in (("llama", llama), ("qwen3", qwen3)):
        got = compat.stock_classes({"model_type": mt})
        assert got == (module.Model, module.ModelArgs), changed("utils._get_classes")


def test_download_takes_allow_patterns(monkeypatch):
    from mlx_lm import utils

    fn = getattr(utils, "_download", None)
    assert callable(fn), changed("utils._download (gone)")
    params = inspect.signature(fn).parameters
    assert "allow_patterns" in params, changed(f"utils._download{tuple(params)}")
    calls = []  # the adapter's call, without the network
    monkeypatch.setattr(utils, "_download", lambda *a, **k: calls.append((a, k)) or 7)
    assert compat.hub_download("org/repo", ["*.json"]) == 7
    assert calls == [(("org/repo",), {"allow_patterns": ["*.json"]})], calls


def test_a_name_mlx_lm_drops_fails_in_one_line_with_its_version(monkeypatch):
    from mlx_lm import utils

    monkeypatch.delattr(utils, "_get_classes")
    with pytest.raises(compat.MlxLmChanged) as e:
        compat.stock_classes({"model_type": "llama"})
    msg = str(e.value)
    assert f"mlx-lm {VERSION}" in msg and "_get_classes" in msg, msg
    assert "\n" not in msg, msg


LONGROPE = {
    "type": "longrope",
    "original_max_position_embeddings": 64,
    "short_factor": 1.0,
    "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
}


@pytest.mark.parametrize("dims", [16, 12], ids=["full", "partial"])
@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        LONGROPE,
    ],
    ids=["llama3", "yarn", "longrope"],
)
def test_scaled_rope_freqs_are_the_modules_periods(scaling, dims):
    """The angles of `_freqs` must be what the module rotates by, times the
    input factor it reports, on the dims it reports: RoPE at position 1 of unit
    pairs (1, 0) is scale * (cos, sin) of 1 / freqs, the other dims unchanged."""
    h = 16
    if scaling is LONGROPE:  # SuScaledRoPE's factors: one per rotated pair
        scaling = dict(scaling, long_factor=scaling["long_factor"][: dims // 2])
    rope = initialize_rope(dims, 10000.0, False, scaling, 512)
    got = compat.rope_freqs(rope)
    assert got is not None, changed(f"{type(rope).__name__}._freqs (gone)")
    freqs, scale, got_dims = got
    name = type(rope).__name__
    assert got_dims == dims, changed(f"{name}.dims ({got_dims}, built with {dims})")
    assert freqs.shape == (dims // 2,), changed(f"{name}._freqs shape")
    if name != "Llama3RoPE":  # YaRN's mscale, SuScaled's _scale: both past 1 here
        assert scale > 1.0, changed(f"{name}'s input scale ({scale})")
    half, rest = dims // 2, mx.arange(h - dims, dtype=mx.float32) + 2.0
    x = mx.concatenate([mx.ones((half,)), mx.zeros((half,)), rest])
    y = rope(mx.broadcast_to(x, (1, 1, 2, h)), offset=0)[0, 0, 1]
    angle = 1 / freqs.astype(mx.float32)
    want = mx.concatenate([scale * mx.cos(angle), scale * mx.sin(angle), rest])
    err = mx.abs(y - want).max().item()
    assert err < 1e-5, changed(f"{name}._freqs meaning ({err=:.2e})")


def test_rope_freqs_knows_only_mlx_lms_own_scaled_modules():
    from mlx_lm.models import rope_utils

    for name in compat._SCALED_ROPES:
        assert hasattr(rope_utils, name), changed(f"rope_utils.{name} (gone)")
    ntk = initialize_rope(16, 1e4, False, {"type": "dynamic", "factor": 2.0}, 512)
    assert compat.rope_freqs(ntk) is None


def test_tokenizer_wrapper_holds_the_hf_tokenizer(tmp_path):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.utils import load_tokenizer

    tiny.write_tokenizer(tmp_path)
    wrapper = load_tokenizer(tmp_path)
    assert isinstance(wrapper, TokenizerWrapper)
    inner = compat.inner_tokenizer(wrapper)
    assert inner is not wrapper, changed("TokenizerWrapper._tokenizer (gone)")
    assert inner.encode("hello") == wrapper.encode("hello"), changed(
        "TokenizerWrapper._tokenizer (not the tokenizer it wraps)"
    )


def test_a_tool_parser_is_inferred_and_set_as_mlx_lm_loads_one(tmp_path):
    """The parser mlx-lm's load infers from a template with Qwen's calls, set
    on a wrapper loaded without one: the same fields as one loaded with it."""
    import json

    from mlx_lm.utils import load_tokenizer

    tiny.write_tokenizer(tmp_path)
    wrapper = load_tokenizer(tmp_path)
    assert compat.infer_tool_parser(wrapper) is None
    qwen = "{% for t in tool_calls %}<tool_call>{{ tool_call.name }}{% endfor %}"
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": qwen})
    )
    loaded = load_tokenizer(tmp_path)
    wrapper.chat_template = qwen
    name = compat.infer_tool_parser(wrapper)
    assert name == "json_tools", changed(f"_infer_tool_parser ({name})")
    compat.set_tool_parser(wrapper, name)
    for field in ("tool_parser", "tool_call_start", "tool_call_end"):
        assert getattr(wrapper, field) == getattr(loaded, field), changed(field)
    assert wrapper.tool_call_start_tokens == loaded.tool_call_start_tokens


def test_kvcache_buffers_and_offset():
    """Fields read and replaced by the compiled step: the buffers grown by hand
    and the offset moved on must be what mlx-lm's next update writes after and
    returns."""
    c = KVCache()
    assert compat.kv_buffers(c)[:2] == (None, None), changed("KVCache before use")
    k = mx.random.normal((1, 2, 3, 4), key=mx.random.key(0))
    c.update_and_fetch(k, k + 1)
    keys, values, offset = compat.kv_buffers(c)
    assert offset == 3 and keys.shape[2] >= 3, changed(f"KVCache fields ({offset=})")
    assert mx.array_equal(keys[:, :, :3], k).item(), changed("KVCache.keys layout")
    pad = mx.zeros((1, 2, 5, 4))
    grown = [mx.concatenate([a[:, :, :3], pad], 2) for a in (keys, values)]
    compat.set_kv_buffers(c, *grown, 2)  # rewound one position
    step = mx.full((1, 2, 1, 4), 7.0)
    got_k, _ = c.update_and_fetch(step, step)
    assert (
        got_k.shape[2] == 3 and mx.array_equal(got_k[:, :, 2:], step).item()
    ), changed("KVCache.update_and_fetch after its buffers and offset were set")
    assert mx.array_equal(got_k[:, :, :2], k[:, :, :2]).item(), changed("KVCache.keys")
    assert c.offset == 3, changed(f"KVCache.offset ({c.offset} after one more step)")
    assert compat.kv_buffers(c)[0].shape[2] == 8, changed("KVCache capacity")


def test_llama4_attn_scale_is_ministral3s_per_position_query_scale():
    """1 + beta * log(1 + floor(pos / original)) for positions offset..offset+L-1,
    (L, 1) for an int offset, (B, 1, L, 1) for a (B,) array of them."""
    import math

    got = compat.llama4_attn_scale(4, 6, 0.5, 4)
    want = [1 + 0.5 * math.log(1 + (6 + i) // 4) for i in range(4)]
    assert got.shape == (4, 1), changed(f"_get_llama_4_attn_scale shape {got.shape}")
    assert mx.allclose(got[:, 0], mx.array(want)).item(), changed("its values")
    batched = compat.llama4_attn_scale(1, mx.array([3, 9]), 0.5, 4)
    assert batched.shape == (2, 1, 1, 1), changed("_get_llama_4_attn_scale (B,)")
    assert mx.allclose(
        batched.reshape(-1), mx.array([1.0, 1 + 0.5 * math.log(3)])
    ).item()


def test_gemma4_per_layer_inputs_are_stocks_on_a_model_holding_its_modules():
    """Stock's per-layer inputs of ids and of embeddings alone (the nearest
    tokens), from its two methods run on another module with its fields."""
    from types import SimpleNamespace

    from mlx_lm.models import gemma4_text

    cfg = tiny.gemma4_config("gemma4_e")
    stock = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(cfg)).model
    holder = SimpleNamespace(**{k: getattr(stock, k) for k in vars(stock)})
    for k, v in stock.children().items():
        setattr(holder, k, v)
    ids = mx.array([[3, 5, 250]])
    raw = stock.embed_tokens(ids)
    h = raw * stock.embed_scale
    want = stock._project_per_layer_inputs(h, stock._get_per_layer_inputs(ids))
    for inputs in (ids, None):
        got = compat.gemma4_per_layer_inputs(holder, inputs, raw, h)
        assert got.shape == (1, 3, cfg["num_hidden_layers"], 16), changed("shape")
        assert mx.array_equal(got, want).item(), changed("its per-layer inputs")
