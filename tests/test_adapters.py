"""--adapter-path: mlx-lm LoRA and DoRA adapters fused before the fold, checked
against the reference, mlx-lm's own `load(..., adapter_path=...)` on the same
weights (its LoRA layers unfused)."""

import json

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten
from tiny import PROMPT

from flashnorm_mlx.cli import main
from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.loading.adapters import apply_adapter
from flashnorm_mlx.modes import FLASHNORM, STOCK


def make_adapter(model_dir, out, kind="lora", seed=1, num_layers=2):
    """An adapter as `mlx_lm.lora` saves one: linear_to_lora_layers on the model,
    the trainable parameters (lora_a, lora_b, and DoRA's m) written with
    adapter_config.json. lora_b is random and nonzero (mlx-lm starts it at 0)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    model.freeze()
    params = {"rank": 4, "scale": 2.0, "dropout": 0.0}
    linear_to_lora_layers(model, num_layers, params, use_dora=kind == "dora")
    mx.random.seed(seed)
    trainable = dict(tree_flatten(model.trainable_parameters()))
    for k, v in trainable.items():
        if k.endswith("lora_b"):
            trainable[k] = 0.2 * mx.random.normal(v.shape)
        elif k.endswith(".m"):  # DoRA's magnitudes, moved off the base norms
            trainable[k] = v * (1 + 0.3 * mx.random.uniform(shape=v.shape))
    model.load_weights(list(trainable.items()), strict=False)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), trainable)
    config = {
        "fine_tune_type": kind,
        "num_layers": num_layers,
        "lora_parameters": params,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("m"), "gqa_untied")


def _reference(model_dir, adapter):
    from mlx_lm.utils import load

    model, tokenizer = load(str(model_dir), adapter_path=str(adapter))
    return model, tokenizer


def _rel(a, b) -> float:
    return (mx.abs(a - b).max() / mx.abs(a).max()).item()


MAKERS = {
    "llama gqa_untied": lambda p: tiny.make_llama(p, "gqa_untied"),
    "llama linear_bias": lambda p: tiny.make_llama(p, "linear_bias"),
    "qwen2": lambda p: tiny.make_qwen(p, "qwen2"),
    "qwen3_tied": lambda p: tiny.make_qwen(p, "qwen3_tied"),
    "openelm": lambda p: tiny.make_openelm(p),
}


def _without_rotary_buffers(path):
    """mlx-lm's Qwen classes refuse the rotary buffer some checkpoints carry
    (ours ignore it): drop it so mlx-lm can load the same weights."""
    f = str(path / "model.safetensors")
    w = mx.load(f)
    mx.save_safetensors(f, {k: v for k, v in w.items() if "inv_freq" not in k})
    return path


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("name", MAKERS)
def test_adapter_matches_mlx_lm_load_with_adapter_path(tmp_path, kind, name):
    """Against mlx-lm's load_model + load_adapters (what load(adapter_path=)
    builds; OpenELM has no tokenizer for load's own)."""
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    model_dir = _without_rotary_buffers(MAKERS[name](tmp_path / "m"))
    adapter = make_adapter(model_dir, tmp_path / "a", kind)
    ref = load_adapters(load_model(model_dir)[0], str(adapter))
    ref.eval()
    plain = read_source(str(model_dir), need_tokenizer=False)
    base, _ = build_model(plain, STOCK, dtype=mx.float32)
    source = read_source(
        str(model_dir), need_tokenizer=False, adapter_path=str(adapter)
    )
    ours, _ = build_model(source, FLASHNORM, dtype=mx.float32)
    x = mx.array([PROMPT])
    want, got, unadapted = ref(x), ours(x), base(x)
    # The adapter changes the function (else the test proves nothing) ...
    moved = _rel(want, unadapted)
    assert moved > 1e-2, f"{kind}: adapter moved logits by only {moved:.2e}"
    # ... and FlashNorm runs the adapted one.
    err = _rel(want, got)
    print(
        f"{name} {kind}: FlashNorm vs mlx-lm adapted {err:.2e} (adapter moved {moved:.2e})"
    )
    assert err < tiny.f32_tol(1e-4), f"{name} {kind}: relative logit diff {err:.2e}"


def test_generate_adapter_greedy_text_is_mlx_lm_s(llama, tmp_path, capsys):
    from mlx_lm import generate

    adapter = make_adapter(llama, tmp_path / "a")
    ref, tokenizer = _reference(llama, adapter)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    want = generate(ref, tokenizer, ids, max_tokens=16)
    argv = ["generate", str(llama), "-p", "hello", "-m", "16", "--dtype", "float32"]
    assert main([*argv, "--adapter-path", str(adapter)]) == 0
    got = capsys.readouterr().out.split("\n==========")[0]
    assert main(argv) == 0
    plain = capsys.readouterr().out.split("\n==========")[0]
    print(f"mlx-lm {want!r}\nours   {got!r}\nno adapter {plain!r}")
    assert got == want
    assert plain != want  # the adapter changes the text


