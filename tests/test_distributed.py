"""Tensor parallelism: 2 ranks started by mlx.launch on 127.0.0.1 (ring backend)
against one process on the same weights, and against stock mlx-lm.

One launch checks every model and mode (tests/distributed_child.py); a few more
run the commands as a user would, and make ranks fail. Every launch runs in
its own process group with a time limit and is killed at the end.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import distributed_child
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten

from flashnorm_mlx import distributed
from flashnorm_mlx.loading import build_model, read_source

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TIMEOUT = 240  # seconds for any one launch; a hang fails the test, never blocks it
PARALLEL = "tensor parallel over 2 ranks (ring)"


# --- models ------------------------------------------------------------------------


def _openelm(path, **over):
    cfg = {**tiny.openelm_config("shared"), **over}
    return tiny.write_model(path, cfg, tiny.openelm_weights(cfg))


def _write_models(root: Path) -> dict:
    """Tiny models whose head counts split over 2 ranks (GQA: q, k and v rows of
    unequal width), and quantizable ones whose all-summed inputs split into
    whole groups of 32."""
    quant_llama = dict(tiny.LLAMA_BASE, intermediate_size=128)
    quant_qwen3 = dict(tiny.qwen_config("qwen3_untied"), head_dim=16)
    quant_qwen3["intermediate_size"] = 128
    qwen3_w = tiny.llama_weights(quant_qwen3)
    rng = np.random.default_rng(1)
    for i in range(quant_qwen3["num_hidden_layers"]):
        for n in ("q_norm", "k_norm"):  # QK-norm gains far from 1, as make_qwen's
            qwen3_w[f"model.layers.{i}.self_attn.{n}.weight"] = rng.uniform(
                0.25, 4.0, quant_qwen3["head_dim"]
            ).astype(np.float32)
    paths = {
        "llama": tiny.make_llama(root / "llama"),
        "llama_bias": tiny.make_llama(root / "llama_bias", "linear_bias"),
        "mistral": tiny.make_llama(root / "mistral", "mistral_sliding"),
        "qwen2": tiny.make_qwen(root / "qwen2", "qwen2"),
        "qwen3": tiny.make_qwen(root / "qwen3", "qwen3_tied"),
        # Per-layer heads 4/2, 6/2, 8/4; FFN widths 24, 64, 96.
        "openelm": _openelm(root / "openelm", num_kv_heads=[2, 2, 4]),
        "llama_q": tiny.write_model(
            root / "llama_q", quant_llama, tiny.llama_weights(quant_llama)
        ),
        "qwen3_q": tiny.write_model(root / "qwen3_q", quant_qwen3, qwen3_w),
        "openelm_q": _openelm(
            root / "openelm_q",
            model_dim=64,
            head_dim=16,
            num_transformer_layers=2,
            num_query_heads=[4, 4],
            num_kv_heads=[2, 2],
            ffn_multipliers=[1.0, 2.0],
            ffn_dim_divisor=32,
        ),
    }
    return {k: str(v) for k, v in paths.items()}


CASES = [
    ("llama", "flashnorm", None),
    ("llama", "stock", None),
    ("llama", "nonorm", None),
    ("llama_bias", "flashnorm", None),
    ("mistral", "flashnorm", None),
    ("qwen2", "flashnorm", None),
    ("qwen2", "stock", None),
    ("qwen3", "flashnorm", None),
    ("qwen3", "stock", None),
    ("openelm", "flashnorm", None),
    ("openelm", "stock", None),
    ("openelm", "nonorm", None),
    ("llama_q", "flashnorm", (4, 32)),
    ("llama_q", "stock", (4, 32)),
    ("qwen3_q", "flashnorm", (4, 32)),
    ("openelm_q", "flashnorm", (8, 32)),
]


def _case(models, model, mode, quantize):
    name = f"{model}-{mode}" + (f"-q{quantize[0]}" if quantize else "")
    case = {"name": name, "model": models[model], "mode": mode}
    if quantize:
        case["quantize"] = list(quantize)
    return case


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _write_models(tmp_path_factory.mktemp("tp-models"))


# --- launching ---------------------------------------------------------------------


def _free_port_pair() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (mlx.launch uses one per rank)."""
    for _ in range(100):
        port = random.randint(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row on 127.0.0.1")


def run_bounded(cmd, env=None, stdin=None, timeout=TIMEOUT):
    """(returncode, stdout, stderr, seconds); the whole process group is killed
    at the end whatever happened, so no rank outlives the test."""
    env = {**os.environ, "FLASHNORM_DIST_TIMEOUT": "60", **(env or {})}
    t0 = time.perf_counter()
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(stdin.encode() if stdin else None, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{cmd[-6:]} ran past {timeout} s\n{out.decode()}\n{err.decode()}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return p.returncode, out.decode(), err.decode(), time.perf_counter() - t0


def launch2(args, env=None, stdin=None):
    """`mlx.launch -n 2 --backend ring` on 127.0.0.1, rank command = python ARGS."""
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring"]
    cmd += ["--starting-port", str(_free_port_pair())]
    extra = [f"--env={k}={v}" for k, v in (env or {}).items()]
    return run_bounded(cmd + extra + ["--", sys.executable, *args], env, stdin)


def cli(*args):
    return ["-m", "flashnorm_mlx", *args]


# --- every model and mode: logits and greedy tokens ----------------------------------


@pytest.fixture(scope="module")
def sharded(models, tmp_path_factory):
    """Rank 0's logits and greedy tokens for every case, from one 2-rank launch."""
    tmp = tmp_path_factory.mktemp("tp-run")
    cases = [_case(models, *c) for c in CASES]
    (tmp / "cases.json").write_text(json.dumps(cases))
    child = str(Path(distributed_child.__file__))
    rc, out, err, secs = launch2(
        [child, "cases", str(tmp / "cases.json"), str(tmp / "out.npz")]
    )
    assert (tmp / "out.npz").exists(), f"launch failed ({rc}):\n{out}\n{err}"
    print(f"2-rank launch of {len(cases)} cases: {secs:.1f} s")
    return dict(np.load(tmp / "out.npz"))


@pytest.mark.parametrize("model,mode,quantize", CASES, ids=lambda v: str(v))
def test_two_ranks_match_one_process(sharded, models, model, mode, quantize):
    """Same function as one process on the same weights: float32 logits within
    float32 rounding (the all-sums add partial products in another order),
    greedy tokens identical through the KV cache."""
    case = _case(models, model, mode, quantize)
    logits, tokens = distributed_child.run_case(case, None)
    got = sharded[f"{case['name']}/logits"]
    rel = np.abs(got - logits).max() / np.abs(logits).max()
    assert rel < tiny.f32_tol(1e-5), f"{case['name']}: max rel logit diff {rel:.3g}"
    assert got.shape == logits.shape
    got_tokens = sharded[f"{case['name']}/tokens"].tolist()
    assert got_tokens == tokens.tolist(), (case["name"], got_tokens, tokens.tolist())


@pytest.mark.parametrize("model", ["llama", "llama_bias", "qwen2", "qwen3", "openelm"])
def test_two_ranks_flashnorm_match_stock_mlx_lm(sharded, models, model):
    """The sharded FlashNorm model against stock mlx-lm in one process."""
    case = _case(models, model, "stock", None)
    ref, ref_tokens = distributed_child.run_case(case, None)
    got = sharded[f"{model}-flashnorm/logits"]
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < tiny.f32_tol(), f"{model}: max rel logit diff to stock {rel:.3g}"
    assert sharded[f"{model}-flashnorm/tokens"].tolist() == ref_tokens.tolist()


# --- the commands under mlx.launch ---------------------------------------------------


def _text(stdout: str) -> str:
    return stdout.split("=" * 10)[0]


def test_generate_two_ranks_prints_what_one_process_prints(models):
    args = ["generate", models["llama"], "-p", "hello there", "-m", "24", "--temp", "0"]
    rc, out, err, _ = launch2(cli(*args))
    one = run_bounded([sys.executable, *cli(*args)])
    assert rc == 0 and one[0] == 0, (out, err, one)
    assert _text(out) == _text(one[1]) and _text(out).strip(), (out, one[1])
    assert out.count("=" * 10) == 1, out  # rank 0 alone prints
    assert err.count(PARALLEL) == 1, err
    assert "Traceback" not in err, err


def test_chat_two_ranks_replies_as_one_process(models):
    """Sampling at temperature 0.7 with a seed: every rank must draw rank 0's
    tokens. mlx.launch passes stdin to every rank but not its end: /quit ends."""
    args = ["chat", models["qwen2"], "-m", "10", "--temp", "0.7", "--seed", "3"]
    stdin = "hi\nhow are you\n/quit\n"
    rc, out, err, _ = launch2(cli(*args), stdin=stdin)
    one = run_bounded([sys.executable, *cli(*args)], stdin=stdin)

    def replies(text):  # the stats lines carry timings
        return [l for l in text.splitlines() if "tok/s" not in l]

    assert rc == 0 and replies(out) == replies(one[1]), (out, err, one[1])
    assert sum("tok/s" in l for l in out.splitlines()) == 2, out
    assert err.count(PARALLEL) == 1, err


def test_bench_two_ranks_reports_world_size(models, tmp_path):
    report = tmp_path / "bench.json"
    args = ["bench", models["openelm"], "-p", "8", "-g", "3", "-n", "1"]
    rc, out, err, _ = launch2(cli(*args, "--dtype", "float32", "--json", str(report)))
    assert rc == 0 and report.exists(), (out, err)
    result = json.loads(report.read_text())
    assert result["settings"]["world_size"] == 2, result["settings"]
    assert result["settings"]["parallel"] == PARALLEL
    for v, s in result["variants"].items():
        assert s["logits_finite"] and s["all_trials_finite"], (v, s)
    assert out.count(PARALLEL) == 1 and out.count("wrote") == 1, out


# --- failures end every rank with a message, in bounded time --------------------------


def test_a_rank_that_exits_stops_the_other_with_one_line(models):
    child = str(Path(distributed_child.__file__))
    args = [child, "die", models["llama"], "-p", "hi", "-m", "40", "--temp", "0"]
    rc, out, err, secs = launch2(args)
    # MLX's ring either reports the lost peer at once, or retries its socket and
    # stalls; then the watchdog stops rank 0. Both end it with one error line.
    errors = [line for line in err.splitlines() if "flashnorm-mlx: error:" in line]
    assert len(errors) == 1, err
    assert (
        "lost contact with the other ranks" in errors[0]
        or "no progress for" in errors[0]
    ), err
    assert "Traceback" not in err, err
    print(f"rank 1 exited: rank 0 stopped, launch over in {secs:.1f} s")


def test_a_rank_that_stops_answering_times_out(models):
    child = str(Path(distributed_child.__file__))
    args = [child, "hang", models["llama"], "-p", "hi", "-m", "40", "--temp", "0"]
    rc, out, err, secs = launch2(args, env={"FLASHNORM_DIST_TIMEOUT": "3"})
    assert "no progress for 3 s while generating" in err, err
    assert "Traceback" not in err, err
    assert secs < 90, secs


def test_connecting_to_a_rank_that_never_comes_times_out(models, tmp_path):
    """Rank 0 of 2 alone: mx.distributed.init would wait forever."""
    port = _free_port_pair()
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = {"MLX_RANK": "0", "MLX_HOSTFILE": str(hosts), "FLASHNORM_DIST_TIMEOUT": "2"}
    args = ["generate", models["llama"], "-p", "hi", "-m", "4"]
    rc, out, err, secs = run_bounded([sys.executable, *cli(*args)], env, timeout=60)
    assert rc != 0 and "no progress for 2 s while connecting" in err, (rc, err)
    assert secs < 30, secs


def test_commands_without_tensor_parallelism_refuse_a_launch(
    models, monkeypatch, capsys
):
    from flashnorm_mlx.cli import verify

    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", "/nonexistent/hosts.json")
    assert verify.main([models["llama"]]) == 1
    err = capsys.readouterr().err
    assert "only generate, chat and bench run tensor-parallel" in err, err


# --- what cannot be split: checked before anything runs ------------------------------


class _Pair:
    """Rank `r` of a 2-process group, for splitting weights in one process (the
    split reads only size and rank; nothing here runs a collective)."""

    def __init__(self, r):
        self.r = r

    def size(self):
        return 2

    def rank(self):
        return self.r


def test_head_counts_that_do_not_divide_are_one_clear_error(tmp_path):
    source = read_source(str(tiny.make_llama(tmp_path / "odd", "odd_sizes")))
    for mode in ("flashnorm", "stock"):
        with pytest.raises(distributed.ShardError, match="5 query and 1 key/value"):
            build_model(source, mode, dtype=mx.float32, group=_Pair(0))
    oe = read_source(str(tiny.make_openelm(tmp_path / "oe")))  # 1 kv head in layer 0
    with pytest.raises(distributed.ShardError, match="4 query and 1 key/value"):
        build_model(oe, "flashnorm", dtype=mx.float32, group=_Pair(0))


def test_quantization_groups_that_do_not_split_are_one_clear_error(tmp_path):
    # down_proj reads 96 columns: 48 per rank is not a whole number of 32-groups.
    source = read_source(str(tiny.make_llama(tmp_path / "m")))
    with pytest.raises(distributed.ShardError, match="down_proj.*groups of 32"):
        build_model(source, "flashnorm", quantize=(4, 32), group=_Pair(0))


def test_a_model_without_shard_is_one_clear_error():
    class NoShard(nn.Module):
        model_type = "other"

    with pytest.raises(distributed.ShardError, match="has no tensor-parallel shard"):
        distributed.shard_model(NoShard(), _Pair(0), "m")


def test_the_two_halves_hold_the_whole(models):
    """Rank 0's and rank 1's q|k|v rows (and biases) put back together, segment by
    segment, are the unsplit layer: no row lost, none swapped between q, k, v."""
    source = read_source(models["llama_bias"])
    whole, _ = build_model(source, "flashnorm", dtype=mx.float32)
    halves = [
        build_model(source, "flashnorm", dtype=mx.float32, group=_Pair(r))[0]
        for r in (0, 1)
    ]
    attn = whole.layers[0].self_attn
    h, hq, hkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    bounds = [0, hq * h, (hq + hkv) * h, (hq + 2 * hkv) * h]
    for name in ("qkv_proj.weight", "qkv_bias"):
        full = dict(tree_flatten(attn.parameters()))[name]
        parts = [
            dict(tree_flatten(m.layers[0].self_attn.parameters()))[name] for m in halves
        ]
        n = [(b - a) // 2 for a, b in zip(bounds, bounds[1:])]
        pieces = [np.split(np.array(p), np.cumsum(n)[:-1]) for p in parts]
        rebuilt = np.concatenate([np.concatenate(seg) for seg in zip(*pieces)])
        np.testing.assert_array_equal(rebuilt, np.array(full), err_msg=name)
    assert halves[0].layers[0].self_attn.n_heads == hq // 2
