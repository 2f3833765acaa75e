"""`mlx.launch` for the tests: mlx's own launcher, its rank threads waiting
instead of polling flat out.

Each rank's thread in mlx's launcher (mlx 0.32) asks select() whether the rank's
stdin pipe is writable even when it has nothing to write; a pipe nearly always
is, so the thread loops without sleeping: about half of a 2-rank launch's CPU on
the 2-core test machine. Here such a call first waits up to WAIT_S for the
rank's output, then asks as mlx does without waiting: the same ranks, the same
relaying, stdin written at most WAIT_S later. Its own stdin must stay open (a
terminal's does): at end of file mlx's main loop polls flat out as well.
"""

import select as _select
import sys

from mlx._distributed_utils import launch

WAIT_S = 0.05


def select(rlist, wlist, xlist, timeout=None):
    if wlist and timeout:  # a rank thread, not yet exited: wait for its output
        _select.select(rlist, [], xlist, min(timeout, WAIT_S))
        timeout = 0
    return _select.select(rlist, wlist, xlist, timeout)


if __name__ == "__main__":
    launch.select = select
    sys.exit(launch.main())