def test_verify_adapter_path_against_mlx_lm_s_adapted_model(llama, tmp_path, capsys):
    adapter = make_adapter(llama, tmp_path / "a")
    argv = ["verify", str(llama), "--json", "--dtype", "float32", "-g", "8"]
    assert main([*argv, "--adapter-path", str(adapter)]) == 0
    r = json.loads(capsys.readouterr().out)
    print(r)
    assert r["adapter"] == str(adapter)
    assert r["max_rel_logit_diff"] < tiny.f32_tol(1e-4)
    assert r["greedy_match"] == 8
    assert "mlx-lm's own adapted model" in r["comparison_note"]
    assert r["comparison"] == "adapter"


def test_verify_adapter_fails_when_the_fuse_is_skipped(
    llama, tmp_path, capsys, monkeypatch
):
    """The check has teeth: FlashNorm without the adapter (the fuse skipped)
    is far from mlx-lm's adapted model."""
    from flashnorm_mlx.loading import adapters

    adapter = make_adapter(llama, tmp_path / "a")
    monkeypatch.setattr(adapters, "_fused", lambda module, weights, *a: {})
    argv = ["verify", str(llama), "--json", "--dtype", "float32", "-g", "4"]
    assert main([*argv, "--adapter-path", str(adapter)]) == 1  # FAIL
    r = json.loads(capsys.readouterr().out)
    assert r["max_rel_logit_diff"] > 1e-2 and not r["passed"], r
    assert r["verdict"].startswith("FAIL: max |logit diff|"), r


def test_quantized_source_takes_the_adapter_in_float(llama, tmp_path):
    """A quantized source is dequantized to take the adapter and runs in float
    (a note says so); --requantize quantizes the adapted weights again."""
    from mlx_lm.tuner.utils import load_adapters

    adapter = make_adapter(llama, tmp_path / "a")
    q = tiny.quantized(read_source(str(llama)), bits=8, group_size=32)
    src = apply_adapter(q, adapter)
    notes = []
    ours, _ = build_model(src, FLASHNORM, dtype=mx.float32, notes=notes)
    assert any("runs in float" in n for n in notes), notes
    assert not any("Quantized" in type(m).__name__ for _, m in ours.named_modules())
    stock, _ = build_model(q, STOCK, dtype=mx.float32)
    ref = load_adapters(stock, str(adapter))  # mlx-lm's: 8-bit base + LoRA layers
    x = mx.array([PROMPT])
    err = _rel(ref(x), ours(x))
    print(f"8-bit source + adapter: FlashNorm in float vs mlx-lm adapted {err:.2e}")
    assert err < 1e-4
    from flashnorm_mlx.jobs.equivalence import compare
    from flashnorm_mlx.loading.adapters import adapter_comparison
    from flashnorm_mlx.loading.rows import comparison

    r = compare(q, PROMPT, horizon=4, dtype=mx.float32, adapter=str(adapter))
    how = adapter_comparison(q, comparison(q))
    print(r, how)
    assert r["max_rel_logit_diff"] < 1e-4 and r["greedy_match"] == 4
    assert how["comparison"] == "adapter" and "dequantized" in how["comparison_note"]
    notes = []
    requant, _ = build_model(
        src, FLASHNORM, dtype=mx.float32, quantized_way="requantize", notes=notes
    )
    assert any("quantized again" in n for n in notes), notes
    bits = {m.bits for _, m in requant.named_modules() if hasattr(m, "bits")}
    assert bits == {8}, bits


def test_convert_with_adapter_writes_the_adapted_function(llama, tmp_path, capsys):
    adapter = make_adapter(llama, tmp_path / "a")
    out = tmp_path / "folded"
    argv = ["convert", str(llama), "-o", str(out), "--adapter-path", str(adapter)]
    assert main(argv) == 0
    ref, _ = _reference(llama, adapter)
    folded, _ = build_model(read_source(str(out)), FLASHNORM, dtype=mx.float32)
    x = mx.array([PROMPT])
    err = _rel(ref(x), folded(x))
    print(f"converted with adapter vs mlx-lm adapted: {err:.2e}")
    assert err < tiny.f32_tol(1e-4)


def _one_line_refusal(argv, capsys):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1, (rc, err)
    assert "Traceback" not in err[0]
    return err[0]


