"""`convert`: folded (and quantized) checkpoints load without a second fold and
give the same logits as folding in memory; stock mlx-lm runs --compat ones."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten

from flashnorm_mlx import fold, quant
from flashnorm_mlx.cli import main
from flashnorm_mlx.jobs.checkpoint import convert
from flashnorm_mlx.loading import LoadError, Source, build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, STOCK

PROMPT = [tiny.PROMPT]  # a batch of one
QUANT = {"float": None, "4bit_gs32": (4, 32), "4bit_gs64": (4, 64)}


def _qflags(q):
    # Round-to-nearest: bit for bit what build_model's nn.quantize makes
    # (tests/test_gptq.py covers the default, GPTQ).
    if q is None:
        return []
    return [
        "-q",
        "--q-bits",
        str(q[0]),
        "--q-group-size",
        str(q[1]),
        "--q-method",
        "rtn",
    ]


def _rel(a, b):
    return mx.abs(a - b).max().item() / mx.abs(b).max().item()


def _files(path: Path) -> dict:
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def _leftovers(out: Path) -> list:
    return sorted(p.name for p in out.parent.glob(f"{out.name}.*"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("src"), "gqa_untied")


def _load_converted(out: Path, monkeypatch, **kw):
    """build_model on a converted folder, failing if anything folds again."""

    def no_fold(*a, **k):
        raise AssertionError("fold_norms called on a converted checkpoint")

    with monkeypatch.context() as m:
        m.setattr(fold, "fold_norms", no_fold)
        model, config = build_model(read_source(str(out)), FLASHNORM, **kw)
    return model, config


def _assert_loaded_as_stored(model, out: Path):
    """The loaded parameters are the file's tensors (fused by sanitize), bit for bit."""
    cfg = json.loads((out / "config.json").read_text())
    stored = model.sanitize(fold.drop_unit_norms(_files(out), cfg))
    params = dict(tree_flatten(model.parameters()))
    assert sorted(params) == sorted(stored), (sorted(params), sorted(stored))
    changed = [k for k in params if not mx.array_equal(params[k], stored[k]).item()]
    assert not changed, f"loading changed {changed}"


def _check_converted(src: Path, out: Path, q, monkeypatch):
    """Marker, no second fold/quantization, logits equal to fold-then-quantize in memory."""
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[fold.MARKER]["folded"] is True, cfg
    if q is None:
        assert "quantization" not in cfg, cfg
    else:
        want = {"bits": q[0], "group_size": q[1], "mode": "affine"}
        assert cfg["quantization"] == want == cfg["quantization_config"], cfg
    model, _ = _load_converted(out, monkeypatch)
    _assert_loaded_as_stored(model, out)

    source = read_source(str(src))
    ref, _ = build_model(source, FLASHNORM, quantize=q)
    x = mx.array(PROMPT)
    got, want_logits = model(x), ref(x)
    if q is None:
        stock, _ = build_model(source, STOCK)
        err, err_stock = _rel(got, want_logits), _rel(got, stock(x))
        assert err < tiny.f32_tol(1e-5) and err_stock < tiny.f32_tol(1e-5), (
            err,
            err_stock,
        )
    else:
        # Same packed tensors as quantizing the fused in-memory model: bit-identical.
        ours = dict(tree_flatten(model.parameters()))
        theirs = dict(tree_flatten(ref.parameters()))
        assert sorted(ours) == sorted(theirs)
        diff = [k for k in ours if not mx.array_equal(ours[k], theirs[k]).item()]
        assert not diff, f"differs from in-memory fold-then-quantize: {diff}"
        err = mx.abs(got - want_logits).max().item()
        assert err == 0.0, f"max |logit diff| {err}"
    return model


