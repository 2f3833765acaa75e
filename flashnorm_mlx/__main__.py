import sys

from .interrupt import at_start, exit_now

# First: Ctrl-C while MLX imports is one line and exit 130 (interrupt.py), its
# line naming the command (checked against the commands later, in cli.main).
word = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1].isidentifier() else ""
at_start(f"flashnorm-mlx {word}".strip())
try:
    from .cli import main

    status = main()
except KeyboardInterrupt:  # outside main's own handling: still one line
    exit_now()
sys.exit(status)
