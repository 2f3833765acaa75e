"""The errors every layer raises for bad input; the CLI prints each as one line.

One hierarchy: `run_main` (cli/common.py) catches `FlashNormError` and prints
`flashnorm-mlx: error: <message>`. Subclasses say where it came from, for
callers that want to tell them apart; the ones for a bad config or bad
weights are ValueErrors too.
"""


class FlashNormError(Exception):
    """Bad user input or a state the command cannot run in: one line, exit 1."""


class LoadError(FlashNormError):
    """A model that cannot be read or built: missing or corrupt files, weights
    that do not fit the config, flags the weights cannot honour."""


class UnsupportedModel(LoadError, ValueError):
    """A config whose model_type no model file covers."""


class FoldError(LoadError, ValueError):
    """Weights that cannot be folded as asked (e.g. quantized ones)."""


class BenchError(LoadError):
    """Benchmark settings no run can use (unknown variant, no trials, ...)."""


class UserError(FlashNormError):
    """A bad flag or input a command found itself."""


class ChatError(FlashNormError):
    """A chat turn that cannot run (e.g. a message larger than the context)."""


class ContextOverflow(ChatError):
    """A message that does not fit the context even alone."""


class ShardError(LoadError):
    """A model that cannot be split over the group of a launch."""


class PeerFailed(LoadError):
    """Another rank failed before the first barrier and said why: this rank
    stops without a line of its own."""


class JoinError(LoadError):
    """This rank could not join the launch: its own line, whatever the others do."""


class DtypeError(LoadError, ValueError):
    """A compute dtype that is not float16, bfloat16 or float32."""
