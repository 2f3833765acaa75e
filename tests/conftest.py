import os
import sys
import tempfile
from pathlib import Path

# tiny.py (test model builders) is imported by the test modules as `tiny`.
sys.path.insert(0, str(Path(__file__).parent))

# mx.compile writes into $TMPDIR/mlx: keep it private to the test run.
if "FLASHNORM_TEST_TMP" not in os.environ:
    os.environ["FLASHNORM_TEST_TMP"] = tempfile.mkdtemp(prefix="flashnorm-tests-")
    os.environ["TMPDIR"] = os.environ["FLASHNORM_TEST_TMP"]
    tempfile.tempdir = None


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


def pytest_collection_modifyitems(items):
    import pytest

    for item in items:
        name = item.path.name
        part = next((p for p, files in PARTS.items() if name in files), "tools")
        item.add_marker(getattr(pytest.mark, part))
