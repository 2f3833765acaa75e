"""The Python API, mlx-lm's shape: `load` takes `mlx_lm.load`'s keywords, and
`generate` / `stream_generate` are mlx-lm's own, so a script changes one import
line (docs/api.md)."""

from typing import Any, Dict, Optional, Tuple, Union

from .errors import DtypeError, LoadError

DTYPE_NAMES = ("float16", "bfloat16", "float32")


def load(
    path_or_hf_repo: Optional[str] = None,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    adapter_path: Optional[str] = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: Optional[str] = None,
    trust_remote_code: bool = False,
    *,
    mode: Optional[str] = None,
    dtype=None,
    quantize: Optional[Tuple[int, int]] = None,
    quantized_way: str = "stored",
    tokenizer: Optional[str] = None,
    engine: Optional[str] = None,
) -> Union[tuple, Tuple[Any, Any, dict]]:
    """(model, tokenizer), or (model, tokenizer, config) with `return_config`,
    as `mlx_lm.load` returns them; the model is FlashNorm's where FlashNorm
    covers the model_type, mlx-lm's own class otherwise (`mode` as --mode:
    "stock" is mlx-lm's class on the same weights, "flashnorm" on a family
    FlashNorm does not cover an UnsupportedModel).

    mlx-lm's keywords mean what they mean there: `tokenizer_config` goes to the
    Hugging Face tokenizer (e.g. {"eos_token": ...}), `model_config` updates
    config.json, `adapter_path` fuses an mlx-lm LoRA/DoRA adapter before the
    fold. `lazy` is taken and changes nothing: the fold reads each weight once
    and the build evaluates the model a layer at a time, so peak memory is one
    layer above the model either way. Ours: `dtype` ("float16", "bfloat16",
    "float32" or an mx.Dtype), `quantize=(bits, group_size)`, `quantized_way`,
    `tokenizer` (another tokenizer folder or repo), `engine`."""
    from . import models
    from .loading import build_model, read_source
    from .loading.source import resolve

    dtype = mx_dtype(dtype)
    if revision is not None:
        raise LoadError(
            f"revision={revision!r}: not taken here; download that revision "
            "(huggingface_hub.snapshot_download) and pass its folder"
        )
    source = read_source(
        path_or_hf_repo,
        tokenizer=tokenizer,
        adapter_path=adapter_path,
        trust_remote_code=trust_remote_code,
        need_tokenizer=tokenizer_config is None,
    )
    if model_config:  # as mlx_lm.load_model: over config.json's values
        source.config.update(model_config)
    if tokenizer_config is not None:
        where = resolve(tokenizer, trust_remote_code) if tokenizer else source.folder
        if where is None:
            raise LoadError(
                f"{source.name}: tokenizer_config needs a tokenizer folder "
                "(a GGUF carries its own tokenizer): pass tokenizer=PATH"
            )
        source.tokenizer = _tokenizer(where, tokenizer_config, source.config)
    model, config = build_model(
        source,
        mode=models.run_mode(source.config, mode),
        dtype=dtype,
        quantize=quantize,
        quantized_way=quantized_way,
        engine=engine,
    )
    del lazy  # see the docstring
    if return_config:
        return model, source.tokenizer, config
    return model, source.tokenizer


def mx_dtype(dtype):
    """The mx.Dtype of "float16", "bfloat16" or "float32" (or of that mx.Dtype
    itself); anything else one DtypeError (a ValueError) naming the choices."""
    import mlx.core as mx

    from .loading import DTYPES

    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, mx.Dtype) and dtype in DTYPES.values():
        return dtype
    raise DtypeError(
        f"dtype {dtype!r}: choose from {', '.join(DTYPE_NAMES)} "
        "(the name, or the mx.Dtype)"
    )


def _tokenizer(path, tokenizer_config: dict, config: dict):
    """mlx-lm's `load_tokenizer(path, tokenizer_config, eos_token_ids=...)`, as
    mlx_lm.load calls it."""
    from mlx_lm.utils import load_tokenizer

    try:
        return load_tokenizer(
            path, tokenizer_config, eos_token_ids=config.get("eos_token_id")
        )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(f"{path}: could not load the tokenizer ({first})") from None


def __getattr__(name):
    if name in ("generate", "stream_generate"):  # mlx-lm's, imported on use
        import mlx_lm

        return getattr(mlx_lm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
