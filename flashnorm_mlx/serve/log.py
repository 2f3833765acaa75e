"""serve's log: one line on stderr per event, under one prefix, from any thread."""

import sys

LOG_PREFIX = "flashnorm-mlx serve:"


def log(line: str) -> None:
    print(f"{LOG_PREFIX} {line}", file=sys.stderr, flush=True)
