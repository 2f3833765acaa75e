"""Tensor parallelism under `mlx.launch`: joining, barriers, one error line, a watchdog.

Started by `mlx.launch -n N ...`, each command joins the launch's group, builds
its model split over it (sharding.py) and prints on rank 0 only.

Failures end every rank with one line in all: a rank that fails while loading
meets the others at their first barrier and the lowest failed rank alone
prints (`report_error`); a peer that exits later closes its socket (the
backend raises, `lost_peer_message` words it); a peer that never connects or
goes silent is caught by `Watchdog`, a tiny child process that stops this one
after FLASHNORM_DIST_TIMEOUT seconds (default 120) without progress.
"""

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional

import mlx.core as mx
import numpy as np

from ..errors import JoinError, LoadError, PeerFailed

TIMEOUT_ENV = "FLASHNORM_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0


def launch_backend() -> Optional[str]:
    """The backend `mlx.launch` (or mpirun) set this process up for, else None."""
    env = os.environ
    if "MLX_JACCL_COORDINATOR" in env or "MLX_IBV_DEVICES" in env:
        return "jaccl"
    if "MLX_RANK" in env and "NCCL_HOST_IP" in env:
        return "nccl"
    if "MLX_RANK" in env and _hostfile_lists_hosts(env.get("MLX_HOSTFILE")):
        return "ring"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    return None


def _hostfile_lists_hosts(path: Optional[str]) -> bool:
    """mlx.launch -n 1 hands its one rank an empty ring hostfile: one process."""
    try:
        return bool(path) and bool(open(path).read().strip())
    except OSError:
        return bool(path)  # let init say what is wrong with it


@dataclass
class Launch:
    """This process's place in a multi-process launch."""

    group: "mx.distributed.Group"
    backend: str
    watchdog: "Watchdog"
    # False until the first barrier: a rank that fails before it tells the
    # others there (report_error), so one line explains a failure, not N.
    settled: bool = False

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def describe(self) -> str:
        return describe(self.group)


_LAUNCH: Optional[Launch] = None


def describe(group) -> str:
    """How a model is split, e.g. "tensor parallel over 2 ranks (ring)"."""
    backend = f" ({_LAUNCH.backend})" if _LAUNCH and _LAUNCH.group is group else ""
    return f"tensor parallel over {group.size()} ranks{backend}"


def current() -> Optional[Launch]:
    """The launch `join` joined, or None in a single process."""
    return _LAUNCH


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise LoadError(f"{TIMEOUT_ENV}={raw!r}: expected seconds") from None
    if value <= 0:
        raise LoadError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number")
    return value


def join() -> Optional[Launch]:
    """Join the launch's group when started with more than one rank (connecting
    within the timeout); None when this is the only process."""
    global _LAUNCH
    backend = launch_backend()
    if backend is None:
        return None
    watchdog = Watchdog(timeout_s())
    watchdog.arm(f"connecting to the other ranks ({backend})")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        watchdog.close()
        raise JoinError(f"cannot start the {backend} group: {e}") from None
    watchdog.pause()
    if group.size() < 2:
        watchdog.close()
        return None
    watchdog.rank = group.rank()
    _LAUNCH = Launch(group, backend, watchdog)
    return _LAUNCH


def barrier(what: str) -> None:
    """Wait until every rank gets here (e.g. all loaded), bounded by the watchdog;
    PeerFailed where a rank failed on its way here (it says why, this one stops).

    Waits for this rank's queued work first: a generation step still running on
    mlx-lm's generation stream would otherwise meet this collective in a
    different order on each rank, and collectives pair up by order, not by name."""
    if _LAUNCH is None:
        return
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    with watch(f"waiting for the other ranks ({what})"):
        failed = _failed_ranks(False)
        if failed:
            _failed_ranks(False)  # the failed rank prints before anyone exits
    _LAUNCH.settled = True
    if failed:
        raise PeerFailed(f"rank {failed[0]} failed while {what}")


def _failed_ranks(failed: bool) -> List[int]:
    """The ranks that say they failed: one all_gather, every rank's flag."""
    flag = mx.array([int(failed)], dtype=mx.int32)
    flags = mx.distributed.all_gather(flag, group=_LAUNCH.group).tolist()
    return [r for r, f in enumerate(flags) if f]


def report_error(e: BaseException) -> None:
    """Print `e` as the command's one error line, where this rank should.

    One process: always. A launch's rank that failed before the first barrier
    (loading; the same bad input fails every rank alike): the ranks meet at it
    (barrier), and only the lowest failed rank prints. Before joining, rank 0
    alone prints (every rank parsed the same arguments), except a failure to
    join. After the first barrier, each failing rank prints its own line."""
    line = f"flashnorm-mlx: error: {rank_prefix()}{e}"
    if isinstance(e, PeerFailed):
        return
    if _LAUNCH is None:
        rank = _env_rank()
        if isinstance(e, JoinError) or not rank:
            prefix = f"rank {rank}: " if rank else ""
            print(f"flashnorm-mlx: error: {prefix}{e}", file=sys.stderr, flush=True)
        return
    if _LAUNCH.settled:
        print(line, file=sys.stderr, flush=True)
        return
    _LAUNCH.settled = True
    try:
        with watch("telling the other ranks about an error"):
            failed = _failed_ranks(True)
            if failed[0] == _LAUNCH.rank:
                print(line, file=sys.stderr, flush=True)
            _failed_ranks(True)
    except RuntimeError as lost:  # a peer gone as well: say this rank's own part
        if not is_collective_error(lost):
            raise
        print(line, file=sys.stderr, flush=True)


