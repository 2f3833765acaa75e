"""Tensor parallelism on mx.distributed, the mlx-lm way: a model's `shard(group)`.

Started by `mlx.launch -n N ...`, each command joins the launch's group, builds
its model with `shard_model` applied before the weights are evaluated, and
prints on rank 0 only. q|k|v and gate|up are split by rows segment by segment
(`all_to_sharded`), o/down by columns and summed over the group
(`sharded_to_all`), mlx.nn's `shard_linear` doing both. FlashNorm needs nothing
more: every rank holds the whole residual row, so the per-token mean square is
exact locally, and the folded gains live on input columns, which a row split
keeps whole.

Failures end every rank with one line: a peer that exits closes its socket
(the backend raises, `lost_peer_message` words it); a peer that never connects
or goes silent is caught by `Watchdog`, a tiny child process that stops this
one after FLASHNORM_DIST_TIMEOUT seconds (default 120) without progress.
"""

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import shard_inplace, shard_linear

from .errors import LoadError

TIMEOUT_ENV = "FLASHNORM_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0


class ShardError(LoadError):
    """A model that cannot be split over the group (one line for the user)."""


# --- sharding --------------------------------------------------------------------


def check_heads(n_heads: int, n_kv_heads: int, size: int, where: str = "") -> None:
    """Whole heads per rank: q and k/v head counts must both divide by `size`."""
    if n_heads % size or n_kv_heads % size:
        at = f" ({where})" if where else ""
        raise ShardError(
            f"cannot shard over {size} ranks: {n_heads} query and {n_kv_heads} "
            f"key/value heads{at}; both must be divisible by {size}"
        )


def _check_rows(rows: int, segments: Sequence[int], size: int, name: str):
    for a, b in zip([0, *segments], [*segments, rows]):
        if (b - a) % size:
            raise ShardError(
                f"cannot shard {name} over {size} ranks: {b - a} output rows "
                f"(rows {a}-{b} of {rows}) do not divide by {size}"
            )


def all_to_sharded(
    linear: nn.Module, group, segments: Sequence[int] = (), name: str = "a layer"
) -> nn.Module:
    """mlx's all-to-sharded linear: each rank keeps 1/N of every row segment
    (q|k|v: segments at the end of q and of k, unequal under GQA)."""
    _check_rows(linear.weight.shape[0], segments, group.size(), name)
    return shard_linear(
        linear, "all-to-sharded", segments=list(segments) or 1, group=group
    )


def sharded_to_all(linear: nn.Module, group, name: str = "a layer") -> nn.Module:
    """mlx's sharded-to-all linear: 1/N of the input columns, outputs all-summed.
    A quantized layer splits its columns by whole quantization groups."""
    size = group.size()
    cols = linear.weight.shape[1]
    unit = 1
    if isinstance(linear, nn.QuantizedLinear):
        cols = cols * 32 // linear.bits
        unit = linear.group_size
    if cols % (size * unit):
        what = f" in whole groups of {unit}" if unit > 1 else ""
        raise ShardError(
            f"cannot shard {name} over {size} ranks: its {cols} input columns "
            f"do not split{what} (quantize with a smaller --q-group-size, or not at all)"
        )
    return shard_linear(linear, "sharded-to-all", group=group)


def shard_vector(module: nn.Module, key: str, segments: Sequence[int], group):
    """Split the parameter `module.<key>` (a fused bias) as its rows were split."""
    _check_rows(module[key].shape[0], segments, group.size(), key)
    shard_inplace(
        module,
        lambda path, w: (0, list(segments) or 1) if path == key else None,
        group=group,
    )


def shard_openelm_layers(layers: List[nn.Module], group) -> None:
    """OpenELM's blocks, ours and mlx-lm's alike (same names, q|k|v rows, gate|up
    rows): the per-layer head counts are divided, every layer's own."""
    size = group.size()
    for i, layer in enumerate(layers):
        attn, ffn = layer.attn, layer.ffn
        check_heads(attn.n_heads, attn.n_kv_heads, size, f"layer {i}")
        h = attn.head_dim
        qkv = [attn.n_heads * h, (attn.n_heads + attn.n_kv_heads) * h]
        attn.qkv_proj = all_to_sharded(attn.qkv_proj, group, qkv, f"layer {i} qkv")
        attn.out_proj = sharded_to_all(attn.out_proj, group, f"layer {i} out_proj")
        attn.n_heads //= size
        attn.n_kv_heads //= size
        half = ffn.proj_1.weight.shape[0] // 2  # gate | up
        ffn.proj_1 = all_to_sharded(ffn.proj_1, group, [half], f"layer {i} proj_1")
        ffn.proj_2 = sharded_to_all(ffn.proj_2, group, f"layer {i} proj_2")


def _attention_modules(model: nn.Module):
    for name, m in model.named_modules():
        if hasattr(m, "n_heads") and hasattr(m, "n_kv_heads"):
            yield name, m


def shard_model(model: nn.Module, group, name: str = "the model") -> None:
    """Split `model` over `group` in place: its own `shard` (ours; mlx-lm's Llama,
    Mistral, Qwen2, Qwen3), or `shard_openelm_layers` for mlx-lm's OpenELM, which
    has none. ShardError where it cannot be split."""
    size = group.size()
    for where, attn in _attention_modules(model):  # mlx-lm's shard does not check
        check_heads(attn.n_heads, attn.n_kv_heads, size, where)
    try:
        if hasattr(model, "shard"):
            model.shard(group)
        elif getattr(model, "model_type", None) == "openelm":
            shard_openelm_layers(model.layers, group)
        else:
            raise ShardError(
                f"{name}: {type(model).__module__}.{type(model).__name__} has no "
                "tensor-parallel shard; run it in one process"
            )
    except ValueError as e:  # mlx's own checks (a split that does not divide)
        raise ShardError(f"cannot shard {name} over {size} ranks: {e}") from None


# --- the launch ------------------------------------------------------------------


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
        raise LoadError(f"cannot start the {backend} group: {e}") from None
    watchdog.pause()
    if group.size() < 2:
        watchdog.close()
        return None
    watchdog.rank = group.rank()
    _LAUNCH = Launch(group, backend, watchdog)
    return _LAUNCH


def barrier(what: str) -> None:
    """Wait until every rank gets here (e.g. all loaded), bounded by the watchdog.

    Waits for this rank's queued work first: a generation step still running on
    mlx-lm's generation stream would otherwise meet this all_sum in a different
    order on each rank, and collectives pair up by order, not by name."""
    if _LAUNCH is None:
        return
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    with watch(f"waiting for the other ranks ({what})"):
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=_LAUNCH.group))


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
    mine = mx.array(seed if _LAUNCH.rank == 0 else 0, dtype=mx.int32)
    total = mx.distributed.all_sum(mine, group=_LAUNCH.group)
    with watch("agreeing on a seed"):
        return int(total.item())


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
