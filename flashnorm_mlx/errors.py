"""The error every layer raises for bad user input; the CLI prints it as one line."""


class LoadError(Exception):
    """Bad user input (missing file, corrupt weights, unsupported model): one line."""
