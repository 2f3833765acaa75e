"""Ctrl-C in a long command (perplexity, convert): one line, exit 130, at once.

MLX evaluates lazily and Python raises KeyboardInterrupt only between
bytecodes, so a Ctrl-C waits for the mx.eval in progress: one forward pass of
a 30-layer model over 1024 tokens is minutes on a 2-core CPU. While `guard` is
active, SIGINT instead wakes a watcher thread (`signal.set_wakeup_fd`; mx.eval
releases the GIL, so the thread runs while the main thread computes). The
watcher waits for a commit in progress (`committing`: convert's writing and
final rename, seconds), runs the registered cleanups (`cleanup`: convert's
temporary folder), prints one line saying what was interrupted and ends the
process with status 130. Nothing else runs after that line: no half-written
file, no traceback, no second line.
"""

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, List

_commit = threading.RLock()  # held by the main thread while it writes for good
_pending = threading.Event()  # a Ctrl-C the watcher is acting on
_cleanups: List[Callable[[], None]] = []
_stoppers: List[Callable[[], None]] = []  # live progress bars to take down


@contextlib.contextmanager
def guard(describe: Callable[[], str], prefix: str) -> Iterator[None]:
    """Ctrl-C inside: `prefix` interrupted while `describe()`, exit 130.

    Only in the main thread of a process (signal handlers live there); elsewhere
    (a test calling a command from a thread) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.signal(signal.SIGINT, lambda *_: None)  # the watcher acts
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(
        target=_watch, args=(read_fd, describe, prefix), daemon=True
    )
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        watcher.join()
        os.close(read_fd)


def _watch(read_fd: int, describe: Callable[[], str], prefix: str) -> None:
    while True:
        data = os.read(read_fd, 64)
        if not data:
            return  # the guard ended
        if signal.SIGINT in data:
            break
    _pending.set()
    _commit.acquire()  # a commit in progress completes first; never released
    for stop in list(_stoppers):
        _quietly(stop)
    for fn in reversed(_cleanups):
        _quietly(fn)
    try:
        what = describe()
    except Exception:  # noqa: BLE001 (the line must come out)
        what = ""
    line = f"{prefix} interrupted (Ctrl-C){f' while {what}' if what else ''}"
    sys.stderr.write(f"{line}; nothing was written\n")
    sys.stderr.flush()
    os._exit(130)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 (a failed cleanup must not block the exit)
        pass


@contextlib.contextmanager
def cleanup(fn: Callable[[], None]) -> Iterator[None]:
    """Run `fn` if Ctrl-C ends the process inside this block."""
    _cleanups.append(fn)
    try:
        yield
    finally:
        _cleanups.remove(fn)


@contextlib.contextmanager
def live(stop: Callable[[], None]) -> Iterator[None]:
    """A live display (a rich Progress's `stop`) to take down before the line."""
    _stoppers.append(stop)
    try:
        yield
    finally:
        _stoppers.remove(stop)


@contextlib.contextmanager
def committing() -> Iterator[None]:
    """A Ctrl-C inside waits until the block ends (e.g. a rename of a finished
    folder into place). Call `check` before the point of no return."""
    with _commit:
        yield


def check() -> None:
    """KeyboardInterrupt if a Ctrl-C is pending (inside `committing`: the
    caller's cleanup runs, then the watcher ends the process)."""
    if _pending.is_set():
        raise KeyboardInterrupt


def hand_over() -> None:
    """The watcher is ending the process (a Ctrl-C it acts on): wait for it,
    so its one line is the only one. Returns at once otherwise."""
    while _pending.is_set():
        time.sleep(0.1)