@pytest.mark.parametrize("quant", list(QUANT))
def test_convert_llama_loads_without_second_fold(
    llama_dir, tmp_path, quant, monkeypatch
):
    q = QUANT[quant]
    out = tmp_path / "out"
    assert main(["convert", str(llama_dir), "-o", str(out), *_qflags(q)]) == 0
    names = list(_files(out))
    assert not [k for k in names if "layernorm" in k or k == "model.norm.weight"], names
    assert (out / "tokenizer.json").is_file() and (
        out / "tokenizer_config.json"
    ).is_file()
    assert _leftovers(out) == [], _leftovers(out)
    model = _check_converted(llama_dir, out, q, monkeypatch)
    if q == (4, 64):  # down_proj's input width 96 is not a multiple of 64
        kinds = {n: type(m).__name__ for n, m in model.named_modules()}
        assert kinds["model.layers.0.mlp.down_proj"] == "Linear", kinds
        assert kinds["model.layers.0.self_attn.qkv_proj"] == "QuantizedLinear", kinds


@pytest.mark.parametrize("quant", ["float", "4bit_gs32"])
def test_compat_runs_in_stock_mlx_lm_load(llama_dir, tmp_path, quant, monkeypatch):
    from mlx_lm import load as mlx_lm_load

    out = tmp_path / "out"
    assert (
        main(
            [
                "convert",
                str(llama_dir),
                "-o",
                str(out),
                "--compat",
                *_qflags(QUANT[quant]),
            ]
        )
        == 0
    )
    norms = {k: v for k, v in _files(out).items() if "norm" in k}
    assert len(norms) == 2 * 2 + 1 and all(
        mx.all(v == 1).item() for v in norms.values()
    ), norms
    ours = _check_converted(llama_dir, out, QUANT[quant], monkeypatch)
    stock, tokenizer = mlx_lm_load(str(out))
    assert type(stock).__module__ == "mlx_lm.models.llama"
    x = mx.array(PROMPT)
    err = _rel(ours(x), stock(x))
    assert err < tiny.f32_tol(1e-5), f"stock mlx_lm.load vs ours: {err:.3e}"
    assert tokenizer.encode("hi there") == read_source(str(llama_dir)).tokenizer.encode(
        "hi there"
    )


@pytest.mark.parametrize("quant", ["float", "4bit_gs32", "4bit_gs64"])
def test_convert_openelm(tmp_path, quant, monkeypatch):
    from mlx_lm.utils import load_model

    # model_dim 64 so group sizes 32 and 64 divide it; an untied head folds the final norm.
    cfg = {
        **tiny.openelm_config("shared"),
        "model_dim": 64,
        "share_input_output_layers": False,
    }
    src = tiny.write_model(
        tmp_path / "src", cfg, tiny.openelm_weights(cfg), tokenizer=False
    )
    q = QUANT[quant]
    out = tmp_path / "out"
    convert(str(src), out, quantize=q, compat=True, progress=False, q_method="rtn")
    ours = _check_converted(src, out, q, monkeypatch)
    assert type(ours).__module__ == "flashnorm_mlx.models.openelm"
    stock, _ = load_model(out)
    assert type(stock).__module__ == "mlx_lm.models.openelm"
    err = _rel(ours(mx.array(PROMPT)), stock(mx.array(PROMPT)))
    assert err < tiny.f32_tol(
        1e-5
    ), f"stock mlx-lm on the --compat OpenELM vs ours: {err:.3e}"


def _one_line(capsys, after_stages: bool = False) -> str:
    """The one error line on stderr; after_stages: a failure once work began
    may follow the stage lines printed so far (stderr is not a terminal)."""
    err = capsys.readouterr().err.strip().splitlines()
    if after_stages:
        err = [e for e in err if not e.startswith("flashnorm-mlx convert: ")]
    assert len(err) == 1 and err[0].startswith("flashnorm-mlx: error:"), err
    return err[0]


