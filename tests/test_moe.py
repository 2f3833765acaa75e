"""FlashNorm Qwen3-MoE and Mixtral against mlx-lm's own classes on the same weights.

Tiny random models (tests/tiny.py), norm gains in [0.25, 4], untied heads,
top-2, routers with large weights, so the experts picked depend on the token
and a wrong router scale changes them:
- `make_qwen3_moe`: QK-norm gains random, 6 experts, softmax then top-k with
  the scores renormalized, layers 0 and 2 sparse and layer 1 dense
  (`mlp_only_layers`);
- `make_mixtral`: 5 experts in both layers (`block_sparse_moe`, Hugging
  Face's w1/w3/w2), top-k of the logits then their softmax. The experts every token picks are recorded on both sides
at every step and compared (docs/design.md section 2j).
"""

import family
import mlx.core as mx
import mlx.nn as nn
import pytest
import tiny
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny import PROMPT, rel

from flashnorm_mlx import fold
from flashnorm_mlx.jobs.checkpoint import convert
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.models import moe
from flashnorm_mlx.modes import FLASHNORM, STOCK, STOCK_FUSED

# model_type -> maker, layers with experts, the feed-forward's name, experts,
# the router's (bits, group) under mlx-lm's convert -q and ours, the router's
# and the experts' module names.
FAMILIES = {
    "qwen3_moe": (
        tiny.make_qwen3_moe,
        (0, 2),
        "mlp",
        6,
        (8, 64),
        "gate",
        "switch_mlp",
    ),
    "mixtral": (
        tiny.make_mixtral,
        (0, 1),
        "block_sparse_moe",
        5,
        (4, 32),
        "gate",
        "switch_mlp",
    ),
    "gpt_oss": (tiny.make_gpt_oss, (0, 1), "mlp", 4, (8, 64), "router", "experts"),
}


def fam(source):
    return FAMILIES[source.config["model_type"]]


def moe_of(model, source, i):
    return model.layers[i][fam(source)[2]]


def experts_of(model, source, i):
    return moe_of(model, source, i)[fam(source)[6]]


def router_of(model, source, i):
    return moe_of(model, source, i)[fam(source)[5]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def source(request, tmp_path_factory):
    make = FAMILIES[request.param][0]
    return read_source(str(make(tmp_path_factory.mktemp(request.param))))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return read_source(str(tiny.make_qwen3_moe(tmp_path_factory.mktemp("q3moe"))))


@pytest.fixture(scope="module")
def stock_q4(source, tmp_path_factory):
    """mlx-lm's own `convert -q` of the tiny model (its router at 8 bits, as
    its quant_predicate says), read back as a checkpoint."""
    return tiny.mlx_q4(source.name, tmp_path_factory.mktemp("q4") / "mlx-q4")


class Picks(nn.Module):
    """Records the expert indices (B, L, k) its experts module is called with."""

    def __init__(self, inner, log):
        super().__init__()
        self.inner = inner
        self._log = log

    def __call__(self, *args):
        self._log.append(mx.sort(args[-1], axis=-1))
        return self.inner(*args)


def record_picks(model, source):
    logs = {}
    for i in fam(source)[1]:
        mlp, name = moe_of(model, source, i), fam(source)[6]
        logs[i] = []
        mlp[name] = Picks(mlp[name], logs[i])
    return logs


def picks_differ(ls, lf) -> list:
    """(layer, call, token position) where the experts picked differ."""
    out = []
    for i in ls:
        for step, (a, b) in enumerate(zip(ls[i], lf[i])):
            bad = mx.any(a != b, axis=-1).reshape(-1).tolist()
            out += [(i, step, t) for t, x in enumerate(bad) if x]
    return out


def test_layers_experts_and_what_is_left_of_the_norms(qwen):
    stock, _ = build_model(qwen, STOCK, dtype=mx.float32)
    flash, _ = build_model(qwen, FLASHNORM, dtype=mx.float32)
    assert type(stock).__module__ == "mlx_lm.models.qwen3_moe"
    assert type(flash).__module__ == "flashnorm_mlx.models.qwen3_moe"
    kinds = [type(l.mlp).__name__ for l in flash.layers]
    assert kinds == ["SparseMoE", "MLP", "SparseMoE"], kinds
    assert [type(l.mlp).__name__ for l in stock.layers] == [
        "Qwen3MoeSparseMoeBlock",
        "MLP",
        "Qwen3MoeSparseMoeBlock",
    ]
    norms = [n for n, m in flash.named_modules() if type(m).__name__ == "RMSNorm"]
    assert norms == []  # untied head: every gain folded
    gu = flash.layers[0].mlp.switch_mlp.gate_up_proj.weight
    assert gu.shape == (6, 128, 64), gu.shape  # experts, gate|up rows, width


def test_prompt_and_32_cached_steps_and_every_expert_pick_match_stock(source):
    """Prefill, then 32 decode steps on stock's greedy tokens: every float32
    logit row within 1e-4 relative, and at every step, in every sparse layer,
    each token's top-2 experts are the ones stock picks. The routing depends
    on the input: many distinct pairs, every expert used."""
    stock, _ = build_model(source, STOCK, dtype=mx.float32, engine="eager")
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32, engine="eager")
    ls, lf = record_picks(stock, source), record_picks(flash, source)
    errs, _ = family.cached_errors(stock, flash)
    bad = picks_differ(ls, lf)
    first, n = fam(source)[1][0], fam(source)[3]
    assert len(ls[first]) == len(lf[first]) == 33
    assert not bad, f"experts differ from stock's at (layer, step, token): {bad}"
    assert max(errs) < tiny.f32_tol(), f"max rel logit diff {max(errs):.3e}: {errs}"
    picks = mx.concatenate([p.reshape(-1, 2) for p in ls[first]]).tolist()
    pairs = {tuple(p) for p in picks}
    assert len(pairs) >= n and {e for p in pairs for e in p} == set(range(n)), pairs


