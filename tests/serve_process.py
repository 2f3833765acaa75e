"""A `flashnorm-mlx serve` process for the serve tests (test_serve, test_serve_batch)."""

import http.client
import json
import os
import re
import subprocess
import sys
import threading

import openai
import pytest

START_TIMEOUT = 240  # loading the model on a busy 2-core CPU
REQUEST_TIMEOUT = 120


class Server:
    """A `flashnorm-mlx serve` process on a free port; its stderr kept as lines."""

    def __init__(self, *args, env=None, api_key="none"):
        """args: serve's flags; env: extra environment; api_key: what client()
        sends by default."""
        self.api_key = api_key
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flashnorm_mlx", "serve", *args, "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if not self.ready.wait(START_TIMEOUT) or self.proc.poll() is not None:
            self.kill()
            pytest.fail(f"server did not start:\n{self.log()}")
        url = next(
            re.search(r"(http://\S+)/v1", x) for x in self.lines if " on http" in x
        )
        self.url = url.group(1)
        self.port = int(self.url.rsplit(":", 1)[1])

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if " on http://" in line:
                self.ready.set()
        self.ready.set()  # exited

    def log(self) -> str:
        return "\n".join(self.lines)

    def client(self, timeout=REQUEST_TIMEOUT, key=None):
        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=key or self.api_key,
            max_retries=0,
            timeout=timeout,
        )

    def request(self, method, path, body=None, headers=None, timeout=REQUEST_TIMEOUT):
        """(status, parsed JSON or raw text) of one plain HTTP request."""
        return self.request_auth(method, path, body, headers, timeout)[:2]

    def request_auth(
        self, method, path, body=None, headers=None, timeout=REQUEST_TIMEOUT
    ):
        """request's (status, body), and the answer's WWW-Authenticate header."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body)
            conn.request(method, path, body=data, headers=headers or {})
            r = conn.getresponse()
            raw = r.read().decode()
        finally:
            conn.close()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw
        return r.status, parsed, r.getheader("WWW-Authenticate")

    def stop(self, sig, timeout=30) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self.reader.join(10)  # its last lines
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
