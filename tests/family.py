"""What the per-family test files (tests/test_glm4_moe.py and its siblings)
share: module fixtures over a family's tiny configs, greedy tokens, and the
checks that are one check with other names and keys.

Each test stays in its family's file, where a reader of that family looks:
its name, docstring and parametrization there, its body a call here with the
family's parts (a config, a weight's key, a bound) as arguments.
"""

import mlx.core as mx
import pytest
import tiny
from mlx_lm.generate import generate_step
from tiny import PROMPT, rel

from flashnorm_mlx import fold
from flashnorm_mlx.jobs.checkpoint import convert
from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK


def fixtures(make, names):
    """`folder, source, stock_q4 = family.fixtures(make, NAMES)`: module
    fixtures (pytest finds them under these names in the file that assigns
    them): `make(path, name)`'s folder for each name, that folder read back,
    and mlx-lm's own `convert -q` of it read back as stored (where a router
    stays float or goes to 8 bits: mlx-lm's quant_predicate, as it ships)."""

    @pytest.fixture(scope="module", params=list(names))
    def folder(request, tmp_path_factory):
        return make(tmp_path_factory.mktemp(request.param), request.param)

    @pytest.fixture(scope="module")
    def source(folder):
        return read_source(str(folder))

    @pytest.fixture(scope="module")
    def stock_q4(folder, tmp_path_factory):
        return tiny.mlx_q4(folder, tmp_path_factory.mktemp("q4") / "mlx-q4")

    return folder, source, stock_q4


def sources(make):
    """`_source = family.sources(make)`: `_source(tmp_path, name, **over)`,
    `make`'s folder for `name` under tmp_path, read back."""

    def _source(tmp_path, name, **over):
        return read_source(str(make(tmp_path / name, name, **over)))

    return _source


def greedy(model, n=64):
    """`n` greedy tokens of `model` after tiny.PROMPT (mlx-lm's generate_step)."""
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


def verify(source, engine, stored=None, stored_tol=None):
    """`verify`'s comparison (a prompt and 32 cached steps against mlx-lm's
    class) in float32 within tiny.f32_tol(), and on `stored` (a 4-bit
    checkpoint as stored) within `stored_tol` (tiny.f32_tol() unless given)."""
    r = compare(source, PROMPT, horizon=32, dtype=mx.float32, engine=engine)
    print(engine, "float32", r["max_rel_logit_diff"])
    assert r["max_rel_logit_diff"] < tiny.f32_tol() and r["greedy_match"] == 32, r
    if stored is None:
        return
    r = compare(stored, PROMPT, horizon=32, engine=engine)
    print(engine, "as stored", r["max_rel_logit_diff"])
    assert r["max_rel_logit_diff"] < (stored_tol or tiny.f32_tol()), r
    assert r["greedy_match"] == 32, r


def greedy_is_stocks(src, quantized, linear, engines=("eager", "compiled"), few=4):
    """64 greedy tokens of FlashNorm on each of `engines` equal stock's (eager)
    on `src`, float32 or (`quantized`) as stored, where `linear(flash)` is then
    a QuantizedLinear; stock's text has `few` distinct tokens or more (a text
    that shows a wrong step; None: not asked). Returns (stock, flash)."""
    dtype = None if quantized else mx.float32
    stock, _ = build_model(src, STOCK, dtype=dtype, engine="eager")
    want = greedy(stock)
    got = {}
    for engine in engines:
        flash, _ = build_model(src, FLASHNORM, dtype=dtype, engine=engine)
        if quantized:
            proj = linear(flash)
            assert type(proj).__name__ == "QuantizedLinear", type(proj)
        got[engine] = greedy(flash)
    if few is not None:
        assert len(set(want)) >= few, want
    same = got == dict.fromkeys(engines, want)
    assert len(want) == 64 and same, (len(want), want, got)
    return stock, flash


def record_picks(model, path):
    """tests/test_moe.py's Picks on every layer whose `path` (e.g.
    "mlp.switch_mlp", the experts' module under the layer) is there:
    {layer: picks}, each call's experts."""
    from test_moe import Picks

    *parents, name = path.split(".")
    logs = {}
    for i, layer in enumerate(model.layers):
        owner = layer
        for p in parents:
            owner = owner.get(p) if isinstance(owner, dict) else None
        if not isinstance(owner, dict) or name not in owner:
            continue
        logs[i] = []
        setattr(owner, name, Picks(owner[name], logs[i]))
    return logs


def differ(ls, lf) -> list:
    """(layer, call) where two Picks logs' experts differ."""
    return [
        (i, step)
        for i in ls
        for step, (a, b) in enumerate(zip(ls[i], lf[i]))
        if not mx.array_equal(a, b).item()
    ]


