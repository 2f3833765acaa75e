"""serve's --log-level and --prompt-cache-bytes (mlx_lm.server's flags): what
each changes in the server's log and its kept KV caches. Each server is
stopped with SIGINT before its log is read, so every line it wrote is in."""

import re
import signal

import pytest
import tiny
from serve_process import Server

PROMPT = "the quick brown fox jumps over the lazy dog"
DONE = re.compile(r"text \w+: prompt (\d+) tokens \((\d+) cached\)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.make_llama(tmp_path_factory.mktemp("serve-flags"))


def _twice(*flags, path) -> list:
    """The log of a server that answered the same prompt twice, then stopped."""
    server = Server(str(path), "--dtype", "float32", *flags)
    try:
        for _ in range(2):
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            status, r = server.request("POST", "/v1/completions", body)
            assert status == 200, r
        assert server.stop(signal.SIGINT) == 0, server.log()
    finally:
        server.kill()
    return server.lines


def test_info_logs_each_request_and_keeps_its_cache(model):
    """The reference: mlx_lm.server's defaults (INFO, no byte limit)."""
    lines = _twice(path=model)
    done = [DONE.search(l) for l in lines if DONE.search(l)]
    assert len(done) == 2, lines
    assert int(done[0][2]) == 0 and int(done[1][2]) > 0, lines  # the 2nd reuses
    assert not any("started, prompt" in l for l in lines), lines


def test_debug_adds_a_start_line_and_a_byte_limit_keeps_no_cache(model):
    lines = _twice("--log-level", "debug", "--prompt-cache-bytes", "1", path=model)
    done = [DONE.search(l) for l in lines if DONE.search(l)]
    assert [int(d[2]) for d in done] == [0, 0], lines  # nothing fits in 1 byte
    assert sum("started, prompt" in l for l in lines) == 2, lines


def test_warning_keeps_only_what_is_wrong(model):
    lines = _twice("--log-level", "WARNING", path=model)
    assert not any(DONE.search(l) or "stopp" in l for l in lines), lines
    assert any(" on http://" in l for l in lines), lines  # the ready line stays


def test_log_lines_from_threads_never_run_together(monkeypatch):
    """serve's log (serve/log.py) from 8 threads at once: each line is one
    write of a whole line, and no two writes overlap (#58: lines from threads
    ran together). The stand-in stderr yields inside each write, as a pipe
    may, so unlocked writers would meet there."""
    import sys
    import threading
    import time

    from flashnorm_mlx.serve import log as serve_log

    class Stderr:
        def __init__(self):
            self.writes, self.inside, self.overlaps = [], 0, 0

        def write(self, text):
            self.inside += 1
            self.overlaps += self.inside > 1
            time.sleep(0.0005)  # another thread runs here, if it may
            self.writes.append(text)
            self.inside -= 1

        def flush(self):
            pass

    err = Stderr()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(serve_log, "_threshold", 0)
    threads = [
        threading.Thread(
            target=lambda i=i: [
                serve_log.log(f"thread {i} line {j}") for j in range(20)
            ]
        )
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    bad = [
        w
        for w in err.writes
        if not (
            w.startswith(serve_log.LOG_PREFIX)
            and w.endswith("\n")
            and w.count("\n") == 1
        )
    ]
    print(
        f"{len(err.writes)} writes, {len(bad)} not a whole line, {err.overlaps} overlaps"
    )
    assert len(err.writes) == 160 and not bad and err.overlaps == 0, (
        bad[:3],
        err.overlaps,
    )
