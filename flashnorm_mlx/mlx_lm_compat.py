"""Every use of mlx-lm's private names and internal fields, in one place.

mlx-lm does not promise them: each function here is the only caller of one,
and tests/test_mlx_lm_compat.py checks each still exists and behaves, so an
upgrade that changes one fails there with the version named (docs/design.md
section 5).
"""

from typing import Optional, Tuple


def version() -> str:
    import mlx_lm

    return getattr(mlx_lm, "__version__", "unknown")


class MlxLmChanged(RuntimeError):
    """mlx-lm no longer has a private name or field this package relies on."""


def _changed(what: str, e: Exception) -> MlxLmChanged:
    return MlxLmChanged(
        f"mlx-lm {version()} has changed {what} ({type(e).__name__}: {e}); "
        "flashnorm-mlx needs an mlx-lm it was tested with (see pyproject.toml)"
    )


def stock_classes(config: dict):
    """(Model, ModelArgs): mlx-lm's own classes for a config's model_type."""
    try:
        from mlx_lm.utils import _get_classes
    except ImportError as e:
        raise _changed("mlx_lm.utils._get_classes", e) from None
    model_cls, args_cls = _get_classes(config)
    shallow = config.get("num_hidden_layers", 0) < config.get(
        "sliding_window_pattern", 6
    )
    if config.get("model_type") == "gemma3_text" and shallow:  # mlx-lm's own else
        model_cls = _gemma3_any_depth(model_cls)
    return model_cls, args_cls


def _gemma3_any_depth(model_cls):
    """mlx-lm's gemma3_text reads its global mask from cache[pattern - 1],
    an IndexError where the model has fewer layers (all sliding, as llama.cpp
    runs them): the cache list padded with None, which no layer reads."""

    class Model(model_cls):
        def __call__(self, inputs, cache=None, input_embeddings=None):
            n, p = len(self.model.layers), self.args.sliding_window_pattern
            if n < p:
                cache = list(cache or [None] * n) + [None] * (p - n)
            return super().__call__(inputs, cache, input_embeddings)

    return Model


def hub_download(repo: str, allow_patterns):
    """The local folder of a hub repo, fetched by mlx-lm as `mlx_lm.load` does."""
    try:
        from mlx_lm.utils import _download
    except ImportError as e:
        raise _changed("mlx_lm.utils._download", e) from None
    return _download(repo, allow_patterns=allow_patterns)


def rope_freqs(rope) -> Optional[Tuple[object, float, int]]:
    """(freqs, scale, dims) of one of mlx-lm's scaled RoPE modules (Llama 3, YaRN,
    SuScaled, Proportional): its `_freqs`, the period of each rotary pair; the
    factor it multiplies its input's rotated dims by before rotating them
    (SuScaled's `_scale`, YaRN's `mscale`, 1.0 for the others); and how many
    dims it rotates. None for any other module (nn.RoPE, or one whose angles
    could be anything, such as dynamic NTK's, which depend on the offset)."""
    from mlx_lm.models import rope_utils

    known = [getattr(rope_utils, n, None) for n in _SCALED_ROPES]
    if type(rope) not in known or getattr(rope, "_freqs", None) is None:
        return None
    scale = float(getattr(rope, "_scale", 1.0)) * float(getattr(rope, "mscale", 1.0))
    dims = getattr(rope, "dims", getattr(rope, "dim", None))  # SuScaled's: `dim`
    return rope._freqs, scale, dims


# mlx-lm's scaled RoPE modules whose __call__ is mx.fast.rope (non-traditional
# where `traditional` is False) with `freqs=_freqs` on x[..., :dims] * scale.
_SCALED_ROPES = ("Llama3RoPE", "YarnRoPE", "SuScaledRoPE", "ProportionalRoPE")


def inner_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper` (itself if
    it is not wrapped)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def infer_tool_parser(tokenizer) -> Optional[str]:
    """The mlx_lm.tool_parsers module a tokenizer's chat template (or
    vocabulary) names, as mlx-lm's load infers it; None: none."""
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser
    except ImportError as e:
        raise _changed("mlx_lm.tokenizer_utils._infer_tool_parser", e) from None
    return _infer_tool_parser(tokenizer)


def set_tool_parser(tokenizer, name: str) -> None:
    """Give mlx-lm's TokenizerWrapper the tool parser `name`
    (mlx_lm.tool_parsers.<name>), its fields set as its __init__ sets them."""
    import importlib

    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    inner = inner_tokenizer(tokenizer)
    start, end = module.tool_call_start, module.tool_call_end
    fields = {
        "_tool_parser": module.parse_tool_call,
        "_tool_call_start": start,
        "_tool_call_end": end,
        "_tool_call_start_tokens": tuple(inner.encode(start, add_special_tokens=False)),
        "_tool_call_end_tokens": tuple(inner.encode(end, add_special_tokens=False)),
    }
    for field, value in fields.items():
        if not hasattr(tokenizer, field):
            raise _changed(f"TokenizerWrapper.{field}", AttributeError(field))
        setattr(tokenizer, field, value)
    if tokenizer.tool_parser is not module.parse_tool_call:
        raise _changed("TokenizerWrapper.tool_parser", AttributeError("tool_parser"))


def kv_buffers(cache):
    """(keys, values, offset) of a `KVCache`: buffers (B, H, capacity, h), None
    before the first update, and the number of positions written."""
    return cache.keys, cache.values, cache.offset


def set_kv_buffers(cache, keys, values, offset: int) -> None:
    """Replace a `KVCache`'s buffers and write position (its capacity is the
    buffers' third axis; positions past `offset` are never read)."""
    cache.keys, cache.values, cache.offset = keys, values, offset


def llama4_attn_scale(L: int, offset, beta: float, original: int):
    """mlx-lm's Ministral 3 query scale for L positions from `offset` (an int
    or a (B,) array): 1 + beta * log(1 + floor(pos / original)), shaped to
    multiply q (B, H, L, h) as stock's attention does."""
    try:
        from mlx_lm.models.ministral3 import _get_llama_4_attn_scale
    except ImportError as e:
        raise _changed("mlx_lm.models.ministral3._get_llama_4_attn_scale", e) from None
    return _get_llama_4_attn_scale(L, offset, beta, original)


def gemma4_per_layer_inputs(model, inputs, embeddings, h):
    """Stock's per-layer inputs (B, L, layers, P) of token ids `inputs` (or,
    with None, of the raw `embeddings`' nearest tokens), projected from the
    scaled embeddings h: mlx-lm's two methods called on `model`, which holds
    their modules and fields under stock's names."""
    try:
        from mlx_lm.models.gemma4_text import Gemma4TextModel as stock

        get, project = stock._get_per_layer_inputs, stock._project_per_layer_inputs
    except (ImportError, AttributeError) as e:
        raise _changed("gemma4_text.Gemma4TextModel's per-layer input methods", e)
    return project(model, h, get(model, inputs, embeddings))
