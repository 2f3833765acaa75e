"""What one decode step launches: the primitives of a cached one-token forward
pass, read from its graph without running it. At batch-1 decode each launch
costs a GPU a fixed ~10 µs, so their count is one part of decode speed
(docs/design.md sections 4a and 4b); `gpu_like()` counts as a GPU would on a
build without one.
"""

import contextlib
import io
import re
from collections import Counter
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from . import engine, kernels

# Primitives that only describe memory another array owns: no kernel launch.
VIEWS = frozenset(
    {
        "AsStrided",
        "Broadcast",
        "ExpandDims",
        "Reshape",
        "Slice",
        "Split",
        "Squeeze",
        "StopGradient",
        "Transpose",
        "Unflatten",
        "Flatten",
    }
)
# The single node a kernel becomes under `gpu_like()`.
STUB_NODE = "Depends"

_LABEL = re.compile(r'\[label\s*=\s*"([A-Za-z0-9_]+)')

# Ops that run as one kernel on Metal and CUDA and decompose on the CPU: mx.fast's
# and mx.dequantize (a quantized embedding's row lookup).
FAST_OPS = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")
CORE_OPS = ("dequantize",)


def _one_node(fn):
    """`fn` with its outputs replaced by one graph node that depends on its inputs.

    `fn` still runs (lazily) to give the output shapes; its own nodes are left out
    of the step's graph because nothing downstream reads them.
    """

    def stub(*args, **kwargs):
        outs = fn(*args, **kwargs)
        single = isinstance(outs, mx.array)
        outs = [outs] if single else [o for o in outs]
        leaves = [mx.zeros(o.shape, o.dtype) for o in outs]
        mx.eval(leaves)  # evaluated arrays are graph leaves: no node of their own
        deps = [a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)]
        res = mx.depends(leaves, deps)
        return res[0] if single else tuple(res)

    return stub


@contextlib.contextmanager
def gpu_like():
    """Every FlashNorm kernel (picked as on a GPU), mx.fast op and mx.dequantize
    as one node each, as Metal and CUDA launch them."""
    saved = [(mx.fast, name, getattr(mx.fast, name)) for name in FAST_OPS]
    saved += [(mx, name, getattr(mx, name)) for name in CORE_OPS]
    with kernels.picking(lambda op, kernel, ops: _one_node(ops)):
        for module, name, fn in saved:
            setattr(module, name, _one_node(fn))
        try:
            yield
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)


def step_primitives(model: nn.Module, prompt_tokens: int = 4) -> Counter:
    """Primitive name -> count in the graph of one cached single-token step."""
    cache = make_prompt_cache(model)
    prompt = mx.arange(1, prompt_tokens + 1)[None]
    # The model's own launch plan: a compiled step fuses what it can (engine.py),
    # but launches the same kernels.
    with engine.eager(model):
        mx.eval(model(prompt, cache=cache), [c.state for c in cache])
        logits = model(mx.array([[prompt_tokens + 1]]), cache=cache)
    dot = io.StringIO()
    mx.export_to_dot(dot, logits)
    return Counter(_LABEL.findall(dot.getvalue()))


def count_dispatches(model: nn.Module, prompt_tokens: int = 4) -> Dict:
    """{"dispatches", "views", "by_primitive"} for one decode step of `model`."""
    prims = step_primitives(model, prompt_tokens)
    views = sum(n for p, n in prims.items() if p in VIEWS)
    return {
        "dispatches": sum(prims.values()) - views,
        "views": views,
        "by_primitive": dict(sorted(prims.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def has_gpu_kernels() -> bool:
    """True where this build's counts are the real ones (a Metal or CUDA device)."""
    return kernels.backend() is not None