def test_existing_output_is_refused_and_untouched(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    for force in ([], ["--force"]):  # not a checkpoint: --force refuses it too
        rc = main(["convert", str(llama_dir), "-o", str(out), *force])
        err = _one_line(capsys)
        assert rc == 1, (force, rc, err)
        assert ("already exists" if not force else "not a model checkpoint") in err
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
        assert (out / "keep.txt").read_text() == "precious"
        assert _leftovers(out) == [], _leftovers(out)


def test_force_replaces_an_earlier_checkpoint(llama_dir, tmp_path):
    out = tmp_path / "out"
    assert main(["convert", str(llama_dir), "-o", str(out)]) == 0
    (out / "stale.safetensors").write_bytes(b"x")
    # --force replaces it, only once the new checkpoint is complete.
    assert main(["convert", str(llama_dir), "-o", str(out), "--force"]) == 0
    assert not (out / "stale.safetensors").exists() and (out / "config.json").is_file()
    assert _leftovers(out) == [], _leftovers(out)


def test_force_never_touches_other_folders_files_or_the_source(
    llama_dir, tmp_path, monkeypatch, capsys
):
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_text("print('hi')")
    (project / "config.json").write_text("{}")  # config alone is no checkpoint
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    monkeypatch.chdir(project)
    cases = {
        ".": "holds the current folder",
        str(project): "holds the current folder",
        str(tmp_path): "holds the current folder",
        str(a_file): "not a model checkpoint",
        str(llama_dir): "holds the source model",
        str(llama_dir.parent): "holds the source model",
    }
    before = {p: p.stat().st_mtime_ns for p in (llama_dir / "config.json", a_file)}
    for target, why in cases.items():
        rc = main(["convert", str(llama_dir), "-o", target, "--force"])
        err = _one_line(capsys)
        assert rc == 1 and why in err, (target, rc, err)
    assert sorted(p.name for p in project.iterdir()) == ["config.json", "main.py"]
    assert a_file.read_text() == "keep"
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "project"]
    # A linked checkpoint is not replaced through its link either.
    link = tmp_path / "link"
    link.symlink_to(llama_dir)
    assert main(["convert", str(llama_dir), "-o", str(link), "--force"]) == 1
    assert "source model" in _one_line(capsys) and link.is_symlink()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_outputs_get_the_umask_permissions(llama_dir, tmp_path, umask):
    import os

    old = os.umask(umask)
    try:
        out = tmp_path / "out"
        convert(str(llama_dir), out, progress=False)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [out, *out.iterdir()]}
    want_dir, want_file = 0o777 & ~umask, 0o666 & ~umask
    assert modes.pop("out") == want_dir, (oct(want_dir), modes)
    for name in ("config.json", "model.safetensors"):
        assert modes[name] == want_file, (name, oct(modes[name]), oct(want_file))


def _fail_after_first(i, n):
    if i >= 1:
        raise RuntimeError(f"injected failure after layer group {i} of {n}")


@pytest.mark.parametrize("existing", [False, True], ids=["new", "force"])
def test_failure_midway_leaves_nothing_behind(llama_dir, tmp_path, existing):
    out = tmp_path / "new" / "parents" / "out"
    if existing:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"old")
    with pytest.raises(RuntimeError, match="injected"):
        convert(
            str(llama_dir), out, force=True, progress=False, on_layer=_fail_after_first
        )
    if existing:
        assert sorted(p.name for p in out.iterdir()) == [
            "config.json",
            "model.safetensors",
        ]
        assert (out / "model.safetensors").read_bytes() == b"old"
        assert _leftovers(out) == [], _leftovers(out)
    else:  # the parents it created went too
        assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


