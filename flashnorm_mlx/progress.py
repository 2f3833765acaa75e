"""The one progress bar of the long library jobs (convert, perplexity, GPTQ).

On stderr, gone when done, off when not wanted (the CLI turns it off when
stderr is not a terminal and prints a plain line per stage instead).
"""

from typing import Callable

from . import interrupt


def progress_bar(enabled: bool, label: str = "{task.description}"):
    """A rich Progress: `label` (a format of the task), bar, done/total, time."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    class Bar(Progress):
        """Taken down before Ctrl-C's line (interrupt.py), cursor restored."""

        def __enter__(self):
            self._interrupt = interrupt.live(self.stop)
            self._interrupt.__enter__()
            return super().__enter__()

        def __exit__(self, *exc):
            try:
                super().__exit__(*exc)
            finally:
                self._interrupt.__exit__(None, None, None)

    return Bar(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=True,
    )


def counter(bar, task, total: int, step: Callable[[str], None], line: str):
    """advance(n): `task` of `bar` moved on by n, and `step` told `line` with
    {done} and {total} filled in; advance(0) says where the work starts."""
    done = [0]

    def advance(n: int) -> None:
        bar.advance(task, n)
        done[0] += n
        step(line.format(done=done[0], total=total))

    return advance
