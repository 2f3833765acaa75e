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
