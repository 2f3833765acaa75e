"""First-token latency of a running `flashnorm-mlx serve`: N streamed chat
requests one after another, each timed from sending to its first content
chunk; and the HTTP layer's own share, 200 `GET /health` on one keep-alive
connection. Prints medians and spreads (docs/serve.md, "Measured").

    python scripts/serve-first-token.py http://127.0.0.1:8080 [N]
"""

import http.client
import json
import statistics
import sys
import time
from urllib.parse import urlsplit


def first_token_s(host: str, port: int, i: int) -> float:
    body = {
        # A new question each time: the prompt cache holds its prefix only.
        "messages": [{"role": "user", "content": f"Question {i}: what is {i} + 1?"}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
    }
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        t = time.perf_counter()
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        for line in resp:
            if line.startswith(b"data: {") and b'"content"' in line:
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    return time.perf_counter() - t
        raise SystemExit("the stream ended without a token")
    finally:
        conn.close()


def health_s(host: str, port: int, n: int = 200) -> list:
    conn = http.client.HTTPConnection(host, port, timeout=60)
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            out.append(time.perf_counter() - t)
    finally:
        conn.close()
    return out


def main():
    url = urlsplit(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    first_token_s(url.hostname, url.port, -1)  # warm-up, not counted
    times = [first_token_s(url.hostname, url.port, i) for i in range(n)]
    q = statistics.quantiles(times, n=4)
    print(
        f"first token over {n} requests: median {statistics.median(times) * 1000:.0f} ms, "
        f"quartiles {q[0] * 1000:.0f}-{q[2] * 1000:.0f} ms, "
        f"min {min(times) * 1000:.0f} ms"
    )
    h = health_s(url.hostname, url.port)
    print(
        f"GET /health over {len(h)} requests: median "
        f"{statistics.median(h) * 1000:.2f} ms, min {min(h) * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