def picks_are_stocks(ls, lf, k):
    """Stock's and FlashNorm's Picks logs: the same layers, the prompt and 32
    steps or more each, every call's experts equal; the prompt's top-`k`
    picks vary with the token (3 distinct sets or more)."""
    assert ls and set(ls) == set(lf), (ls, lf)
    assert all(len(ls[i]) == len(lf[i]) >= 32 for i in ls), ls  # prompt + steps
    bad = differ(ls, lf)
    assert not bad, bad
    first = next(iter(ls.values()))[0].reshape(-1, k).tolist()
    assert len({tuple(p) for p in first}) >= 3, first  # routing reads the input


def breaker(monkeypatch, source, x):
    """`err = family.breaker(monkeypatch, source, x)`: `err(patch, built)`,
    FlashNorm's float32 logits on `x` relative to stock's, built with
    `patch(m)` (a monkeypatch context) in place and `built(model)` then."""
    want = build_model(source, STOCK, dtype=mx.float32)[0](x)

    def err(patch=lambda m: None, built=lambda model: None):
        with monkeypatch.context() as m:
            patch(m)
            flash, _ = build_model(source, FLASHNORM, dtype=mx.float32)
            built(flash)
            return rel(flash(x), want)

    return err


def quantized_names(model) -> list:
    return [
        n for n, m in model.named_modules() if type(m).__name__ == "QuantizedLinear"
    ]


def convert_q_loads_in_mlx_lm(source, tmp_path, key, methods=("rtn", "gptq"), **kw):
    """`convert -q` at 8 bits by each of `methods`, --compat: RTN's `key` is
    mx.quantize of the folded weight, GPTQ's is not; a module named ...`linear`
    is a QuantizedLinear in ours; `stored` {key: present} of the checkpoint;
    mlx-lm loads it and its logits there equal ours; ours (and stock's own
    8-bit, `stock8`) within `bound` relative of float32 stock. Returns errs."""
    from mlx_lm.utils import load_model

    linear, stored = kw.get("linear"), kw.get("stored", {})
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    x = mx.array([PROMPT])
    folded_w, _ = fold.fold_norms(source.weights, source.config)
    rtn_w = mx.quantize(folded_w[key], group_size=32, bits=8)[0]
    errs = {}
    for method in methods:
        out = tmp_path / f"q8-{method}"
        convert(
            source, out, quantize=(8, 32), q_method=method, compat=True, progress=False
        )
        folded = read_source(str(out))
        for k, present in stored.items():
            assert (k in folded.weights) == present, (method, k, present)
        ours, _ = build_model(folded, FLASHNORM, dtype=mx.float32)
        if linear is not None:
            names = quantized_names(ours)
            assert any(n.endswith(linear) for n in names), (linear, names)
        same = mx.array_equal(folded.weights[key], rtn_w).item()
        assert same == (method == "rtn"), (method, same)
        theirs, _ = load_model(out)
        mlx_lm = rel(ours(x), theirs(x))
        assert mlx_lm < tiny.f32_tol(), (method, "ours vs mlx-lm's load", mlx_lm)
        errs[method] = rel(ours(x), ref(x))
    if kw.get("stock8"):
        stock8, _ = build_model(source, STOCK, dtype=mx.float32, quantize=(8, 32))
        errs["stock q8"] = rel(stock8(x), ref(x))
    print(source.config["model_type"], errs)
    assert all(e < kw.get("bound", 1.0) for e in errs.values()), errs
    return errs


def load_peak_is_stocks(tmp_path, make, quantized, builds=3, label="", **over):
    """Reading and building FlashNorm peaks within 3% of stock on the same
    folder, `make(path, tokenizer=..., **over)`'s, float32 or (`quantized`)
    mlx-lm's own 4-bit as stored (tests/test_load_memory.py's measure, the
    least of `builds` alternating builds each)."""
    import test_load_memory
    from mlx_lm.convert import convert as mlx_convert

    over.setdefault("tokenizer", quantized)  # mlx-lm's convert copies one
    path = make(tmp_path / "f", **over)
    if quantized:
        mlx_convert(str(path), str(tmp_path / "q"), quantize=True, q_group_size=32)
        path = tmp_path / "q"
    peaks = test_load_memory.peaks(path, False, builds)
    print(f"{label} load peak {peaks}, x{peaks['flashnorm'] / peaks['stock']:.3f}")
    assert peaks["flashnorm"] <= 1.03 * peaks["stock"], peaks