def test_missing_adapter_folder_is_one_line(llama, tmp_path, capsys):
    missing = tmp_path / "nope"
    for cmd in ("generate", "verify", "convert"):
        argv = [cmd, str(llama), "--adapter-path", str(missing)]
        if cmd == "convert":
            argv += ["-o", str(tmp_path / "out")]
        line = _one_line_refusal(argv, capsys)
        assert "no such adapter folder" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config, words",
    [
        ("{not json", "invalid JSON"),
        ('{"fine_tune_type": "full", "lora_parameters": {"scale": 1}}', "full"),
        ('{"lora_parameters": {"rank": 4, "alpha": 8}}', "not 'alpha'"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_broken_adapter_config_is_one_line(llama, tmp_path, capsys, config, words):
    adapter = make_adapter(llama, tmp_path / "a")
    (adapter / "adapter_config.json").write_text(config)
    argv = ["generate", str(llama), "-m", "2", "--adapter-path", str(adapter)]
    line = _one_line_refusal(argv, capsys)
    assert words in line, line


def test_adapter_of_another_model_is_one_line(llama, tmp_path, capsys):
    other = tiny.make_llama(tmp_path / "odd", "odd_sizes")
    adapter = make_adapter(other, tmp_path / "a", num_layers=3)
    argv = ["generate", str(llama), "-m", "2", "--adapter-path", str(adapter)]
    line = _one_line_refusal(argv, capsys)
    assert "another model" in line or "do not fit" in line, line


def test_chat_adapter_reply_is_mlx_lm_s(llama, tmp_path, capsys, monkeypatch):
    import io
    import sys

    from mlx_lm import generate

    adapter = make_adapter(llama, tmp_path / "a")
    ref, tokenizer = _reference(llama, adapter)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    want = generate(ref, tokenizer, ids, max_tokens=10)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    argv = ["chat", str(llama), "-m", "10", "--dtype", "float32"]
    assert main([*argv, "--adapter-path", str(adapter)]) == 0
    out = capsys.readouterr().out
    print(f"chat {out!r}\nmlx-lm {want!r}")
    assert out.startswith(want + "\n10 tokens,")


def test_bench_takes_the_adapter(llama, tmp_path, capsys):
    """bench builds its rows on the adapted source: a bad folder is refused
    there, and a good one runs."""
    argv = ["bench", str(llama), "-p", "8", "-g", "4", "-n", "1"]
    argv += ["--variants", "stock,flashnorm", "--dtype", "float32"]
    line = _one_line_refusal([*argv, "--adapter-path", str(tmp_path / "no")], capsys)
    assert "no such adapter folder" in line, line
    adapter = make_adapter(llama, tmp_path / "a")
    assert main([*argv, "--adapter-path", str(adapter)]) == 0


def test_bench_with_a_draft_runs_the_adapted_model(llama, tmp_path, capsys):
    """bench --draft-model on the adapted model, with the unadapted model as
    its draft: they differ, so not every draft token is accepted (with the
    adapter dropped, the draft would be the model itself: all accepted)."""
    import json

    adapter = make_adapter(llama, tmp_path / "a")
    out = tmp_path / "draft.json"
    argv = ["bench", str(llama), "-p", "8", "-g", "16", "-n", "1", "--dtype"]
    argv += ["float32", "--draft-model", str(llama), "--json", str(out)]
    assert main([*argv, "--adapter-path", str(adapter)]) == 0
    r = json.loads(out.read_text())
    assert r["same_tokens"] is True and r["acceptance_rate"] < 1, r


def test_broken_adapter_files_are_one_line(llama, tmp_path, capsys):
    argv = ["generate", str(llama), "-m", "2", "--adapter-path"]
    adapter = make_adapter(llama, tmp_path / "a")
    (adapter / "adapters.safetensors").write_bytes(b"\x10\x00\x00\x00junk")
    line = _one_line_refusal([*argv, str(adapter)], capsys)
    assert "adapters.safetensors" in line, line
    (adapter / "adapter_config.json").unlink()
    line = _one_line_refusal([*argv, str(adapter)], capsys)
    assert "no adapter_config.json" in line, line


def test_adapter_on_a_folded_checkpoint_is_one_line(llama, tmp_path, capsys):
    adapter = make_adapter(llama, tmp_path / "a")
    folded = tmp_path / "folded"
    assert main(["convert", str(llama), "-o", str(folded)]) == 0
    capsys.readouterr()
    argv = ["generate", str(folded), "-m", "2", "--adapter-path", str(adapter)]
    line = _one_line_refusal(argv, capsys)
    assert "folded checkpoint" in line, line
