"""Run `flashnorm-mlx generate ARGS...` in this fresh process, then print the
process's peak MLX memory in bytes on the last line (tests/test_load_memory.py:
the peak is process-wide, so each mode gets a process of its own)."""

import sys

import mlx.core as mx

from flashnorm_mlx.cli import main

if __name__ == "__main__":
    rc = main(["generate", *sys.argv[1:]])
    print(f"peak_bytes {mx.get_peak_memory()}", flush=True)
    sys.exit(rc)
