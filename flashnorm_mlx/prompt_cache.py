"""Prompt-cache files: a prompt's KV cache saved once and reused, in mlx-lm's
format. A file is taken only by the model, mode and weights it was made with,
so a reply from a cache is the reply the same command gives without it. A file
mlx-lm's own cache_prompt made holds stock's K and V, which FlashNorm caches
too: it runs in either mode, with --mode stock where a layer holds recurrent
state (docs/design.md section 5d).
"""

import json
import os
import tempfile
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from .errors import LoadError
from .limits import AFFINE, module_q_mode
from .loading import model_dtype
from .loading.checks import check_safetensors
from .modes import Mode

PREFIX = "flashnorm_mlx_"  # no dots: load_prompt_cache unflattens keys at them
MODE, WEIGHTS, ADAPTER, TOKENS = (
    PREFIX + k for k in ("mode", "weights", "adapter", "tokens")
)


def weights_words(model: nn.Module) -> str:
    """'float32', or 'float32, 4-bit group 64': what a cache must be made with."""
    q = sorted(
        {
            (m.bits, m.group_size, module_q_mode(m))
            for _, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        }
    )
    words = [f"{b}-bit group {g}" if qm == AFFINE else qm for b, g, qm in q]
    return ", ".join([model_dtype(model), *words])


def model_id(model: Optional[str]) -> str:
    """How a file names its model: MODEL as a full path when it is a local file
    or folder (mlx-lm writes MODEL as given), a hub id as given."""
    from .loading.source import resolve

    if model is None:
        return str(resolve(None))
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def identity(model_arg: Optional[str], mode: Mode, model=None, adapter=None) -> dict:
    """The metadata a file records for the model it was made with (the weights
    only when `model` is given)."""
    return {
        "model": model_id(model_arg),
        "tokenizer_config": json.dumps({}),
        MODE: mode.name,
        **({WEIGHTS: weights_words(model)} if model is not None else {}),
        ADAPTER: str(Path(adapter).expanduser().resolve()) if adapter else "",
    }


def tokenizer_config(eos_token: Optional[str]) -> dict:
    """The `tokenizer_config` a file records (mlx-lm's key): the --eos-token."""
    return {} if eos_token is None else {"eos_token": eos_token}


def apply_tokenizer_config(config: dict, tokenizer, path) -> None:
    """A file's (or cache-prompt's) `eos_token` made the tokenizer's, as
    mlx-lm's generate loads the tokenizer with the file's tokenizer_config: the
    template's eos_token, and generation stops at it. Not a token: one line."""
    from .mlx_lm_compat import inner_tokenizer

    eos = config.get("eos_token") if isinstance(config, dict) else None
    if eos is None:
        return
    inner = inner_tokenizer(tokenizer)
    if not isinstance(eos, str) or eos not in inner.get_vocab():
        raise LoadError(f"{path}: --eos-token {eos!r} is not a token of its tokenizer")
    inner.eos_token = eos
    tokenizer.add_eos_token(eos)


def use_file_tokenizer(path, meta: dict, tokenizer) -> None:
    """The file's tokenizer_config (its --eos-token) on this run's tokenizer."""
    try:
        config = json.loads(meta.get("tokenizer_config") or "{}")
    except ValueError:
        raise LoadError(f"{path}: its tokenizer_config is not JSON") from None
    apply_tokenizer_config(config, tokenizer, path)


