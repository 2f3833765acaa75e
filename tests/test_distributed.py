"""Tensor parallelism: 2, 3 and 4 ranks started by mlx.launch on 127.0.0.1
(ring backend) against one process on the same weights, and against stock
mlx-lm. Head counts that do not divide split by whole GQA groups, unevenly,
with a key/value head held by several ranks where there are fewer of them.

One launch per rank count checks every model and mode (tests/distributed_child.py);
a few more run the commands as a user would, and make ranks fail. Every launch
runs in its own process group with a time limit and is killed at the end.
mlx's launcher runs through tests/quiet_launch.py (its threads wait for the
ranks' output instead of polling flat out), the chat test through `mlx.launch`.
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

from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.modes import FLASHNORM, NONORM, STOCK
from flashnorm_mlx.parallel import sharding

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TIMEOUT = 240  # seconds for any one launch; a hang fails the test, never blocks it
PARALLEL = "tensor parallel over 2 ranks (ring)"
SIZES = (2, 3, 4)


# --- models ------------------------------------------------------------------------


def _openelm(path, **over):
    cfg = {**tiny.openelm_config("shared"), **over}
    return tiny.write_model(path, cfg, tiny.openelm_weights(cfg))


def _llama(path, **over):
    cfg = {**tiny.LLAMA_BASE, **over}
    return tiny.write_model(path, cfg, tiny.llama_weights(cfg))


def _write_models(root: Path) -> dict:
    """Tiny models whose heads do not divide by 2, 3 or 4 (or are fewer key/value
    heads than ranks), and quantized ones whose hidden widths are an odd number
    of 32-column groups (an uneven FFN split on group boundaries)."""
    paths = {
        # The embedded SmolLM2-135M, 4-bit, 9 query and 3 key/value heads: its
        # first 2 layers as they are (all 30: the generate test below).
        "smollm2_2": None,
        "llama_5to1": _llama(
            root / "llama_5to1",
            hidden_size=40,
            num_attention_heads=5,
            num_key_value_heads=1,
            intermediate_size=72,
        ),
        "llama_4to1": _llama(
            root / "llama_4to1", num_key_value_heads=1, num_hidden_layers=1
        ),
        "mqa_6to1": _llama(
            root / "mqa_6to1",
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=1,
            intermediate_size=64,
            num_hidden_layers=1,
        ),
        "llama_bias": tiny.make_llama(root / "llama_bias", "linear_bias"),  # 4:2
        "qwen2": tiny.make_qwen(root / "qwen2", "qwen2"),  # 4:2, q/k/v biases
        "qwen3": tiny.make_qwen(root / "qwen3", "qwen3_tied"),  # 6:2, QK-norm
        # OpenELM-270M's pattern: 4 query heads per kv head, 3, 4, 5 kv heads.
        "openelm": _openelm(
            root / "openelm",
            model_dim=64,
            num_query_heads=[12, 16, 20],
            num_kv_heads=[3, 4, 5],
        ),
        # FFN widths of 5 groups of 32: 96|64 over 2 ranks, 64|64|32, 64|32|32|32;
        # head_dim 32, so o_proj's columns split on group boundaries too.
        "llama_q": _llama(
            root / "llama_q",
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=160,
            num_hidden_layers=1,
        ),
        "openelm_q": _openelm(
            root / "openelm_q",
            model_dim=64,
            head_dim=32,
            num_transformer_layers=2,
            num_query_heads=[4, 6],
            num_kv_heads=[2, 3],
            ffn_multipliers=[2.5, 3.0],  # 160 and 192 hidden columns
            ffn_dim_divisor=32,
        ),
    }
    return {k: (str(v) if v else None) for k, v in paths.items()}


# (model, mode, quantize, rank counts). A decode step costs two collectives per
# layer, and MLX's ring spins while it waits, so with more ranks than the 2
# cores the tests get each collective waits for a busy core: so SmolLM2's first
# 2 layers only (its layers all split alike, and a second layer reads the
# first's all-summed output), at 2 ranks (6:2|3:1) and 4 (its first key/value
# head held by 2 ranks; 3 ranks is 3:1 each, as OpenELM's first layer at 3),
# FlashNorm on every other layout at 2, 3 and 4 ranks, stock on OpenELM at 4
# too (nonorm is stock's class, split alike), every mode at 2.
CASES = [
    ("smollm2_2", "flashnorm", None, (2, 4)),
    ("llama_5to1", "flashnorm", None, SIZES),
    ("llama_5to1", "stock", None, (2,)),
    ("llama_4to1", "flashnorm", None, SIZES),
    ("mqa_6to1", "flashnorm", None, SIZES),
    ("mqa_6to1", "stock", None, (2,)),
    ("llama_bias", "flashnorm", None, (2,)),
    ("qwen2", "flashnorm", None, SIZES),
    ("qwen2", "stock", None, (2,)),
    ("qwen3", "flashnorm", None, SIZES),
    ("openelm", "flashnorm", None, SIZES),
    ("openelm", "stock", None, (2, 4)),
    ("openelm", "nonorm", None, (2,)),
    ("llama_q", "flashnorm", (4, 32), SIZES),
    ("llama_q", "stock", (4, 32), (2,)),
    ("openelm_q", "flashnorm", (8, 32), (2,)),
]
RUNS = [(n, *c[:3]) for n in SIZES for c in CASES if n in c[3]]
LAYERS = {"smollm2_2": 2}


def _case(models, model, mode, quantize):
    name = f"{model}-{mode}" + (f"-q{quantize[0]}" if quantize else "")
    case = {"name": name, "model": models[model], "mode": mode}
    if quantize:
        case["quantize"] = list(quantize)
    if model in LAYERS:
        case["layers"] = LAYERS[model]
    return case


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _write_models(tmp_path_factory.mktemp("tp-models"))


# --- launching ---------------------------------------------------------------------


def _free_ports(n: int) -> int:
    """A port P with P .. P + n - 1 free on 127.0.0.1 (mlx.launch uses one per rank)."""
    for _ in range(100):
        port = random.randint(20000, 60000)
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports in a row on 127.0.0.1")


def run_bounded(cmd, env=None, stdin=None, timeout=TIMEOUT, hold_stdin=False):
    """(returncode, stdout, stderr, seconds); the whole process group is killed
    at the end whatever happened, so no rank outlives the test. hold_stdin: the
    STDIN lines, then no end of file until the end (a terminal's stdin: at end
    of file mlx.launch's main loop polls without sleeping)."""
    env = {**os.environ, "FLASHNORM_DIST_TIMEOUT": "60", **(env or {})}
    data = stdin.encode() if stdin else None
    pipe, held = os.pipe() if hold_stdin else (subprocess.PIPE, None)
    t0 = time.perf_counter()
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=pipe,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    if hold_stdin:
        os.close(pipe)
        os.write(held, data or b"")  # a few lines: within the pipe's buffer
        data = None
    try:
        out, err = p.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{cmd[-6:]} ran past {timeout} s\n{out.decode()}\n{err.decode()}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if held is not None:
            os.close(held)
    return p.returncode, out.decode(), err.decode(), time.perf_counter() - t0


def launch(n, args, env=None, stdin=None, genuine=False):
    """`mlx.launch -n N --backend ring` on 127.0.0.1, rank command = python ARGS;
    mlx's launcher through tests/quiet_launch.py (whose rank threads wait
    instead of polling flat out), or its `mlx.launch` script itself (genuine)."""
    quiet = [sys.executable, str(Path(__file__).with_name("quiet_launch.py"))]
    cmd = [str(BIN / "mlx.launch")] if genuine else quiet
    cmd += ["-n", str(n), "--backend", "ring", "--starting-port", str(_free_ports(n))]
    extra = [f"--env={k}={v}" for k, v in (env or {}).items()]
    cmd += extra + ["--", sys.executable, *args]
    return run_bounded(cmd, env, stdin, hold_stdin=True)


def launch2(args, env=None, stdin=None):
    return launch(2, args, env, stdin)


def ranks_match_one_process(cases, tmp_path) -> None:
    """`two_ranks_and_one` on `cases`: each within float32 rounding of one
    process (tiny.shard_tol), as every family's tensor-parallel test asks."""
    _, _, errs, secs = two_ranks_and_one(cases, tmp_path)
    print(f"2 ranks in {secs:.1f} s; vs one process {errs}")
    assert max(errs.values()) < tiny.shard_tol(), errs


def two_ranks_and_one(cases, tmp_path):
    """Every case (tests/distributed_child.py's) built over a 2-rank launch and
    in this one process: (the launch's arrays, {name: (logits, tokens)} of one
    process, {name: max relative logit difference}, seconds), the greedy
    tokens asserted identical."""
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    args = [distributed_child.__file__, "cases", "2"]
    args += [str(tmp_path / "cases.json"), str(tmp_path / "o.npz")]
    rc, out, err, secs = launch(2, args)
    assert (tmp_path / "o.npz").exists(), f"launch failed ({rc}):\n{out}\n{err}"
    got = dict(np.load(tmp_path / "o.npz"))
    one = {c["name"]: distributed_child.run_case(c, None) for c in cases}
    errs = {}
    for name, (logits, tokens) in one.items():
        errs[name] = np.abs(got[f"{name}/logits"] - logits).max() / np.abs(logits).max()
        assert got[f"{name}/tokens"].tolist() == tokens.tolist(), name
    return got, one, errs, secs


def cli(*args):
    return ["-m", "flashnorm_mlx", *args]


def _error_lines(err: str):
    return [line for line in err.splitlines() if "flashnorm-mlx: error:" in line]


# --- every model and mode: logits and greedy tokens ----------------------------------


_LAUNCHES = {}


@pytest.fixture(scope="module")
def sharded(models, tmp_path_factory):
    """get(N): rank 0's logits and greedy tokens for every case run at N ranks,
    from one N-rank launch (made on first use)."""

    def get(n):
        if n not in _LAUNCHES:
            tmp = tmp_path_factory.mktemp(f"tp-run{n}")
            cases = [_case(models, m, mode, q) for k, m, mode, q in RUNS if k == n]
            (tmp / "cases.json").write_text(json.dumps(cases))
            child = str(Path(distributed_child.__file__))
            args = [child, "cases", str(n), str(tmp / "cases.json"), str(tmp / "o.npz")]
            rc, out, err, secs = launch(n, args)
            assert (tmp / "o.npz").exists(), f"launch failed ({rc}):\n{out}\n{err}"
            print(f"{n}-rank launch of {len(cases)} cases: {secs:.1f} s\n{out}")
            _LAUNCHES[n] = dict(np.load(tmp / "o.npz"))
        return _LAUNCHES[n]

    return get


_REFERENCE = {}


def _one_process(models, model, mode, quantize):
    """run_case in this process, unsharded (once per case for every rank count)."""
    case = _case(models, model, mode, quantize)
    if case["name"] not in _REFERENCE:
        _REFERENCE[case["name"]] = distributed_child.run_case(case, None)
    return _REFERENCE[case["name"]]


@pytest.mark.parametrize("n,model,mode,quantize", RUNS, ids=lambda v: str(v))
def test_ranks_match_one_process(sharded, models, n, model, mode, quantize):
    """Same function as one process on the same weights: float32 logits of the
    prompt and of every cached decode step within 1e-5 of the largest (the
    all-sums add partial products in another order), greedy tokens identical."""
    got = sharded(n)
    name = _case(models, model, mode, quantize)["name"]
    logits, tokens = _one_process(models, model, mode, quantize)
    assert got[f"{name}/logits"].shape == logits.shape, name
    rel = np.abs(got[f"{name}/logits"] - logits).max() / np.abs(logits).max()
    assert rel < tiny.f32_tol(1e-5), f"{name}, {n} ranks: max rel logit diff {rel:.3g}"
    got_tokens = got[f"{name}/tokens"].tolist()
    assert got_tokens == tokens.tolist(), (name, n, got_tokens, tokens.tolist())


STOCK_PAIRS = [
    (n, m)
    for n, m, mode, q in RUNS
    if mode == "flashnorm" and not q and (n, m, "stock", None) in RUNS
]


@pytest.mark.parametrize("n,model", STOCK_PAIRS, ids=lambda v: str(v))
def test_ranks_flashnorm_match_stock_mlx_lm(sharded, models, n, model):
    """The sharded FlashNorm model against stock mlx-lm in one process."""
    got = sharded(n)
    ref, ref_tokens = _one_process(models, model, "stock", None)
    logits = got[f"{model}-flashnorm/logits"]
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    assert rel < tiny.f32_tol(), f"{model}, {n} ranks: max rel diff to stock {rel:.3g}"
    assert got[f"{model}-flashnorm/tokens"].tolist() == ref_tokens.tolist()


# --- the commands under mlx.launch ---------------------------------------------------


def _text(stdout: str) -> str:
    return stdout.split("=" * 10)[0]


def test_generate_two_ranks_prints_what_one_process_prints():
    """The embedded SmolLM2 (9 query, 3 key/value heads: 6|3 per rank), 4-bit as
    shipped, as a user runs it: rank 0's text and lines, no other rank's. A
    short system prompt: its default one would add 13 prompt tokens, each
    ~0.1 s per process on the CPU, and nothing a rank splits differently."""
    args = cli("generate", "-p", "The capital of France is", "-m", "8", "--temp", "0")
    args += ["--system-prompt", "Be brief."]
    rc, out, err, _ = launch2(args)
    one = run_bounded([sys.executable, *args])
    assert rc == 0 and one[0] == 0, (out, err, one)
    assert _text(out) == _text(one[1]) and _text(out).strip(), (out, one[1])
    assert out.count("=" * 10) == 1, out  # rank 0 alone prints
    assert err.count(PARALLEL) == 1, err
    # Our own stderr lines (none, as shipped) are one process's, printed once.
    ours = [l for l in err.splitlines() if l.startswith("flashnorm-mlx")]
    assert ours == [l for l in one[2].splitlines() if l.startswith("flashnorm-mlx")]
    assert "Traceback" not in err, err


def test_chat_two_ranks_replies_as_one_process(models):
    """Sampling at temperature 0.7 with a seed: every rank must draw rank 0's
    tokens. mlx.launch passes stdin to every rank but not its end: /quit ends.
    The seed is past 2**32, as mlx-lm takes one (limits.py): the ranks agree on
    all 64 bits. The `mlx.launch` script itself, unchanged (the other tests run
    mlx's launcher through tests/quiet_launch.py, which changes how it waits)."""
    seed = str(2**63 + 3)
    args = ["chat", models["qwen2"], "-m", "10", "--temp", "0.7", "--seed", seed]
    stdin = "hi\nhow are you\n/quit\n"
    rc, out, err, _ = launch(2, cli(*args), stdin=stdin, genuine=True)
    one = run_bounded([sys.executable, *cli(*args)], stdin=stdin)

    def replies(text):  # the stats lines carry timings
        return [l for l in text.splitlines() if "tok/s" not in l]

    assert rc == 0 and replies(out) == replies(one[1]), (out, err, one[1])
    assert sum("tok/s" in l for l in out.splitlines()) == 2, out
    assert err.count(PARALLEL) == 1, err


def test_bench_two_ranks_reports_world_size(models, tmp_path):
    """stock, FlashNorm and nonorm of an OpenELM whose layers have 3, 4 and 5
    key/value heads, none of which splits over 2 ranks evenly."""
    report = tmp_path / "bench.json"
    args = ["bench", models["openelm"], "-p", "8", "-g", "3", "-n", "1"]
    rc, out, err, _ = launch2(cli(*args, "--dtype", "float32", "--json", str(report)))
    assert rc == 0 and report.exists(), (out, err)
    result = json.loads(report.read_text())
    assert result["settings"]["world_size"] == 2, result["settings"]
    assert result["settings"]["parallel"] == PARALLEL
    assert {"stock", "flashnorm", "nonorm"} <= set(result["variants"]), result
    for v, s in result["variants"].items():
        assert s["logits_finite"] and s["all_trials_finite"], (v, s)
    # The words, wherever the report's lines wrap (rich wraps at the width it sees).
    words = " ".join(out.split())
    assert words.count(PARALLEL) == 1 and words.count("wrote") == 1, out


def test_generate_on_openelm_prints_no_dependency_warning(tmp_path):
    """transformers warns that it does not know model_type openelm when the
    tokenizer is loaded: not an error, so not the user's to read."""
    path = tiny.make_openelm(tmp_path / "oe", tokenizer=True)
    args = cli("generate", str(path), "-p", "hi", "-m", "2")
    rc, out, err, _ = run_bounded([sys.executable, *args])
    assert rc == 0, err
    assert "model of type" not in err and "transformers" not in err, err


# --- failures end every rank with a message, in bounded time --------------------------


def test_a_layout_that_cannot_be_split_is_one_line_from_all_ranks(tmp_path):
    """2 query heads over 3 ranks: every rank fails alike, one line says why."""
    path = _llama(tmp_path / "two_heads", num_attention_heads=2, num_key_value_heads=1)
    rc, out, err, _ = launch(3, cli("generate", str(path), "-p", "hi", "-m", "4"))
    errors = _error_lines(err)  # (mlx.launch exits 0 whatever its ranks did)
    assert len(errors) == 1, err
    assert "2 query heads" in errors[0] and "at most 2 ranks" in errors[0], err
    assert "rank" not in errors[0].split("error:")[1].split()[0], err  # rank 0's
    assert "Traceback" not in err, err


def test_a_rank_that_fails_loading_is_the_one_line(models):
    """Rank 1 alone cannot read the model (say, a path missing on its host): its
    line, and rank 0 stops without one of its own."""
    child = str(Path(distributed_child.__file__))
    args = [child, "fail-load", models["llama_4to1"], "-p", "hi", "-m", "4"]
    rc, out, err, _ = launch2(args)
    errors = _error_lines(err)
    assert len(errors) == 1, err
    assert "rank 1: " in errors[0] and "test: rank 1 cannot read" in errors[0], err
    assert "Traceback" not in err, err


def test_a_rank_that_exits_stops_the_other_with_one_line(models):
    child = str(Path(distributed_child.__file__))
    args = [child, "die", models["llama_5to1"], "-p", "hi", "-m", "40", "--temp", "0"]
    rc, out, err, secs = launch2(args, env={"FLASHNORM_DIST_TIMEOUT": "10"})
    # MLX's ring either reports the lost peer at once, or retries its socket and
    # stalls; then the watchdog stops rank 0. Both end it with one error line.
    errors = _error_lines(err)
    assert len(errors) == 1, err
    assert (
        "lost contact with the other ranks" in errors[0]
        or "no progress for" in errors[0]
    ), err
    assert "Traceback" not in err, err
    print(f"rank 1 exited: rank 0 stopped, launch over in {secs:.1f} s")


def test_a_rank_that_stops_answering_times_out(models):
    child = str(Path(distributed_child.__file__))
    args = [child, "hang", models["llama_5to1"], "-p", "hi", "-m", "40", "--temp", "0"]
    rc, out, err, secs = launch2(args, env={"FLASHNORM_DIST_TIMEOUT": "3"})
    assert "no progress for 3 s while generating" in err, err
    assert "Traceback" not in err, err
    assert secs < 90, secs


def test_connecting_to_a_rank_that_never_comes_times_out(models, tmp_path):
    """Rank 0 of 2 alone: mx.distributed.init would wait forever."""
    port = _free_ports(2)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = {"MLX_RANK": "0", "MLX_HOSTFILE": str(hosts), "FLASHNORM_DIST_TIMEOUT": "2"}
    args = ["generate", models["llama_5to1"], "-p", "hi", "-m", "4"]
    rc, out, err, secs = run_bounded([sys.executable, *cli(*args)], env, timeout=60)
    assert rc != 0 and "no progress for 2 s while connecting" in err, (rc, err)
    assert secs < 30, secs


def test_commands_without_tensor_parallelism_refuse_a_launch(
    models, monkeypatch, capsys
):
    """Rank 0 says so; the other ranks, which parsed the same arguments, do not."""
    from flashnorm_mlx.cli import verify

    monkeypatch.setenv("MLX_HOSTFILE", "/nonexistent/hosts.json")
    errors = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("MLX_RANK", rank)
        assert verify.main([models["llama_5to1"]]) == 1
        errors[rank] = _error_lines(capsys.readouterr().err)
    assert len(errors["0"]) == 1 and not errors["1"], errors
    assert "only generate, chat and bench run tensor-parallel" in errors["0"][0]


# --- what cannot be split: checked before anything runs ------------------------------


class _Rank:
    """Rank `r` of an `n`-process group, for splitting weights in one process
    (the split reads only size and rank; nothing here runs a collective)."""

    def __init__(self, r, n=2):
        self.r, self.n = r, n

    def size(self):
        return self.n

    def rank(self):
        return self.r


def test_layouts_that_cannot_be_split_are_one_clear_error(tmp_path):
    """Fewer query heads than ranks: every rank needs one."""
    path = _llama(tmp_path / "two", num_attention_heads=2, num_key_value_heads=1)
    source = read_source(str(path))
    for mode in (FLASHNORM, STOCK, NONORM):
        with pytest.raises(sharding.ShardError, match="2 query heads.*at most 2"):
            build_model(source, mode, dtype=mx.float32, group=_Rank(0, 3))
    oe = read_source(str(tiny.make_openelm(tmp_path / "oe")))  # 4, 6, 8 query heads
    with pytest.raises(sharding.ShardError, match="layer 0.*4 query heads"):
        build_model(oe, FLASHNORM, dtype=mx.float32, group=_Rank(0, 5))


def test_quantization_groups_that_do_not_split_are_one_clear_error(tmp_path):
    # down_proj reads 32 columns: one 32-group, and each of 2 ranks needs one.
    source = read_source(str(_llama(tmp_path / "m", intermediate_size=32)))
    with pytest.raises(sharding.ShardError, match="down_proj.*1 quantization gr"):
        build_model(source, FLASHNORM, quantize=(4, 32), group=_Rank(0))
    # head_dim 16, 4:2 over 3 ranks: query heads 1|1|2, o_proj cut at column 16.
    cfg = dict(tiny.qwen_config("qwen3_tied"), num_attention_heads=4)
    qwen = read_source(str(tiny.write_model(tmp_path / "q4", cfg, _qwen3(cfg))))
    with pytest.raises(sharding.ShardError, match="o_proj.*groups of 32"):
        build_model(qwen, FLASHNORM, quantize=(4, 32), group=_Rank(0, 3))


def _qwen3(cfg):
    w = tiny.llama_weights(cfg)
    h = cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        for n in ("q_norm", "k_norm"):
            w[f"model.layers.{i}.self_attn.{n}.weight"] = np.ones(h, np.float32)
    return w


def test_a_model_without_shard_is_one_clear_error():
    class NoShard(nn.Module):
        model_type = "other"

    with pytest.raises(sharding.ShardError, match="has no tensor-parallel shard"):
        sharding.shard_model(NoShard(), _Rank(0), "m")


@pytest.mark.parametrize("n", SIZES)
def test_each_rank_holds_whole_groups(tmp_path, n):
    """5 query heads, 1 key/value head, q|k|v and FFN biases, over n ranks: the
    ranks' query rows (weight and bias) in rank order are the whole layer's;
    every rank's key/value rows are those its query heads attend to in the
    whole layer; o_proj's columns and the FFN's hidden columns are cut alike."""
    cfg = dict(tiny.llama_config("odd_sizes"), attention_bias=True, mlp_bias=True)
    source = read_source(str(tiny.write_model(tmp_path, cfg, tiny.llama_weights(cfg))))
    whole = build_model(source, FLASHNORM, dtype=mx.float32)[0].layers[1]
    ranks = [
        build_model(source, FLASHNORM, dtype=mx.float32, group=_Rank(r, n))[0]
        for r in range(n)
    ]
    ranks = [m.layers[1] for m in ranks]
    a = whole.self_attn
    h, hq, hkv = a.head_dim, a.n_heads, a.n_kv_heads
    group = hq // hkv

    def heads(x, count):  # rows -> (heads, h, ...)
        return np.array(x).reshape(count, h, *np.array(x).shape[1:])

    for key in ("qkv_proj", "qkv_bias"):
        full = a[key].weight if key == "qkv_proj" else a[key]
        full = heads(full, hq + 2 * hkv)
        q_parts, q_seen = [], 0
        for layer in ranks:
            r = layer.self_attn
            part = r[key].weight if key == "qkv_proj" else r[key]
            part = heads(part, r.n_heads + 2 * r.n_kv_heads)
            assert r.n_heads % r.n_kv_heads == 0, (r.n_heads, r.n_kv_heads)
            q_parts.append(part[: r.n_heads])
            local_group = r.n_heads // r.n_kv_heads
            for i in range(r.n_heads):  # local head i attends to local kv i // g
                kv = (q_seen + i) // group
                j = r.n_heads + i // local_group
                np.testing.assert_array_equal(part[j], full[hq + kv], err_msg=key)
                j += r.n_kv_heads
                np.testing.assert_array_equal(part[j], full[hq + hkv + kv])
            q_seen += r.n_heads
        np.testing.assert_array_equal(np.concatenate(q_parts), full[:hq], err_msg=key)
    o = np.concatenate([np.array(l.self_attn.o_proj.weight) for l in ranks], axis=1)
    np.testing.assert_array_equal(o, np.array(a.o_proj.weight))
    gu = np.array(whole.mlp.gate_up_proj.weight)
    half = gu.shape[0] // 2
    parts = [np.split(np.array(l.mlp.gate_up_proj.weight), 2) for l in ranks]
    np.testing.assert_array_equal(np.concatenate([g for g, _ in parts]), gu[:half])
    np.testing.assert_array_equal(np.concatenate([u for _, u in parts]), gu[half:])
    down = np.concatenate([np.array(l.mlp.down_proj.weight) for l in ranks], axis=1)
    np.testing.assert_array_equal(down, np.array(whole.mlp.down_proj.weight))
    widths = [l.mlp.down_proj.weight.shape[1] for l in ranks]
    assert max(widths) - min(widths) <= 1, widths  # as even as can be


def test_shard_model_lets_ours_shard_themselves_and_splits_mlx_lms_by_layers(
    tmp_path, monkeypatch
):
    """Our classes split themselves (`Model.shard`); mlx-lm's (stock, nonorm) go
    through `shard_layers`, since mlx-lm's own shard needs head counts that divide."""
    source = read_source(str(tiny.make_llama(tmp_path, "gqa_untied", tokenizer=False)))
    calls = []
    monkeypatch.setattr(sharding, "shard_layers", lambda *a: calls.append("layers"))
    group = type("Group", (), {"size": lambda self: 2})()
    ours, _ = build_model(source, FLASHNORM, dtype=mx.float32, engine="eager")
    monkeypatch.setattr(type(ours), "shard", lambda self, g: calls.append("own"))
    sharding.shard_model(ours, group)
    stock, _ = build_model(source, STOCK, dtype=mx.float32)
    sharding.shard_model(stock, group)
    assert calls == ["own", "layers"], calls


def test_a_sharded_build_opens_its_own_handles_of_a_folders_weights(tmp_path):
    """A rank cuts its shard from weights opened for its build alone, so the full
    tensors it read are freed once cut; weights that are not what the folder's
    files hold (or no folder) are the source's own."""
    from flashnorm_mlx.loading import Source, build

    path = tiny.make_llama(tmp_path, "gqa_untied", tokenizer=False)
    source = read_source(str(path), need_tokenizer=False)
    fresh = build._own_handles(source)
    assert fresh.keys() == source.weights.keys()
    assert all(fresh[k] is not v for k, v in source.weights.items())
    assert all(mx.array_equal(fresh[k], v).item() for k, v in source.weights.items())
    changed = {**source.weights, "extra.weight": mx.zeros((1,))}
    other = Source(source.name, source.config, changed, files=source.files)
    assert build._own_handles(other) is changed
    assert source.files and all(f.startswith(str(path)) for f in source.files)
    unfiled = Source(source.name, source.config, source.weights, folder=path)
    assert build._own_handles(unfiled) is source.weights