# The first compiled run of a process builds MLX's CPU kernels (~1 min here).
@pytest.mark.parametrize(
    "engine", ["eager", pytest.param("compiled", marks=pytest.mark.slow)]
)
def test_verify_float32_and_stock_quantized_as_stored(source, stock_q4, engine):
    """`verify`'s comparison: float32, and mlx-lm's own 4-bit checkpoint as
    stored (experts QuantizedSwitchLinear, router 8-bit; the gains in the
    kernels)."""
    r = compare(source, PROMPT, horizon=32, dtype=mx.float32, engine=engine)
    assert r["max_rel_logit_diff"] < tiny.f32_tol() and r["greedy_match"] == 32, r
    r = compare(stock_q4, PROMPT, horizon=32, engine=engine)
    assert r["quantized"] and r["dtype"] == "float32", r
    assert r["max_rel_logit_diff"] < tiny.f32_tol() and r["greedy_match"] == 32, r


def greedy(model, n=64):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("engine", ["eager", "compiled"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_64_greedy_tokens_identical_to_stock(source, stock_q4, quantized, engine):
    src = stock_q4 if quantized else source
    dtype = None if quantized else mx.float32
    stock, _ = build_model(src, STOCK, dtype=dtype, engine=engine)
    flash, _ = build_model(src, FLASHNORM, dtype=dtype, engine=engine)
    if quantized:
        sw = experts_of(flash, src, 0).gate_up_proj
        assert type(sw).__name__ == "QuantizedSwitchLinear", type(sw)
        assert router_of(flash, src, 0).bits == fam(src)[4][0]  # the checkpoint's
        assert "post_attention_layernorm" in flash.layers[0]  # gains in kernels
    want = greedy(stock)
    assert len(want) == 64 and greedy(flash) == want


def test_the_reference_sees_the_router_scale_and_each_experts_gain(source, monkeypatch):
    """What FlashNorm must get right shows far beyond the tolerance: drop the
    deferred scale on the router's logits (the softmax weights change, the
    picks too), or leave the gain out of one expert's gate and up."""
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    x = mx.array([PROMPT * 3])
    ref = stock(x)
    flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    assert rel(flash(x), ref) < tiny.f32_tol()
    with monkeypatch.context() as m:
        m.setattr(moe.kernels, "deferred_scale", lambda ms, dt: mx.ones_like(ms))
        assert rel(flash(x), ref) > 10 * tiny.f32_tol()
    last = fam(source)[1][-1]
    gain = source.weights[f"model.layers.{last}.post_attention_layernorm.weight"]
    sw = experts_of(flash, source, last).gate_up_proj
    w = sw.weight
    sw.weight = mx.concatenate([w[:3], w[3:4] / gain, w[4:]])  # expert 3 unfolded
    assert rel(flash(x), ref) > 10 * tiny.f32_tol()


def test_fold_twice_equals_fold_once_and_folds_router_and_experts(qwen):
    source = qwen
    once_w, once_c = fold.fold_norms(source.weights, source.config)
    twice_w, twice_c = fold.fold_norms(once_w, once_c)
    assert once_c == twice_c and once_w.keys() == twice_w.keys()
    assert all(mx.array_equal(once_w[k], twice_w[k]).item() for k in once_w)
    p = "model.layers.0"
    g = source.weights[f"{p}.post_attention_layernorm.weight"]
    for lin in ("mlp.gate", "mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj"):
        want = source.weights[f"{lin.join([p + '.', '.weight'])}"] * g
        assert mx.allclose(once_w[f"{p}.{lin}.weight"], want).item(), lin
    down = f"{p}.mlp.switch_mlp.down_proj.weight"
    assert mx.array_equal(once_w[down], source.weights[down]).item()


def test_convert_compat_loads_in_stock_mlx_lm(source, tmp_path):
    """`convert --compat` loads in stock mlx-lm; without --compat, `--mode
    stock` on the folded checkpoint restores the unit gains itself."""
    family.compat_and_stock_on_folded(
        source, tmp_path, "model.layers.0.post_attention_layernorm.weight"
    )


def test_perplexity_agrees_in_float32(source):
    from flashnorm_mlx.jobs.likelihood import default_text, perplexity

    r = perplexity(
        source, text=default_text()[:3000], seq_len=32, num_seqs=2, dtype=mx.float32
    )
    assert abs(r["diff_rel"]) < tiny.f32_tol(), r


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_convert_q_quantizes_every_expert_and_loads_in_mlx_lm(source, tmp_path, method):
    """-q: the experts' 3-D weights quantized (QuantizedSwitchLinear), the
    router at mlx-lm's 8 bits; the --compat checkpoint loads in mlx-lm, whose
    logits there equal ours on it; its error against float32 stock is of the
    size of stock's own 4-bit one (router logits this large flip picks at 4
    bits on either side)."""
    from mlx_lm.utils import load_model

    out = tmp_path / f"q4-{method}"
    convert(source, out, quantize=(4, 32), q_method=method, compat=True, progress=False)
    folded = read_source(str(out))
    ours, _ = build_model(folded, FLASHNORM, dtype=mx.float32)
    for i in fam(source)[1]:
        ex, router = experts_of(ours, source, i), router_of(ours, source, i)
        for lin in (ex.gate_up_proj, ex.down_proj):
            assert type(lin).__name__ == "QuantizedSwitchLinear", (i, type(lin))
        assert (router.bits, router.group_size) == fam(source)[4]
    assert folded.config["quantization"]["bits"] == 4
    # RTN is mx.quantize of the folded experts; GPTQ (each expert on the
    # Hessian of the rows routed to it) differs from it.
    last, ffn, ex = fam(source)[1][-1], fam(source)[2], fam(source)[6]
    key = f"model.layers.{last}.{ffn}.{ex}.up_proj"
    folded_w, _ = fold.fold_norms(source.weights, source.config)
    rtn_w = mx.quantize(folded_w[f"{key}.weight"], group_size=32, bits=4)[0]
    same = mx.array_equal(folded.weights[f"{key}.weight"], rtn_w).item()
    assert same == (method == "rtn"), (method, same)
    theirs, _ = load_model(out)
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    x = mx.array([PROMPT])
    assert rel(ours(x), theirs(x)) < tiny.f32_tol()
    stock_q, _ = build_model(source, STOCK, dtype=mx.float32, quantize=(4, 32))
    errs = {"flashnorm -q": rel(ours(x), ref(x)), "stock -q": rel(stock_q(x), ref(x))}
    assert errs["flashnorm -q"] < 1.5 * errs["stock -q"], errs


@pytest.mark.slow
def test_two_rank_tensor_parallel_matches_one_process_and_stock(
    source, stock_q4, tmp_path
):
    """A 2-rank `mlx.launch` (tests/distributed_child.py): FlashNorm and stock
    sharded (each expert's 64 hidden columns 32 a rank, router whole on both),
    float32 and mlx-lm's 4-bit checkpoint as stored (its down split on group
    boundaries),
    prompt and 16 cached greedy steps. Each as one process within 1e-5,
    sharded FlashNorm against stock in one process within 1e-4, greedy tokens
    identical."""

    import numpy as np
    import test_distributed

    cases = [
        {"name": f"{m}{q}", "model": src.name, "mode": m}
        for m in ("flashnorm", "stock")
        for q, src in (("", source), ("-q4", stock_q4))
    ]
    got, one, errs, secs = test_distributed.two_ranks_and_one(cases, tmp_path)
    to_stock = {}
    for q in ("", "-q4"):
        stock = one[f"stock{q}"][0]
        diff = np.abs(got[f"flashnorm{q}/logits"] - stock).max()
        to_stock[q or "float32"] = diff / np.abs(stock).max()
    print(f"2 ranks in {secs:.1f} s; vs one process {errs}, vs stock {to_stock}")
    assert max(errs.values()) < tiny.shard_tol(), errs
    assert max(to_stock.values()) < tiny.f32_tol(), to_stock


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_stock_fused_stacks_each_experts_gate_and_up_and_is_stock(
    source, stock_q4, quantized
):
    """stock_fused on the MoE layers: each expert's gate and up rows in one
    gather matmul (and the dense layer's and attention's as before); its
    logits are stock's, over a prompt long enough that mlx-lm sorts the rows
    by expert, and a decode step."""
    src = stock_q4 if quantized else source
    stock, _ = build_model(src, STOCK, dtype=mx.float32, engine="eager")
    fused, _ = build_model(src, STOCK_FUSED, dtype=mx.float32, engine="eager")
    sw = experts_of(fused, src, 0)
    assert "gate_up_stacked" in sw and sw.gate_up_stacked.weight.shape[:2] == (
        fam(src)[3],
        128,
    )
    if src.config["model_type"] == "qwen3_moe":
        assert "gate_up_stacked" in fused.layers[1].mlp  # the dense layer
    cs, cf = make_prompt_cache(stock), make_prompt_cache(fused)
    x = mx.array([PROMPT * 3])  # 36 tokens x top-2 >= 64 rows: sorted
    errs = [rel(fused(x, cache=cf), stock(x, cache=cs))]
    t = mx.array([[7]])
    errs.append(rel(fused(t, cache=cf), stock(t, cache=cs)))
    # OpenBLAS (blas.py) blocks the stacked matmuls unlike their parts: float32
    # rounding (up to 1.2e-5 seen; 1e-6 on the reference BLAS).
    assert max(errs) < tiny.f32_tol(), errs


def test_bench_counts_fewer_launches_and_nonorm_runs(source):
    from flashnorm_mlx.jobs import speed

    r = speed.run_bench(source, prompt_tokens=6, gen_tokens=3, trials=1)
    v = r["variants"]
    assert all(v[n]["logits_finite"] and v[n]["all_trials_finite"] for n in v), v
    assert v["nonorm"]["rms_norm_modules"] == 0, v["nonorm"]
    gpu = {n: v[n]["dispatches_per_token_gpu_model"] for n in v}
    print("launches per decode step:", gpu)
    # nonorm (norms gone, projections apart) and stock_fused (norms kept,
    # fused) each below stock, FlashNorm (both) below either. gpt-oss: below
    # stock and nonorm, above stock_fused (63 against 59 on the tiny model):
    # s goes between each matmul and its bias (router, experts' gate|up),
    # where stock's router bias rides in its matmul (docs/design.md 2j).
    if source.config["model_type"] == "gpt_oss":
        assert gpu["flashnorm"] < min(gpu["nonorm"], gpu["stock"]), gpu
    else:
        assert gpu["flashnorm"] < min(gpu["nonorm"], gpu["stock_fused"]), gpu
    assert max(gpu["nonorm"], gpu["stock_fused"]) < gpu["stock"], gpu


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "q4_stored"])
def test_generate_peaks_where_stock_does(tmp_path, quantized):
    """The whole `generate -m 4` process (tests/peak_child.py): FlashNorm at
    most 1.03x stock's peak on a tiny Qwen3-MoE (16 layers, width 256), its
    Hugging Face per-expert checkpoint (stacked at read) and mlx-lm's 4-bit
    one as stored. Not the 3-layer one: FlashNorm's first decode step peaks
    ~0.1 MB over stock's on a dense Qwen3 too (2.40 against 2.28 MB at width
    128), which is 3-6% of a model of 1-3 MB."""
    from mlx_lm.convert import convert as mlx_convert
    from test_load_memory import _generate_peak

    shape = dict(num_hidden_layers=16, hidden_size=256, head_dim=32, vocab_size=2048)
    path = tiny.make_qwen3_moe(tmp_path / "hf", **shape)
    if quantized:
        mlx_convert(str(path), str(tmp_path / "q4"), quantize=True, q_group_size=32)
        path = tmp_path / "q4"
    peaks = {m: _generate_peak([str(path)], m) for m in ("stock", "flashnorm")}
    print(f"generate peak {peaks}, x{peaks['flashnorm'] / peaks['stock']:.3f}")
    assert peaks["flashnorm"] <= 1.03 * peaks["stock"], peaks