def save(
    path,
    model: nn.Module,
    ids: List[int],
    metadata: dict,
    step: int = 2048,
    kv=None,
):
    """Prefill `ids` into a fresh cache (mlx-lm's generate_step, as its
    cache_prompt runs it: `kv`, a decoding.KVOptions, sizes and quantizes it
    there) and write it to `path`, whole or not at all."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import save_prompt_cache

    from .decode_options import KVOptions, make_cache

    if not ids:
        raise LoadError("the prompt encodes to no tokens")
    kv = kv or KVOptions()
    cache = make_cache(model, kv.max_kv_size)
    steps = generate_step(
        mx.array(ids),
        model,
        max_tokens=0,
        prompt_cache=cache,
        prefill_step_size=step,
        **kv.quantize_kwargs(),
    )
    for _ in steps:
        pass
    out = Path(path).expanduser()
    # MLX adds .safetensors to a name without it: write that, then rename.
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    os.unlink(tmp)
    tmp += ".safetensors"
    try:
        save_prompt_cache(tmp, cache, {**metadata, TOKENS: json.dumps(ids)})
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(ids)


def read(path, model_arg: Optional[str], mode: Mode, adapter=None):
    """(cache, metadata) of a file made with this MODEL, mode and adapter, read
    before the model is built; anything else is one LoadError line."""
    from mlx_lm.models.cache import load_prompt_cache

    f = Path(path).expanduser()
    if not f.is_file():
        raise LoadError(f"--prompt-cache-file {path}: no such file")
    check_safetensors(f)  # MLX trusts the header's offsets
    try:
        cache, meta = load_prompt_cache(str(f), return_metadata=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LoadError(f"{path}: not a prompt-cache file ({first})") from None
    if not isinstance(meta, dict) or "model" not in meta or not cache:
        raise LoadError(f"{path}: not a prompt-cache file (no model in its metadata)")
    want = identity(model_arg, mode, adapter=adapter)
    if model_id(meta["model"]) != want["model"]:  # mlx-lm's: MODEL as given
        raise LoadError(
            f"{path} was made with another model ({meta['model']}), not "
            f"{want['model']}"
        )
    if MODE not in meta:  # mlx-lm's cache_prompt: stock's K/V, any mode (fit)
        return cache, meta
    for key, what in ((MODE, "--mode"), (ADAPTER, "adapter")):
        if meta.get(key, "") != want[key]:
            theirs, ours = meta.get(key) or "none", want[key] or "none"
            raise LoadError(
                f"{path} was made with {what} {theirs}; this run has {what} {ours}"
            )
    return cache, meta


# A full-attention layer's KVCache, saved quantized (--kv-bits) or rotating
# (--max-kv-size) as generate would hold it with those flags.
_STANDS_FOR = {"KVCache": {"KVCache", "QuantizedKVCache", "RotatingKVCache"}}


def _takes(held: str, fresh: str) -> bool:
    return held in _STANDS_FOR.get(fresh, {fresh})


def check_kv_flags(path, cache: list, kv_bits, kv_group_size: int) -> None:
    """A quantized file with other --kv-bits or --kv-group-size: one line (mlx-lm
    raises on both)."""
    from mlx_lm.models.cache import QuantizedKVCache

    q = next((c for c in cache if isinstance(c, QuantizedKVCache)), None)
    if q is None:
        return
    if kv_bits is not None and kv_bits != q.bits:
        raise LoadError(f"--kv-bits {kv_bits}: {path} holds a {q.bits}-bit KV cache")
    if kv_group_size != q.group_size:
        raise LoadError(
            f"--kv-group-size {kv_group_size}: {path} holds a KV cache quantized "
            f"in groups of {q.group_size}"
        )


# What a layer caches where it holds keys and values (stock's, in FlashNorm too).
_KV_KINDS = {"KVCache", "RotatingKVCache", "QuantizedKVCache", "ChunkedKVCache"}


def fit(
    path, cache: list, meta: dict, model: nn.Module, mode: Optional[Mode] = None
) -> Optional[List[int]]:
    """Check a read file against the built model (weights, layers, dtype);
    returns its token ids (None for an mlx-lm file, which has none). An
    mlx-lm file runs in FlashNorm where every layer caches keys and values:
    FlashNorm caches stock's (the deferred 1/RMS reaches k and v first)."""
    from mlx_lm.models.cache import make_prompt_cache

    if MODE not in meta and mode is not None and not mode.is_mlx_lms:
        other = sorted({type(c).__name__ for c in make_prompt_cache(model)})
        other = [k for k in other if k not in _KV_KINDS]
        if other:
            raise LoadError(
                f"{path} was made by mlx-lm's cache_prompt; FlashNorm takes "
                f"such a file where every layer caches keys and values, and "
                f"this model's {', '.join(other)} layers hold recurrent state: "
                "run it with --mode stock"
            )
    words = weights_words(model)
    if WEIGHTS in meta and meta[WEIGHTS] != words:
        raise LoadError(
            f"{path} was made with {meta[WEIGHTS]} weights; this run has {words}"
        )
    fresh = make_prompt_cache(model)
    kinds = [type(c).__name__ for c in cache]
    want = [type(c).__name__ for c in fresh]
    if len(kinds) != len(want) or not all(map(_takes, kinds, want)):
        raise LoadError(
            f"{path} holds {len(cache)} layer caches ({', '.join(sorted(set(kinds)))})"
            f"; this model has {len(fresh)} ({type(fresh[0]).__name__})"
        )
    probe = make_prompt_cache(model)  # one token: this model's K/V shapes
    mx.eval(model(mx.array([[0]]), cache=probe))
    for c, p in zip(cache, probe):
        for part in ("keys", "values"):
            a, b = getattr(c, part, None), getattr(p, part, None)
            if isinstance(a, mx.array) and isinstance(b, mx.array):
                if (a.shape[1], a.shape[-1]) != (b.shape[1], b.shape[-1]):
                    raise LoadError(
                        f"{path} holds {part} of {a.shape[1]} heads x "
                        f"{a.shape[-1]}; this model's are {b.shape[1]} x "
                        f"{b.shape[-1]} (another model, or a sharded one)"
                    )
    dtype, keys = model_dtype(model), getattr(cache[0], "keys", None)
    if isinstance(keys, mx.array) and str(keys.dtype).split(".")[-1] != dtype:
        held = str(keys.dtype).split(".")[-1]
        raise LoadError(
            f"{path} holds {held} keys; this model computes in {dtype} "
            f"(--dtype {held} runs it)"
        )
    try:
        ids = json.loads(meta[TOKENS]) if TOKENS in meta else None
    except ValueError:
        ids = "bad"
    if ids is not None and not (
        isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    ):
        raise LoadError(f"{path}: its token ids are not a list of integers")
    return ids
