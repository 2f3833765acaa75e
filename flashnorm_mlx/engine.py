"""Engines: how a model's decode steps run, the same for every mode. `eager` is
the model's own `__call__`, as mlx-lm runs it; `compiled` runs a single-token
step over a `KVCache` as one `mx.compile`d function, so Python runs once per
shape, not per op, where the host sets the pace (docs/design.md section 4a).
Compiling is no part of FlashNorm: every class, ours and mlx-lm's, gets the
same step (section 3e says how: the cache's buffer, its buckets, the eager
first step, and what runs uncompiled).
"""

import contextlib
import functools
import sys
import weakref
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import kernels
from .mlx_lm_compat import kv_buffers, set_kv_buffers
from .models.blocks import Block, attend_cached

ENGINES = ("eager", "compiled")
BUCKET = 256  # KV capacity grows in multiples of this (mlx-lm's KVCache.step)


def default() -> str:
    """The engine when none is asked for: compiled where a GPU backend (Metal,
    CUDA) runs the model, since there the host sets the pace. On MLX's CPU
    backend the matmuls do (SmolLM2-135M: ~130 ms to evaluate a step against
    ~4 ms to build it), and a first run would spend seconds compiling CPU
    kernels (18 s against 6 s for an 8-token generate): eager there."""
    return "compiled" if kernels.gpu_backend() is not None else "eager"


def resolve(engine: Optional[str]) -> str:
    """`engine`, or the default where None; ValueError on an unknown name."""
    if engine is None:
        return default()
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    return engine


def run_on(model: nn.Module, engine: Optional[str]) -> nn.Module:
    """`model`, its decode steps run by `engine` (None: `default()`). Applied
    once, to the finished model (after sharding and fusing)."""
    if resolve(engine) == "eager" or is_compiled(model):
        return model
    cls = type(model)
    model.__class__ = compiled_class(cls)
    for layer in getattr(model, "layers", ()):
        if isinstance(layer, Block) and layer.PARTS:
            layer.__class__ = _parts_class(type(layer))
    # Every module the model's classes come from: mlx-lm's SmolLM3 runs
    # attention from mlx_lm.models.llama, not from its own module.
    for name in {cls.__module__} | {type(m).__module__ for m in model.modules()}:
        _attention_reads_step_cache(sys.modules[name])
    return model


def engine_of(model: nn.Module) -> str:
    return "compiled" if is_compiled(model) else "eager"


def is_compiled(model) -> bool:
    return getattr(type(model), "compiled_decode", False)


def _attention_reads_step_cache(module) -> None:
    """Hand an mlx-lm model module `kernels.scaled_dot_product_attention`: the
    same function as its own for every cache but `StepCache`, which
    only this engine makes."""
    if getattr(module, "scaled_dot_product_attention", None) not in (
        None,
        kernels.scaled_dot_product_attention,
    ):
        module.scaled_dot_product_attention = kernels.scaled_dot_product_attention


# --- the whole step ------------------------------------------------------------


class StepCache:
    """One layer's KVCache as the traced step sees it: the whole fixed-capacity
    buffers and the write position as an array. What lies past it is never read:
    `kernels.scaled_dot_product_attention` sends a `fixed_capacity` cache to
    `decode_attention`.
    """

    fixed_capacity = True

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return None  # decode_attention reads the length from the offset


def _bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


def _fit(cache: KVCache, need: int) -> None:
    """Give `cache` a capacity of whole buckets holding at least `need` positions."""
    keys, values, offset = kv_buffers(cache)
    cap = keys.shape[2]
    if cap >= need and cap % BUCKET == 0:
        return
    extra = _bucket(max(need, cap)) - cap

    def grow(a):
        pad = mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)
        return mx.concatenate([a, pad], axis=2)

    set_kv_buffers(cache, grow(keys), grow(values), offset)


class CompiledOnce:
    """`fn` compiled, its first call of each input signature run eagerly: a
    kernel's first-use check evaluates, which a trace must never do, so every
    form a shape uses is checked before that shape is traced."""

    def __init__(self, fn):
        self.fn, self.compiled = fn, mx.compile(fn)
        self.seen = set()

    def __call__(self, *args):
        signature = tuple((a.shape, a.dtype) for a in args)
        if signature in self.seen:
            with kernels.tracing():  # traces only on a new shape; never evaluates
                return self.compiled(*args)
        out = self.fn(*args)
        self.seen.add(signature)
        return out


