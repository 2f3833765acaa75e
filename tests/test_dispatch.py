"""Launches per decode step: the GPU's share of FlashNorm's decode speed.

Every kernel-launching primitive costs the GPU ~10 µs at batch-1 decode on Metal
and CUDA, and the host its encoding (docs/design.md section 4a). These tests count the graph of one
cached decode step on any build, with every mx.fast op and FlashNorm kernel as
one node, as a GPU runs them (`dispatch.gpu_like`), so a change that adds
launches fails here without a GPU. References: mlx-lm's own classes (stock) and the norm-removed
bound (nonorm) on the same weights.
"""

import io

import mlx.core as mx
import pytest
import tiny

from flashnorm_mlx import dispatch, kernels
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, NONORM, STOCK, STOCK_FUSED

# One FlashNorm block: qkv matmul, qkv_epilogue, 2 cache writes, attention,
# o_proj, residual, gate|up matmul, deferred_glu, down matmul, residual.
PER_BLOCK = 11
# Per step: the embedding gather, the first block's statistics, the head matmul.
PER_STEP = 3

MODELS = {
    "llama-untied": ("llama", "gqa_untied"),
    "llama-tied": ("llama", "mha_tied"),
    "llama-llama3-rope": ("llama", "head_dim_llama3"),
    "openelm-tied": ("openelm", "shared"),
    "gemma3-sliding": ("gemma3", "gemma3_tied"),  # post-norm residuals, GELU
    "openelm-untied": ("openelm", "odd_unshared"),
    "openelm-no-qk-norm": ("openelm", "no_qk_norm"),
    "mistral-sliding": ("llama", "mistral_sliding"),
    "qwen2-bias": ("qwen", "qwen2"),
    "qwen3-qk-norm": ("qwen", "qwen3_untied"),
    # 3/4 partial rotary with longrope's input factor (Phi-4-mini's RoPE), and
    # the factor alone: the fused epilogue, not the model's own RoPE module.
    "phi3-partial-longrope": ("phi3", "phi3_longrope"),
    "phi3-su-full": ("phi3", "phi3_su_full"),
}
DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("dispatch")
    out = {}
    for name, (arch, cfg) in MODELS.items():
        make = getattr(tiny, f"make_{arch}")
        out[name] = read_source(str(make(root / name, cfg, tokenizer=False)))
    return out


def layers(source) -> int:
    cfg = source.config
    return cfg.get("num_hidden_layers") or cfg["num_transformer_layers"]


def gpu_count(source, mode, dtype):
    model, _ = build_model(source, mode, dtype=dtype)
    with dispatch.gpu_like():
        return dispatch.count_dispatches(model)


# A sliding-window cache (mlx-lm's RotatingKVCache) adds its own ops while it
# fills, in every mode alike: those models are held to "fewer" only.
EXACT = [name for name in MODELS if "sliding" not in name]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", EXACT)
def test_flashnorm_step_launches_11_per_block(sources, name, dtype):
    src = sources[name]
    got = gpu_count(src, FLASHNORM, dtype)
    want = PER_BLOCK * layers(src) + PER_STEP
    assert got["dispatches"] == want, (
        f"{name} {dtype}: {got['dispatches']} launches per decode step, "
        f"budget {want} ({PER_BLOCK} x {layers(src)} blocks + {PER_STEP}): "
        f"{got['by_primitive']}"
    )


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("name", MODELS)
def test_flashnorm_launches_fewer_than_nonorm_and_stock(sources, name, dtype):
    st, nn_, fn = (
        gpu_count(sources[name], m, dtype)["dispatches"]
        for m in (STOCK, NONORM, FLASHNORM)
    )
    assert fn < nn_ < st, (name, dtype, {"flashnorm": fn, "nonorm": nn_, "stock": st})


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias", "qwen3-qk-norm"])
def test_stock_fused_saves_three_launches_a_block(sources, name):
    """q|k|v and gate|up as one matmul each: 5 matmuls become 2, the rest stock's."""
    src = sources[name]
    st = gpu_count(src, STOCK, mx.float32)["dispatches"]
    fu = gpu_count(src, STOCK_FUSED, mx.float32)["dispatches"]
    assert fu == st - 3 * layers(src), (name, st, fu)


STORED = {
    "llama-untied": ("llama", "gqa_untied"),
    "llama-tied": ("llama", "mha_tied"),
    "qwen2-bias": ("qwen", "qwen2"),
    "qwen3-qk-norm": ("qwen", "qwen3_untied"),
    "openelm-untied": ("openelm", "quantizable_untied"),
}


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("name", STORED)
def test_stored_quantized_step_launches_11_per_block(name, dtype, tmp_path):
    """A quantized checkpoint as stored: the same launches as the folded model,
    fewer than stock's on the same stored weights."""
    arch, cfg = STORED[name]
    make = getattr(tiny, f"make_{arch}")
    src = tiny.quantized(read_source(str(make(tmp_path, cfg, tokenizer=False))))
    model, config = build_model(src, FLASHNORM, dtype=dtype)
    assert config["flashnorm"]["norm_gains"] == "kernels", config["flashnorm"]
    with dispatch.gpu_like():
        got = dispatch.count_dispatches(model)
    # A quantized embedding gathers packed rows, scales and biases, then
    # dequantizes: 3 launches more than a float one (stock's alike).
    want = PER_BLOCK * layers(src) + PER_STEP + 3
    assert got["dispatches"] == want, (name, dtype, got["by_primitive"])
    stock = gpu_count(src, STOCK, dtype)["dispatches"]
    assert got["dispatches"] < stock, (got["dispatches"], stock)


def test_each_kernel_and_fast_op_counts_as_one_launch():
    """The counter itself, on hand-made steps: a kernel call is one node, views
    are apart, and the upstream work a kernel reads stays in the graph."""
    x = mx.random.normal((1, 1, 64))
    w = mx.random.normal((64, 64))
    mx.eval(x, w)

    def count(fn):
        with dispatch.gpu_like():
            out = fn()
        dot = io.StringIO()
        mx.export_to_dot(dot, *(out if isinstance(out, tuple) else (out,)))
        prims = dispatch._LABEL.findall(dot.getvalue())
        return sum(p not in dispatch.VIEWS for p in prims), prims

    # matmul -> residual kernel (3 outputs) -> rms_norm: 3 launches.
    n, prims = count(
        lambda: mx.fast.rms_norm(
            kernels.residual(x @ w, x, None, 1e-5)[0], None, 1e-5
        ).reshape(64)
    )
    assert n == 3, prims
    assert prims.count(dispatch.STUB_NODE) == 2 and "Matmul" in prims, prims
    assert "Reshape" in prims, prims  # counted, but as a view


def test_counts_on_this_build_see_the_real_graph(sources):
    """Without gpu_like the count is this build's own graph: on a CPU build
    mx.fast ops and kernel twins decompose, so it exceeds the GPU model."""
    model, _ = build_model(sources["llama-untied"], STOCK, dtype=mx.float32)
    here = dispatch.count_dispatches(model)
    with dispatch.gpu_like():
        gpu = dispatch.count_dispatches(model)
    assert here["views"] > 0 and gpu["dispatches"] > 0
    if not dispatch.has_gpu_kernels():
        assert here["dispatches"] > gpu["dispatches"], (here, gpu)
    # gpu_like is undone on exit: mx.fast and the picker are the real ones again.
    assert mx.fast.rms_norm.__name__ == "rms_norm"
    assert kernels._common.pick.__name__ == "pick"