def cached_errors(stock, flash, steps=32):
    """Prefill tiny.PROMPT, then `steps` decode steps on stock's greedy tokens:
    each call's FlashNorm logits relative to stock's, and FlashNorm's caches."""
    from mlx_lm.models.cache import make_prompt_cache

    cs, cf = make_prompt_cache(stock), make_prompt_cache(flash)
    a, b = stock(mx.array([PROMPT]), cache=cs), flash(mx.array([PROMPT]), cache=cf)
    errs = [rel(b, a)]
    for _ in range(steps):
        t = mx.argmax(a[:, -1], axis=-1)[:, None]
        a, b = stock(t, cache=cs), flash(t, cache=cf)
        errs.append(rel(b, a))
    return errs, cf


def compat_and_stock_on_folded(source, tmp_path, gone):
    """`convert --compat` loads in stock mlx-lm (tiny.compat_errors); without
    --compat, the folded checkpoint lacks the gain `gone` and `--mode stock`
    on it restores the unit gains itself: stock's logits, float32."""
    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    ref, _ = build_model(source, STOCK, dtype=mx.float32)
    x = mx.array([PROMPT])
    plain = tmp_path / "folded"
    convert(source, plain, progress=False)
    folded = read_source(str(plain))
    assert gone not in folded.weights, gone
    stock_on_folded, _ = build_model(folded, STOCK, dtype=mx.float32)
    errs["stock on folded"] = rel(stock_on_folded(x), ref(x))
    assert max(errs.values()) < tiny.f32_tol(), errs


def launch_cases(paths, modes=("flashnorm", "stock"), q4=True) -> list:
    """tests/test_distributed.py's cases for {name: folder}: each of `modes`
    on each folder, and FlashNorm's own 4-bit on it where `q4`."""
    cases = []
    for name, path in paths.items():
        for mode in modes:
            cases.append({"name": f"{name}-{mode}", "model": str(path), "mode": mode})
        if q4:
            q = {"name": f"{name}-q4", "model": str(path), "mode": "flashnorm"}
            cases.append({**q, "quantize": [4, 32]})
    return cases


def compat_loads_in_mlx_lm(source, tmp_path, holds="scales", module=None):
    """`convert --compat`, float (tiny.compat_errors) and -q at 8 bits by RTN
    and GPTQ: mlx-lm loads each checkpoint (its class from `module` where
    given, its parameters' names holding `holds`), its logits there ours."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    errs = tiny.compat_errors(source, tmp_path / "compat", PROMPT)
    x = mx.array([PROMPT])
    for method in ("rtn", "gptq"):
        out = tmp_path / f"q8-{method}"
        convert(
            source, out, quantize=(8, 32), q_method=method, compat=True, progress=False
        )
        ours, _ = build_model(read_source(str(out)), FLASHNORM, dtype=mx.float32)
        theirs, _ = load_model(out)
        if module is not None:
            assert type(theirs).__module__ == module, (method, type(theirs))
        assert holds in str(tree_flatten(theirs.parameters())), (method, holds)
        errs[method] = rel(ours(x), theirs(x))
    print(errs)
    assert max(errs.values()) < tiny.f32_tol(), errs


def far_off(errs):
    """Each break made on purpose ({what: FlashNorm's logits relative to
    stock's}) moves the logits more than 10 times tiny.f32_tol() off."""
    print(errs)
    assert all(e > 10 * tiny.f32_tol() for e in errs.values()), errs


def fold_once(source):
    """fold_norms of `source`'s weights, asserted idempotent (folding the
    folded returns it as it is): the folded weights."""
    once, c1 = fold.fold_norms(source.weights, source.config)
    twice, c2 = fold.fold_norms(once, c1)
    assert twice is once and c2 == c1
    return once


def main_cases(paths, main, modes=("stock",)) -> list:
    """FlashNorm on every folder of {name: folder}; `modes` and FlashNorm's
    own 4-bit on `main`'s alone (launch_cases)."""
    flash = launch_cases(paths, ("flashnorm",), q4=False)
    return flash + launch_cases({main: paths[main]}, modes)


def picks_on(folder, quantized, tmp_path_factory, path, every=False):
    """Stock's and FlashNorm's Picks logs (record_picks at `path`; on every
    layer where `every`) over the prompt and 32 greedy steps, on `folder` in
    float32 or (`quantized`) mlx-lm's own 4-bit of it as stored."""
    if quantized:
        src = tiny.mlx_q4(folder, tmp_path_factory.mktemp("q4") / "mlx-q4")
    else:
        src = read_source(str(folder))
    logs = {}
    for mode in (STOCK, FLASHNORM):
        dtype = None if quantized else mx.float32
        model, _ = build_model(src, mode, dtype=dtype, engine="eager")
        logs[mode.name] = record_picks(model, path)
        if every:
            assert set(logs[mode.name]) == set(range(len(model.layers))), path
        greedy(model, 32)
    return logs["stock"], logs["flashnorm"]