def _env_rank() -> Optional[int]:
    """This process's rank as the launcher set it (before joining), else None."""
    for key in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def announce() -> None:
    """After loading: every rank ready, and rank 0 says once how it is split."""
    if _LAUNCH is not None:
        barrier("loading")
        if _LAUNCH.rank == 0:
            print(_LAUNCH.describe(), file=sys.stderr, flush=True)


@contextmanager
def watch(what: str):
    """Collectives ahead: the other ranks must show progress (`kick`) within the
    timeout. No-op in a single process."""
    if _LAUNCH is None:
        yield
        return
    dog = _LAUNCH.watchdog
    outer = dog.what if dog.armed else None
    dog.arm(what)
    try:
        yield
    finally:
        dog.arm(outer) if outer else dog.pause()


def kick() -> None:
    """Progress was made (a token, a benchmark stage): restart the deadline."""
    if _LAUNCH is not None and _LAUNCH.watchdog.armed:
        _LAUNCH.watchdog.kick()


def watched(items: Iterable, what: str) -> Iterator:
    """`items` (e.g. stream_generate's responses) under `watch`, a kick per item;
    every rank finishes the last step before any goes on."""
    with watch(what):
        for item in items:
            kick()
            yield item
    barrier(what)


def kicking(fn: Callable) -> Callable:
    """`fn` that kicks the watchdog first (a streaming callback)."""
    if _LAUNCH is None:
        return fn

    def wrapper(*args, **kwargs):
        kick()
        return fn(*args, **kwargs)

    return wrapper


def shared_seed(seed: Optional[int]) -> Optional[int]:
    """One sampling seed for every rank (rank 0's), so samplers agree: ranks that
    drew different tokens would feed different inputs to the same collectives."""
    if _LAUNCH is None:
        return seed
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**31 - 1))
    # A seed takes 64 bits (limits.SEED_LIMIT): sent as four 16-bit parts,
    # each summed exactly in int32 with the other ranks' zeros.
    parts = [(seed >> s) & 0xFFFF if _LAUNCH.rank == 0 else 0 for s in (48, 32, 16, 0)]
    total = mx.distributed.all_sum(mx.array(parts, dtype=mx.int32), group=_LAUNCH.group)
    with watch("agreeing on a seed"):
        a, b, c, d = total.tolist()
    return (a << 48) | (b << 32) | (c << 16) | d


def quiet_other_ranks() -> None:
    """Only rank 0 prints results; the others keep stderr for their errors."""
    if _LAUNCH is not None and _LAUNCH.rank != 0:
        sys.stdout = open(os.devnull, "w")


def rank_prefix() -> str:
    """ "rank N: " on ranks other than 0 (their error lines), else ""."""
    return f"rank {_LAUNCH.rank}: " if _LAUNCH is not None and _LAUNCH.rank else ""


def is_main_rank() -> bool:
    """Rank 0 of a launch, or a single process: the one that prints."""
    return _LAUNCH is None or _LAUNCH.rank == 0


def is_collective_error(e: BaseException) -> bool:
    """The backend's own error (e.g. "[ring] connection to a peer was lost")."""
    return _LAUNCH is not None and str(e).startswith(f"[{_LAUNCH.backend}]")


def lost_peer_message(e: BaseException) -> str:
    return (
        f"lost contact with the other ranks ({' '.join(str(e).split())}); "
        "one of them stopped: see its message"
    )


# --- bounded waits ---------------------------------------------------------------

# The watcher: reads "ARM seconds message" / "OFF" lines; past a deadline it
# prints the message and kills its parent; it exits when the parent's pipe closes.
_WATCHER = r"""
import os, select, signal, sys, time
parent, deadline, message = int(sys.argv[1]), None, ""
buf = b""
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, _, _ = select.select([0], [], [], wait)
    if not ready:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os.kill(parent, signal.SIGKILL)
        sys.exit(0)
    data = os.read(0, 4096)
    if not data:
        sys.exit(0)
    buf += data
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        cmd, _, rest = line.decode().partition(" ")
        if cmd == "ARM":
            seconds, _, message = rest.partition(" ")
            deadline = time.monotonic() + float(seconds)
        else:
            deadline = None
"""


class Watchdog:
    """Stops this process with one line when armed for `timeout` seconds without
    a `kick`: a collective waiting on a peer that vanished without closing its
    socket, or `mx.distributed.init` waiting on one that never came, blocks
    forever (init even holds the GIL, so a thread could not help: a child
    process does the waiting)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.rank: Optional[int] = None
        self.what = ""
        self.armed = False
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write((line + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def arm(self, what: str) -> None:
        """Expect progress on `what` within the timeout (each `kick` restarts it)."""
        self.what, self.armed = what, True
        rank = f"rank {self.rank}: " if self.rank is not None else ""
        message = (
            f"flashnorm-mlx: error: {rank}no progress for {self.timeout:g} s "
            f"while {what}; stopping ({TIMEOUT_ENV} sets the limit)"
        )
        self._send(f"ARM {self.timeout} {' '.join(message.split())}")

    def kick(self) -> None:
        self.arm(self.what)

    def pause(self) -> None:
        """Local work ahead (loading, waiting for input): no deadline."""
        self.armed = False
        self._send("OFF")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.send_signal(signal.SIGKILL)