# llama.cpp's qwen3moe tensor names (gguf-py constants, MODEL_ARCH.QWEN3MOE).
GGUF_MOE = {
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}


def write_qwen3moe_gguf(path, cfg, weights, qtype=None):
    """A qwen3moe GGUF as llama.cpp's converter writes it (experts stacked
    (experts, out, in), QK rows unpermuted), every 2-D and 3-D weight in
    `qtype` where given, by the `gguf` package (llama.cpp's own)."""
    import gguf
    import numpy as np
    from test_gguf import HF_TO_GGUF_GLOBAL, HF_TO_GGUF_LAYER, tiny_metadata

    meta = tiny_metadata(cfg, arch="qwen3moe")
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    meta["qwen3moe.expert_count"] = u32(cfg["num_experts"])
    meta["qwen3moe.expert_used_count"] = u32(cfg["num_experts_per_tok"])
    meta["qwen3moe.expert_feed_forward_length"] = u32(cfg["moe_intermediate_size"])
    tensors = {}
    for k, v in weights.items():
        module, _, suffix = k.rpartition(".")
        if module in HF_TO_GGUF_GLOBAL:
            name = HF_TO_GGUF_GLOBAL[module]
        else:
            _, _, layer, rest = module.split(".", 3)
            name = f"blk.{layer}.{GGUF_MOE.get(rest) or HF_TO_GGUF_LAYER[rest]}"
        tensors[f"{name}.{suffix}"] = np.array(v)
    float_path = path.with_suffix(".f32.gguf")
    mx.save_gguf(str(float_path), {k: mx.array(v) for k, v in tensors.items()}, meta)
    if qtype is None:
        return float_path
    r = gguf.GGUFReader(str(float_path))
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        t = f.types
        w.add_key_value(f.name, f.contents(), t[0], sub_type=t[1] if t[1:] else None)
    for t in r.tensors:
        data = np.array(t.data)
        if data.ndim >= 2 and data.shape[-1] % 32 == 0:
            w.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [None, "Q4_0"], ids=["f32", "q4_0"])
