"""Per-test seconds measured by the suite itself, kept in tests/durations.json.

`FLASHNORM_RECORD_DURATIONS=1 pytest` (the whole suite, or some files: their
entries are replaced, the rest kept) writes each test function's seconds (its
setup and calls, every parametrization, less the module fixtures it happened
to build), each module fixture's setup and each file's whole run.
tests/conftest.py reads the record: a test or module fixture of SLOW_S or more
is marked slow, and pytest-xdist gets the heaviest files first.
"""

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

PATH = Path(__file__).with_name("durations.json")
SWITCH = "FLASHNORM_RECORD_DURATIONS"
SLOW_S = 4.0  # from here on out of the developer loop, `pytest -m "not slow"`
KEEP_S = 0.5  # tests and fixtures under this are left out: they change nothing

_running = {}  # this process's test item being set up (a pytest-xdist worker's)
_seen = {"tests": defaultdict(float), "fixtures": {}, "files": defaultdict(float)}


def read(path: Path = PATH) -> dict:
    """The record: {"tests": {"file::test": s}, "fixtures": {"file::name": s},
    "files": {"file": s}}; empty where there is none."""
    record = json.loads(path.read_text()) if path.exists() else {}
    return {k: record.get(k, {}) for k in ("tests", "fixtures", "files")}


def is_slow(record: dict, file: str, test: str, fixtures=()) -> bool:
    """Does `test` (a function's name, every parametrization) of `file` take
    SLOW_S or more, or use a module fixture of `file` that does?"""
    if record["tests"].get(f"{file}::{test}", 0) >= SLOW_S:
        return True
    return any(record["fixtures"].get(f"{file}::{f}", 0) >= SLOW_S for f in fixtures)


def _recording() -> bool:
    return os.environ.get(SWITCH) == "1"


def _where(nodeid: str):
    """("test_x.py", "test_name") of a node id, parameters dropped."""
    parts = nodeid.split("::")
    return Path(parts[0]).name, parts[-1].split("[")[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _running["item"] = item
    yield
    _running.pop("item", None)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A wider fixture's setup, told to the report of the test it ran for (the
    report crosses from a pytest-xdist worker with its user_properties)."""
    start = time.perf_counter()
    yield
    item = _running.get("item")
    if _recording() and item is not None and fixturedef.scope != "function":
        seconds = time.perf_counter() - start
        item.user_properties.append(("fixture_s", (fixturedef.argname, seconds)))


def pytest_runtest_logreport(report):
    if not _recording() or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    file, test = _where(report.nodeid)
    _seen["files"][file] += report.duration
    if report.when == "teardown":
        return
    seconds = report.duration
    for key, value in report.user_properties:
        if key == "fixture_s" and report.when == "setup":
            name, s = value
            _seen["fixtures"][f"{file}::{name}"] = round(s, 1)
            seconds -= s
    _seen["tests"][f"{file}::{test}"] += max(seconds, 0.0)


def merged(old: dict, seen: dict) -> dict:
    """`old` with every entry of the files `seen` ran replaced by `seen`'s."""
    ran = set(seen["files"])
    out = {}
    for kind in ("tests", "fixtures", "files"):
        kept = {k: v for k, v in old[kind].items() if k.split("::")[0] not in ran}
        new = {k: round(v, 1) for k, v in seen[kind].items()}
        if kind != "files":
            new = {k: v for k, v in new.items() if v >= KEEP_S}
        out[kind] = dict(sorted({**kept, **new}.items()))
    return out


def pytest_sessionfinish(session):
    if not _recording() or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if _seen["files"]:
        path = Path(os.environ.get("FLASHNORM_DURATIONS_FILE", PATH))
        note = json.loads(path.read_text()).get("note") if path.exists() else None
        record = {**({"note": note} if note else {}), **merged(read(path), _seen)}
        path.write_text(json.dumps(record, indent=1) + "\n")