def test_failed_force_onto_a_mount_point_leaves_nothing(
    llama_dir, tmp_path, monkeypatch, capsys
):
    # Renaming a mount point fails with EBUSY; simulate that rename failing.
    import errno
    import os

    from flashnorm_mlx.jobs import checkpoint

    out = tmp_path / "mnt"
    assert main(["convert", str(llama_dir), "-o", str(out)]) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    real = os.replace

    def replace(src, dst):
        if Path(src) == out:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
        return real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    assert main(["convert", str(llama_dir), "-o", str(out), "--force"]) == 1
    assert "busy" in _one_line(capsys, after_stages=True).lower()
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert _leftovers(out) == [], _leftovers(out)


def test_folded_source_is_refused_unless_requantized(llama_dir, tmp_path):
    folded, direct, requant = tmp_path / "f", tmp_path / "d", tmp_path / "r"
    convert(str(llama_dir), folded, progress=False)
    with pytest.raises(LoadError, match="already folded"):
        convert(str(folded), tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()
    # Quantizing a folded float checkpoint == quantizing while folding.
    convert(str(folded), requant, quantize=(4, 32), progress=False, q_method="rtn")
    convert(str(llama_dir), direct, quantize=(4, 32), progress=False, q_method="rtn")
    a, b = _files(requant), _files(direct)
    assert sorted(a) == sorted(b)
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    with pytest.raises(LoadError, match="already folded and quantized"):
        convert(str(requant), tmp_path / "y", quantize=(4, 64), progress=False)


def test_sharded_output_and_dtype(llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    r = convert(str(llama_dir), out, dtype=mx.bfloat16, max_shard_gb=0, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) == r["tensors"] > 1, (shards, r)
    assert sorted(set(index["weight_map"].values())) == shards
    assert all(v.dtype == mx.bfloat16 for v in _files(out).values())
    # (On the CPU, build_model computes in float32 unless told otherwise.)
    model, _ = _load_converted(out, monkeypatch, dtype=mx.bfloat16)
    _assert_loaded_as_stored(model, out)
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    ref, _ = build_model(read_source(str(llama_dir)), FLASHNORM, dtype=mx.bfloat16)
    err = mx.abs(model(mx.array(PROMPT)) - ref(mx.array(PROMPT))).max().item()
    assert err == 0.0, err


def test_tokenizer_without_folder_is_saved_with_transformers(llama_dir, tmp_path):
    """A GGUF source has a tokenizer object but no files: save_pretrained writes them."""
    from mlx_lm.utils import load_tokenizer

    src = read_source(str(llama_dir))
    gguf_like = Source("gguf-like", src.config, src.weights, src.tokenizer, folder=None)
    out = tmp_path / "out"
    convert(gguf_like, out, progress=False)
    tok = load_tokenizer(out)
    text = "Hello, FlashNorm!"
    assert tok.encode(text) == src.tokenizer.encode(text)
    assert tok.chat_template == src.tokenizer.chat_template


def test_bad_output_parent_is_one_line(llama_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["convert", str(llama_dir), "-o", str(blocker / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "cannot create" in err[0], (rc, err)


def _quantized_source(folder: Path) -> Source:
    """An unfolded quantized checkpoint like a GGUF: 4-bit gs 32, 8-bit embedding."""
    src = read_source(str(folder))
    spec = {"group_size": 32, "bits": 4, "mode": "affine"}
    emb = {**spec, "bits": 8}
    weights = {}
    for k, v in src.weights.items():
        module = k[: -len(".weight")]
        if v.ndim != 2 or v.shape[-1] % 32:
            weights[k] = v
            continue
        q = emb if module == "model.embed_tokens" else spec
        w, s, b = mx.quantize(v, group_size=32, bits=q["bits"])
        weights.update({k: w, f"{module}.scales": s, f"{module}.biases": b})
    quant = {**spec, "model.embed_tokens": emb}
    config = {**src.config, "quantization": quant, "quantization_config": quant}
    return Source("quantized", config, weights, src.tokenizer, folder=folder)


@pytest.mark.parametrize(
    "how",
    [
        dict(quantized_way="requantize"),  # with the source's own settings
        dict(quantized_way="dequantize"),  # float
        dict(
            quantized_way="dequantize", quantize=(4, 64)
        ),  # other settings, from float
        dict(quantize=(4, 64)),  # -q alone also means: from float, these settings
    ],
    ids=["requant_source_settings", "dequantize", "dequantize_q64", "q64"],
)
def test_quantized_source_matches_in_memory(llama_dir, tmp_path, how, monkeypatch):
    src = _quantized_source(llama_dir)
    out = tmp_path / "out"
    # A tiny chunk_elements makes every weight go in row chunks: still bit-identical.
    convert(src, out, progress=False, chunk_elements=1000, q_method="rtn", **how)
    model, config = _load_converted(out, monkeypatch)
    _assert_loaded_as_stored(model, out)
    ref, ref_config = build_model(src, FLASHNORM, dtype=mx.float32, **how)
    ours = dict(tree_flatten(model.parameters()))
    theirs = dict(tree_flatten(ref.parameters()))
    assert sorted(ours) == sorted(theirs)
    diff = [k for k in ours if not mx.array_equal(ours[k], theirs[k]).item()]
    assert not diff, f"differs from build_model{how}: {diff}"
    _assert_config_describes_tensors(out, read_source(str(llama_dir)).weights)


def test_quantized_source_is_written_as_stored(llama_dir, tmp_path, capsys):
    """The default for a quantized source: its tensors unchanged, the config
    marked so FlashNorm applies the gains in its kernels; it loads in one step
    to the same model as running the source itself, and stock mlx-lm loads it."""
    from mlx_lm.utils import load_model

    src = _quantized_source(llama_dir)
    out = tmp_path / "stored"
    r = convert(src, out, progress=False, chunk_elements=1000)
    assert r["as_stored"] and r["quantization"]["bits"] == 4, r
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[fold.MARKER] == {"folded": False, "format": 1, "norm_gains": "kernels"}
    assert cfg["quantization"] == src.config["quantization"], cfg
    files = _files(out)
    assert sorted(files) == sorted(src.weights), sorted(set(files) ^ set(src.weights))
    changed = [k for k in files if not mx.array_equal(files[k], src.weights[k]).item()]
    assert not changed and all(files[k].dtype == src.weights[k].dtype for k in files)
    x = mx.array(PROMPT)
    ours, _ = build_model(read_source(str(out)), FLASHNORM, dtype=mx.float32)
    ref, _ = build_model(src, FLASHNORM, dtype=mx.float32)
    assert mx.array_equal(ours(x), ref(x)).item()
    stock, _ = load_model(out)
    assert _rel(ours(x), stock(x)) < 1e-4, _rel(ours(x), stock(x))
    # Rounding the stored scales to another dtype is refused, leaving nothing.
    with pytest.raises(LoadError, match="--dtype would round the stored scales"):
        convert(src, tmp_path / "f16", progress=False, dtype=mx.float16)
    assert not (tmp_path / "f16").exists() and not _leftovers(tmp_path / "f16")


def _assert_config_describes_tensors(out: Path, float_weights: dict):
    """config.json's quantization block gives every packed tensor's bits and group size."""
    cfg = json.loads((out / "config.json").read_text())
    files = _files(out)
    for key in [k for k in files if k.endswith(".scales")]:
        module = key[: -len(".scales")]
        qp = quant.quant_params(cfg, module)
        width = float_weights[f"{module}.weight"].shape[-1]
        packed, scales = files[f"{module}.weight"], files[key]
        got = (packed.shape[-1] * 32 // qp["bits"], scales.shape[-1] * qp["group_size"])
        assert got == (width, width), (module, qp, got, width)


def test_a_folded_4bit_checkpoint_says_how_it_runs(llama_dir, tmp_path, capsys):
    """A checkpoint folded and quantized by convert runs as stored by default,
    which needs no note; --dequantize runs it in float (the stored function,
    exactly) and says so;
    --requantize and -q would quantize it twice and are refused."""
    out = tmp_path / "q4"
    convert(str(llama_dir), out, quantize=(4, 32), progress=False, q_method="rtn")
    capsys.readouterr()
    gen = ["generate", str(out), "-p", "hi", "-m", "2", "--temp", "0"]
    assert main(gen) == 0
    assert "note:" not in capsys.readouterr().err  # the file's own: nothing to say
    assert main([*gen, "--dequantize"]) == 0
    assert "run in float32 (--dequantize): the file's results" in (
        capsys.readouterr().err
    )
    for flag in ("--requantize", "-q"):
        assert main([*gen, flag]) == 1
        assert "quantize twice" in _one_line(capsys)
    # The float run is the stored 4-bit function: logits equal to running it 4-bit.
    src = read_source(str(out))
    x = mx.array(PROMPT)
    f, _ = build_model(src, FLASHNORM, dtype=mx.float32, quantized_way="dequantize")
    q, _ = build_model(src, FLASHNORM, dtype=mx.float32)
    assert _rel(f(x), q(x)) < 1e-5, _rel(f(x), q(x))


def test_default_quantizer_takes_seconds_here_and_requantizing_is_said(
    llama_dir, tmp_path, monkeypatch
):
    """-q's default ("auto") is round-to-nearest on the CPU, GPTQ on a GPU, said
    in one line where it chose RTN; a quantized source is said to be rounded a
    second time, a float one is not."""
    from flashnorm_mlx.quant import gptq

    said = []
    src = _quantized_source(llama_dir)
    convert(src, tmp_path / "a", quantize=(4, 64), progress=False, on_stage=said.append)
    marker = json.loads((tmp_path / "a" / "config.json").read_text())[fold.MARKER]
    want = gptq.resolve("auto")
    assert marker["quantization_method"]["method"] == want, marker
    requant = [s for s in said if "already quantized" in s]
    assert requant and "requantizes to 4-bit group 64" in requant[0], said
    assert (gptq.AUTO_RTN_NOTE in said) == (want == "rtn"), said
    said.clear()
    convert(
        str(llama_dir),
        tmp_path / "b",
        quantize=(4, 32),
        progress=False,
        on_stage=said.append,
        q_method="rtn",
    )
    assert not [s for s in said if "already quantized" in s or "--q-method" in s], said
    # auto: GPTQ where a GPU runs the model, RTN on the CPU.
    assert gptq.resolve("rtn") == "rtn" and gptq.resolve("gptq") == "gptq"
    monkeypatch.setattr(gptq.mx, "default_device", lambda: mx.gpu)
    assert gptq.resolve("auto") == "gptq" and gptq.auto_note("auto", True) is None
    monkeypatch.setattr(gptq.mx, "default_device", lambda: mx.cpu)
    assert gptq.resolve("auto") == "rtn" and gptq.auto_note("auto", True)


def test_compat_on_a_quantized_source_as_stored_says_it_changed_nothing(
    llama_dir, tmp_path, capsys
):
    """A quantized source is written as stored, its tensors the source's: with
    --compat too, and the command says so in one line."""
    from flashnorm_mlx.cli.convert import COMPAT_AS_STORED

    stored = tmp_path / "stored"
    convert(_quantized_source(llama_dir), stored, progress=False)
    out = tmp_path / "compat"
    assert main(["convert", str(stored), "-o", str(out), "--compat"]) == 0
    printed = capsys.readouterr().out
    assert COMPAT_AS_STORED in printed, printed
    a, b = _files(stored), _files(out)
    assert sorted(a) == sorted(b)
    assert all(
        mx.array_equal(a[k], b[k]).item() and a[k].dtype == b[k].dtype for k in a
    )
    assert main(["convert", str(stored), "-o", str(tmp_path / "plain")]) == 0
    assert COMPAT_AS_STORED not in capsys.readouterr().out
