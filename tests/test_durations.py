"""The suite's own timings (tests/durations.py): a real pytest run, with and
without pytest-xdist, writes what it measured; the record marks slow what is.

Reference: the seconds each test of a small suite sleeps, at least, and its
module fixture's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import durations
import pytest

TESTS = Path(__file__).parent

SUITE = """
import time

import pytest


@pytest.fixture(scope="module")
def server():
    time.sleep(0.6)
    return 1


@pytest.mark.parametrize("n", [1, 2])
def test_sleeps(n):
    time.sleep(0.3)


def test_uses_the_server(server):
    time.sleep(0.1)


def test_quick():
    pass
"""


def _env(out: Path) -> dict:
    """This environment for a pytest of its own: not a worker of this run's
    pytest-xdist, the recorder off, writing to `out`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.pop(durations.SWITCH, None)
    return dict(env, PYTHONPATH=str(TESTS), FLASHNORM_DURATIONS_FILE=str(out))


def _record(tmp_path, *args, old=None):
    """Run SUITE under the recorder (its own pytest, this suite's conftest
    left out); the record it leaves."""
    (tmp_path / "test_small.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "durations.json"
    if old is not None:
        out.write_text(json.dumps(old))
    env = _env(out)
    env[durations.SWITCH] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "durations", *args]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return durations.read(out)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one_process", "xdist"])
def test_a_run_writes_each_tests_and_fixtures_seconds(tmp_path, workers):
    old = {  # another file's entries stay, and the note; this file's are replaced
        "note": "how it was measured",
        "tests": {"test_other.py::test_a": 9.0, "test_small.py::test_gone": 9.0},
        "fixtures": {},
        "files": {"test_other.py": 9.0, "test_small.py": 99.0},
    }
    record = _record(tmp_path, *workers, old=old)
    tests, fixtures = record["tests"], record["fixtures"]
    print(record)
    # Both parametrizations in one entry; under KEEP_S left out.
    assert 0.6 <= tests["test_small.py::test_sleeps"] < 3, tests
    assert "test_small.py::test_quick" not in tests, tests
    # The module fixture's setup is its own, not the test's that built it.
    assert 0.6 <= fixtures["test_small.py::server"] < 3, fixtures
    assert "test_small.py::test_uses_the_server" not in tests, tests
    assert 1.3 <= record["files"]["test_small.py"] < 6, record["files"]
    assert (
        tests["test_other.py::test_a"] == 9.0
        and "test_small.py::test_gone" not in tests
    )
    written = json.loads((tmp_path / "durations.json").read_text())
    assert written["note"] == old["note"], written


def test_without_the_switch_nothing_is_written(tmp_path):
    (tmp_path / "test_small.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "durations.json"
    env = _env(out)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "durations"]
    subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, check=True)
    assert not out.exists()


def test_the_record_marks_slow_tests_and_fixtures_over_slow_s():
    record = {
        "tests": {"test_a.py::test_long": durations.SLOW_S, "test_a.py::test_x": 3.9},
        "fixtures": {"test_a.py::server": 50.0},
        "files": {},
    }
    slow = lambda test, fixtures=(): durations.is_slow(
        record, "test_a.py", test, fixtures
    )
    assert slow("test_long") and not slow("test_x") and not slow("test_new")
    assert slow("test_x", ["tmp_path", "server"])
    assert not durations.is_slow(record, "test_b.py", "test_long", ["server"])
