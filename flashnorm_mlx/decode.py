"""A compiled decode step: Python builds a step's graph once per shape, not per op.

At batch-1 decode of models up to ~1B parameters the host, not the GPU, sets
the pace: Python building one step's lazy graph costs more than MLX's encoding
and the GPU together (docs/design.md section 4a). So a single-token step over
mlx-lm's `KVCache` runs as one `mx.compile`d function, embedding to logits,
every block included:

- the cache is the layer's own `KVCache` buffer (B, H, C, h), used at its full
  capacity C: the step writes the new key and value at the offset, given as an
  array (`mx.slice_update`), and attends over positions 0..offset only
  (`StepCache`). Our blocks call `kernels.decode_attention`, which takes that
  length from the offset array; mlx-lm's attention gets a mask instead (on
  CUDA a masked attention leaves MLX's fast single-query kernel). Capacity
  grows in buckets of `BUCKET` positions, so a step retraces once per bucket,
  not per token;
- the model's own `__call__` is what gets traced, for ours and mlx-lm's classes
  alike (`stock_compiled` in bench is mlx-lm's class given this same step);
- the first step of each new shape runs eagerly, uncompiled: the kernels'
  first-use checks evaluate (docs/design.md section 3c), which a trace must
  never do. Tracing happens from the second step on, under `kernels.tracing()`.

Steps the compiled function cannot serve run the model as is: prefill (L > 1),
caches other than a plain `KVCache` (rotating, quantized, batched), an empty
cache. Our blocks then compile their cache-free parts (models/blocks.py).
"""

import contextlib
import functools
import weakref
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import kernels

BUCKET = 256  # KV capacity grows in multiples of this (mlx-lm's KVCache.step)


class StepCache:
    """One layer's KVCache as the traced step sees it: the whole fixed-capacity
    buffers and the write position as an array. What lies past it is hidden by
    `kernels.decode_attention` (our blocks) or by the mask (mlx-lm's)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # One new token at position offset sees positions 0..offset.
        return (mx.arange(self.keys.shape[2]) <= self.offset).reshape(1, 1, 1, -1)


def _bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


def _fit(cache: KVCache, need: int) -> None:
    """Give `cache` a capacity of whole buckets holding at least `need` positions."""
    cap = cache.keys.shape[2]
    if cap >= need and cap % BUCKET == 0:
        return
    extra = _bucket(max(need, cap)) - cap

    def grow(a):
        pad = mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)
        return mx.concatenate([a, pad], axis=2)

    cache.keys, cache.values = grow(cache.keys), grow(cache.values)


class CompiledOnce:
    """`fn` compiled, its first call of each input signature run eagerly: a
    kernel's first-use check evaluates, which a trace must never do, so every
    variant a shape uses is checked before that shape is traced."""

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
        first = cache[0]
        return all(
            type(c) is KVCache and c.keys is not None and c.offset == first.offset
            for c in cache
        )

    def __call__(self, inputs: mx.array, cache: Sequence[KVCache]) -> mx.array:
        offset = cache[0].offset
        for c in cache:
            _fit(c, offset + 1)
        kv = [a for c in cache for a in (c.keys, c.values)]
        out = self.run(inputs, mx.array([offset], dtype=mx.int32), *kv)
        for i, c in enumerate(cache):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset += 1
        return out[0]


@functools.cache
def compiled_class(cls: type) -> type:
    """`cls` whose single-token steps over KVCaches run compiled (`DecodeStep`);
    every other call, and everything else about the class, is `cls`'s."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        for layer in getattr(self, "layers", ()):
            if hasattr(layer, "compile_parts"):  # our blocks (models/blocks.py)
                layer.compile_parts = True

    def __call__(self, inputs, cache=None, **kwargs):
        if (
            kwargs
            or self.__dict__.get("_eager")
            or not DecodeStep.applies(inputs, cache)
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
        {
            "__init__": __init__,
            "__call__": __call__,
            "__module__": cls.__module__,
            "compiled_decode": True,
        },
    )


def default_on() -> bool:
    """Whether FlashNorm's decode step compiles when not told: where a GPU backend
    (Metal, CUDA) runs the model, since there the host sets the pace. On MLX's
    CPU backend the matmuls do (SmolLM2-135M: ~130 ms to evaluate a step against
    ~4 ms to build it), and a first run would spend seconds compiling CPU
    kernels (18 s against 6 s for an 8-token generate), so it stays off there
    unless asked for."""
    return kernels.gpu_backend() is not None


def is_compiled(model) -> bool:
    return getattr(type(model), "compiled_decode", False)


@contextlib.contextmanager
def eager(model):
    """Within: `model` runs uncompiled, its blocks too (launch counting exports
    the graph a step builds, and evaluates, which a trace cannot)."""
    if not is_compiled(model):
        yield
        return
    blocks = [l for l in model.layers if hasattr(l, "compile_parts")]
    model.__dict__["_eager"] = True
    for layer in blocks:
        layer.compile_parts = False
    try:
        yield
    finally:
        model.__dict__["_eager"] = False
        for layer in blocks:
            layer.compile_parts = True
