"""Ctrl-C: one line, exit 130, whenever it comes.

Python raises KeyboardInterrupt only between bytecodes, so a Ctrl-C would wait
out a long mx.eval (minutes on a CPU): while `guard` is active a watcher thread
takes SIGINT instead (docs/design.md section 5d says how).
"""

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, List, Optional

_commit = threading.RLock()  # held by the main thread while it writes for good
_pending = threading.Event()  # a Ctrl-C the watcher is acting on
_cleanups: List[Callable[[], None]] = []
_stoppers: List[Callable[[], None]] = []  # live progress bars to take down
_prefix = ["flashnorm-mlx"]  # what `at_start`'s line names
# One Ctrl-C may reach both the watcher and KeyboardInterrupt (see `guard`):
# the first to print its line wins.
_said = [False]
_said_lock = threading.Lock()


def at_start(prefix: str = "flashnorm-mlx") -> Callable[[], None]:
    """Install the SIGINT handler described above (main thread only; elsewhere
    nothing changes); its line reads `<prefix>: interrupted (Ctrl-C)`. Returns
    a function that puts back the handler it replaced."""
    _prefix[0] = prefix
    reset()
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # as Python leaves it
        return lambda: None  # (nohup, a shell's background job)
    previous = signal.signal(signal.SIGINT, _on_sigint)
    if previous is _on_sigint:  # already ours (e.g. `python -m` then main())
        return lambda: None
    return lambda: signal.signal(signal.SIGINT, previous)


def _on_sigint(signum, frame) -> None:
    if not _importing(frame):
        raise KeyboardInterrupt  # as Python's default handler: the command stops
    # A half-imported module can only fail later, and nothing is being written.
    exit_now()


def exit_now(prefix: Optional[str] = None) -> None:
    """Ctrl-C's line (`interrupted(prefix)`) and the end of the process, status
    130, at once: no cleanup of Python's, which would wait for (or, under a
    thread still running MLX, abort on) work that no longer matters."""
    try:
        sys.stdout.flush()  # what the command printed before (chat's replies)
    except Exception:  # noqa: BLE001 (a write the signal cut: the line still comes)
        pass
    say(interrupted(prefix), raw=True)
    os._exit(130)


def interrupted(prefix: Optional[str] = None) -> str:
    """`<prefix>: interrupted (Ctrl-C)` (default prefix: at_start's), after a
    newline on a terminal, where ^C was echoed."""
    lead = "\n" if os.isatty(2) else ""
    return f"{lead}{prefix or _prefix[0]}: interrupted (Ctrl-C)"


def reset() -> None:
    """A new command in this process (a test's): its Ctrl-C gets its own line."""
    _said[0] = False


def say(line: str, raw: bool = False) -> bool:
    """Print Ctrl-C's one line on stderr, unless it was printed already; raw:
    straight to the file descriptor (a signal handler may have cut a write to
    sys.stderr). Whether it printed."""
    with _said_lock:
        if _said[0]:
            return False
        _said[0] = True
    if raw:
        os.write(2, f"{line}\n".encode())
    else:
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()
    return True


def _importing(frame) -> bool:
    """Whether the main thread is executing an import (any module's top level,
    or the import machinery itself) in `frame` or a caller."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_find_and_load" and code.co_filename.startswith(
            "<frozen importlib"
        ):
            return True
        frame = frame.f_back
    return False


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
    # The wakeup fd is set before the handler and put back after it: a Ctrl-C
    # in between raises KeyboardInterrupt or reaches the watcher, never neither.
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: None)  # the watcher acts
    except BaseException:  # KeyboardInterrupt: the watcher never started
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)
        os.close(read_fd)
        raise
    watcher = threading.Thread(
        target=_watch, args=(read_fd, describe, prefix), daemon=True
    )
    watcher.start()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.set_wakeup_fd(previous_fd)
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
    say(f"{line}; nothing was written")
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
