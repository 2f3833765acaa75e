"""The one progress bar of the long library jobs (convert, perplexity, GPTQ).

On stderr, gone when done, off when not wanted (the CLI turns it off when
stderr is not a terminal and prints a plain line per stage instead).
"""


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

    return Progress(
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=True,
    )
