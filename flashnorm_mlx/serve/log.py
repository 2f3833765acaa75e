"""serve's log: one line on stderr per event, under one prefix, from any thread,
at or above `--log-level` (mlx_lm.server's levels)."""

import sys
import threading

from ..limits import LOG_LEVELS as LEVELS  # mlx_lm.server's choices

LOG_PREFIX = "flashnorm-mlx serve:"
_threshold = LEVELS.index("INFO")
_write = threading.Lock()  # one write a line: threads' lines never run together


def set_level(name: str) -> None:
    """Lines below `name` (one of LEVELS) are not printed from now on."""
    global _threshold
    _threshold = LEVELS.index(name.upper())


def log(line: str, level: str = "INFO") -> None:
    if LEVELS.index(level) >= _threshold:
        with _write:
            sys.stderr.write(f"{LOG_PREFIX} {line}\n")
            sys.stderr.flush()
