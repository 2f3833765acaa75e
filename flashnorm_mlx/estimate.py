"""Say what will be slow before it is (docs/design.md section 4f).

A long job (bench's generations, perplexity's batches, /compare's rows,
GPTQ's calibration and layers) measures its first piece, multiplies by the
pieces left, and says so in one line where that comes to more than SLOW_S:
a user learns at once that a run will take minutes, not after them. Only
the line's presence depends on the clock; what it says is the measurement.
"""

import os
from typing import Callable, Optional

SLOW_S = 60.0  # what is left, in seconds, worth a line
SLOW_ENV = "FLASHNORM_MLX_SLOW_S"  # overrides SLOW_S (tests: 0 and 1e9)

Say = Optional[Callable[[str], None]]


def threshold() -> float:
    """SLOW_S, or the number in $FLASHNORM_MLX_SLOW_S."""
    try:
        return float(os.environ.get(SLOW_ENV, SLOW_S))
    except ValueError:
        return SLOW_S


def duration(seconds: float) -> str:
    """Rounded for a person: '40 s', '6 min', '1.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def projection(
    piece: str, piece_s: float, left: float, what: str = "", hint: str = ""
) -> Optional[str]:
    """The line for `left` more pieces like `piece`, which took piece_s: e.g.
    'GPTQ on the CPU: about 6 min more at this pace (layer group 1 took 41.2 s;
    8 more like it to go); HINT'. None where they come to no more than
    `threshold()`."""
    rest = piece_s * left
    if left <= 0 or rest <= threshold():
        return None
    count = f"{left:.0f}" if float(left).is_integer() else f"{left:.1f}"
    line = (
        f"{what + ': ' if what else ''}about {duration(rest)} more at this pace "
        f"({piece} took {piece_s:.1f} s; {count} more like it to go)"
    )
    return f"{line}; {hint}" if hint else line


def tell(say: Say, line: Optional[str]) -> bool:
    """`say` the line, if there is one and someone to tell; whether it was said."""
    if say is None or line is None:
        return False
    say(line)
    return True
