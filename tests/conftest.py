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