def test_llama_cpp_qwen3moe_gguf_runs_as_its_hf_checkpoint(tmp_path, qtype):
    """llama.cpp's qwen3moe layout holds Qwen3-MoE exactly (every layer sparse,
    top-k scores renormalized, as llama.cpp runs it): the float file reads back
    as the stacked Hugging Face tensors and FlashNorm on it matches stock on
    the folder; a Q4_0 file (experts 3-D Q4_0) runs as stored like stock."""
    import gguf
    import numpy as np

    folder = tiny.make_qwen3_moe(tmp_path / "hf", mlp_only_layers=[])
    src = read_source(str(folder))
    cfg = src.config
    kind = getattr(gguf.GGMLQuantizationType, qtype) if qtype else None
    path = write_qwen3moe_gguf(tmp_path / "m.gguf", cfg, src.weights, kind)
    got = read_source(str(path))
    assert got.config["model_type"] == "qwen3_moe", got.config
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        assert got.config[k] == cfg[k], k
    if qtype is None:
        assert sorted(got.weights) == sorted(src.weights)
        for k, v in src.weights.items():
            assert np.array_equal(np.array(got.weights[k]), np.array(v)), k
        ids = mx.array([PROMPT])
        ref, _ = build_model(src, STOCK, dtype=mx.float32)
        ours, _ = build_model(got, FLASHNORM, dtype=mx.float32)
        assert rel(ours(ids), ref(ids)) < tiny.f32_tol()
    else:
        assert got.weights["model.layers.0.mlp.switch_mlp.up_proj.scales"].ndim == 3
        r = compare(got, PROMPT, horizon=16, dtype=mx.float32)
        assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
        assert r["greedy_match"] == 16, r


def test_a_mixtral_gguf_is_refused_in_one_line(tmp_path, capsys):
    """llama.cpp writes Mixtral as `llama` with experts; its reader (ours)
    takes experts from qwen3moe files only: one line, exit 1."""
    from test_gguf import tiny_metadata

    from flashnorm_mlx.cli import main

    cfg = tiny.mixtral_config()
    meta = tiny_metadata(cfg)
    meta["llama.expert_count"] = mx.array(5, dtype=mx.uint32)
    path = tmp_path / "mixtral.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((300, 64))}, meta)
    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "qwen3moe only" in err, err