class DecodeStep:
    """The compiled single-token step of one model instance (see the module doc)."""

    def __init__(self, forward):
        self.forward = forward  # the model's uncompiled __call__
        self.run = CompiledOnce(self._step)

    def _step(self, tokens, offset, *kv):
        caches = [StepCache(kv[i], kv[i + 1], offset) for i in range(0, len(kv), 2)]
        logits = self.forward(tokens, cache=caches)
        return (logits, *[a for c in caches for a in (c.keys, c.values)])

    @staticmethod
    def applies(inputs, cache: Optional[Sequence]) -> bool:
        """A single-token step over plain, non-empty KVCaches at one offset."""
        if not cache or inputs.ndim != 2 or inputs.shape[1] != 1:
            return False
        first = getattr(cache[0], "offset", None)  # a recurrent state has none
        return all(
            type(c) is KVCache and kv_buffers(c)[0] is not None and c.offset == first
            for c in cache
        )

    def __call__(self, inputs: mx.array, cache: Sequence[KVCache]) -> mx.array:
        offset = cache[0].offset
        for c in cache:
            _fit(c, offset + 1)
        kv = [a for c in cache for a in kv_buffers(c)[:2]]
        out = self.run(inputs, mx.array([offset], dtype=mx.int32), *kv)
        for i, c in enumerate(cache):
            set_kv_buffers(c, out[1 + 2 * i], out[2 + 2 * i], offset + 1)
        return out[0]


@functools.cache
def compiled_class(cls: type) -> type:
    """`cls` whose single-token steps over KVCaches run compiled (`DecodeStep`);
    every other call, and everything else about the class, is `cls`'s."""

    def __call__(self, inputs, cache=None, **kwargs):
        if (
            kwargs
            or self.__dict__.get("_eager")
            or not DecodeStep.applies(inputs, cache)
            or _windowed_by_mask(self)
        ):
            return cls.__call__(self, inputs, cache=cache, **kwargs)
        step = self.__dict__.get("_decode_step")
        if step is None:
            # A weak reference: the model owns its step, and a model dropped
            # (bench, verify build several) frees its weights at once, not at
            # the next garbage collection.
            model = weakref.ref(self)
            forward = lambda *a, **k: cls.__call__(model(), *a, **k)  # noqa: E731
            step = self.__dict__["_decode_step"] = DecodeStep(forward)
        return step(inputs, cache)

    return type(
        cls.__name__,
        (cls,),
        {"__call__": __call__, "__module__": cls.__module__, "compiled_decode": True},
    )


def _windowed_by_mask(model) -> bool:
    """Sliding-window layers on plain KVCaches (mlx-lm's Mistral 3 wrapper has
    no make_cache): their window is in the mask, which `StepCache` never makes."""
    return any(getattr(l, "use_sliding", False) for l in getattr(model, "layers", ()))


# --- FlashNorm blocks over the caches the whole step cannot serve ----------------


@functools.cache
def _parts_class(cls: type) -> type:
    """A FlashNorm `Block` class whose single-token steps over a cache the whole
    step cannot serve (rotating, quantized, batched) compile the block's
    cache-free parts: the heads before the cache, the out projection and
    everything after attention. The cache update and attention stay outside:
    only they see the cache."""

    def __call__(self, x, ms, xs, mask, cache, out_gain, final: bool):
        if (
            cache is None
            or x.shape[1] != 1
            or isinstance(cache, StepCache)  # inside the whole step already
            or self.__dict__.get("_eager")
        ):
            return cls.__call__(self, x, ms, xs, mask, cache, out_gain, final)
        parts = self.__dict__.get("_parts")
        if parts is None:
            parts = self.__dict__["_parts"] = {
                "heads": CompiledOnce(self[self.ATTENTION].heads)
            }
        offset = cache.offset
        if isinstance(offset, int):  # an int would be a new constant every step
            offset = mx.array([offset], dtype=mx.int32)
        q, k, v = parts["heads"](xs, ms, offset)
        o = getattr(self[self.ATTENTION], "attend", attend_cached)(q, k, v, mask, cache)
        close = parts.get(final)
        if close is None:
            close = parts[final] = CompiledOnce(_closer(self, final))
        return close(x, o) if out_gain is None else close(x, o, out_gain)

    return type(
        cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__}
    )


def _closer(block: Block, final: bool):
    """The out projection and `close`, as one function of (x, o[, gain]):
    traced apart with and without a gain (its own input signature)."""
    block = weakref.ref(block)  # the block owns its parts: no reference cycle

    def run(x, o, gain=None):
        b = block()
        return b.close(x, b[b.ATTENTION].project_out(o), gain, final)

    return run


@contextlib.contextmanager
def eager(model):
    """Within: `model` runs uncompiled, its blocks too (launch counting exports
    the graph a step builds, and evaluates, which a trace cannot)."""
    if not is_compiled(model):
        yield
        return
    modules = [model] + [l for l in model.layers if isinstance(l, Block)]
    for m in modules:
        m.__dict__["_eager"] = True
    try:
        yield
    finally:
        for m in modules:
            m.__dict__["_eager"] = False
