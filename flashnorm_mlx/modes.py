"""The modes: how a model handles its norms (--mode, bench's rows), one record
each that says what is built: on which weights, by which class, and what is
done to it after. build_model (loading/build.py) and the rest ask the record;
nothing compares a mode's name. Rows of a run (mode x engine) are
loading/rows.py's. No MLX here: the flags and models/ read it too.
"""

from dataclasses import dataclass
from typing import Union

from .errors import LoadError


@dataclass(frozen=True)
class Mode:
    """How a model handles its norms (--mode, bench's rows): what is built."""

    name: str
    about: str  # one line, for the user
    ours: bool  # run by our class (models/), else by mlx-lm's own
    calibrated: bool = False  # on nonorm's calibrated weights, not convert's recipe's
    stacks: bool = False  # q|k|v, gate|up stacked once built (loading/stock_fused.py)

    @property
    def is_mlx_lms(self) -> bool:
        """mlx-lm's own model, as mlx-lm builds it: nothing of FlashNorm's."""
        return not (self.ours or self.calibrated or self.stacks)

    @property
    def needs_cover(self) -> bool:
        """Built with FlashNorm's description of the family (models/arch.py):
        only for a model_type FlashNorm covers."""
        return not self.is_mlx_lms

    def __str__(self) -> str:
        return self.name


STOCK = Mode("stock", "mlx-lm's own model class on the weights", ours=False)
STOCK_FUSED = Mode(
    "stock_fused",
    "stock with q|k|v and gate|up each one matmul (loading/stock_fused.py)",
    ours=False,
    stacks=True,
)
NONORM = Mode(
    "nonorm",
    "stock with every RMSNorm removed: the speed bound (loading/nonorm.py)",
    ours=False,
    calibrated=True,
)
FLASHNORM = Mode(
    "flashnorm", "ours: gains folded or in the kernels, 1/RMS deferred", ours=True
)
MODES = {m.name: m for m in (STOCK, STOCK_FUSED, NONORM, FLASHNORM)}
RUN_MODES = (STOCK.name, FLASHNORM.name)  # what a user runs (--mode), perplexity scores


def mode_named(mode: Union[str, Mode]) -> Mode:
    """The Mode `mode` names (a Mode: itself); LoadError for an unknown name."""
    if isinstance(mode, Mode):
        return mode
    if mode not in MODES:
        raise LoadError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return MODES[mode]
