import os
import sys
import tempfile
from pathlib import Path

import durations
import pytest

# tiny.py (test model builders) is imported by the test modules as `tiny`.
sys.path.insert(0, str(Path(__file__).parent))

# mx.compile writes into $TMPDIR/mlx: keep it private to the test run.
if "FLASHNORM_TEST_TMP" not in os.environ:
    os.environ["FLASHNORM_TEST_TMP"] = tempfile.mkdtemp(prefix="flashnorm-tests-")
    os.environ["TMPDIR"] = os.environ["FLASHNORM_TEST_TMP"]
    tempfile.tempdir = None
# Each pytest-xdist worker (pyproject's addopts) in its own folder under it: mlx
# writes a compiled kernel's .so where another process may be loading the same.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _worker = Path(os.environ["FLASHNORM_TEST_TMP"], os.environ["PYTEST_XDIST_WORKER"])
    _worker.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(_worker)
    tempfile.tempdir = None

# Before any test module imports mlx.core: the system's OpenBLAS where there is
# one (flashnorm_mlx/blas.py), so the suite runs on what the CLI runs on; one
# thread per xdist worker, since the workers fill the cores already.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import flashnorm_mlx  # noqa: E402, F401

# The suite in parts, each well under 10 minutes even where the whole suite is
# slower (a CUDA build): `pytest -m kernels`, `-m models`, `-m tools`.
PARTS = {
    "kernels": {
        "test_kernels.py",
        "test_dispatch.py",
        "test_nvrtc.py",
        "test_metal_host.py",
        "test_kernel_state.py",
    },
    "models": {
        "test_llama.py",
        "test_dense.py",
        "test_ministral3.py",
        "test_qwen3_5.py",
        "test_lfm2.py",
        "test_glm4_moe.py",
        "test_deepseek_v3.py",
        "test_llama4.py",
        "test_nemotron_h.py",
        "test_granitemoehybrid.py",
        "test_gemma4.py",
        "test_openelm.py",
        "test_qwen.py",
        "test_gemma3.py",
        "test_moe.py",
        "test_gguf.py",
        "test_gguf_kquant.py",
        "test_real_model.py",
        "test_stored.py",
    },
}


# The developer loop, `pytest -m "not slow"`: every test file, the tests and
# module fixtures past durations.SLOW_S in the suite's own measurement
# (tests/durations.json, refreshed by `FLASHNORM_RECORD_DURATIONS=1 pytest`)
# left out; tests/durations.py records and reads it.
DURATIONS = durations.read()


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("durations"):  # `-p durations` given
        config.pluginmanager.register(durations, "durations")


# Tests that start mlx.launch ranks, which spin while they wait for each other:
# one launch at a time (one pytest-xdist group), else two launches' ranks take
# turns on the 2 cores. A file name: all its tests.
LAUNCHES = {
    "test_distributed.py",
    "test_dense.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_ministral3.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_qwen3_5.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_lfm2.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_glm4_moe.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_deepseek_v3.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_nemotron_h.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_granitemoehybrid.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_gemma3.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
    "test_gemma4.py::test_two_rank_tensor_parallel_matches_one_process",
    "test_llama4.py::test_two_rank_tensor_parallel_matches_one_process",
    "test_llama4.py::test_moe_two_rank_tensor_parallel_matches_one_process",
    "test_moe.py::test_two_rank_tensor_parallel_matches_one_process_and_stock",
}


def is_slow(file: str, test: str, fixtures) -> bool:
    return durations.is_slow(DURATIONS, file, test, fixtures)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, 4 at most (each holds its models and, on a
    GPU, its own device context); on one core none (tests run in this process)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    n = min(n or os.cpu_count() or 1, 4)
    return n if n > 1 else 0


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (a file's tests on one worker, its module fixtures built
    once), and every test in LAUNCHES in one more group."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileAndLaunches(LoadFileScheduling):
        def _split_scope(self, nodeid):
            file, _, test = nodeid.partition("::")
            name = Path(file).name
            if {name, f"{name}::{test.split('[')[0]}"} & LAUNCHES:
                return "mlx.launch"
            return super()._split_scope(nodeid)

    return LoadFileAndLaunches(config, log)


def pytest_collection_modifyitems(items):
    for item in items:
        name = item.path.name
        part = next((p for p, files in PARTS.items() if name in files), "tools")
        item.add_marker(getattr(pytest.mark, part))
        test = getattr(item, "originalname", item.name)
        if is_slow(name, test, getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the heaviest files sent first
        items.sort(key=lambda item: -DURATIONS["files"].get(item.path.name, 0))
