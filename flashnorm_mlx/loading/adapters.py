"""mlx-lm LoRA and DoRA adapters, fused into a Source's weights before the fold,
by mlx-lm's own layers, so every mode and `convert` run the fine-tuned
function (docs/design.md section 5a).
"""

import copy
import dataclasses
import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import fold, quant
from ..errors import LoadError
from .checks import check_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
FINE_TUNE_TYPES = ("lora", "dora")  # mlx-lm's "full" writes whole weights instead
LEAVES = {"lora": ("lora_a", "lora_b"), "dora": ("lora_a", "lora_b", "m")}


def read_adapter(path) -> Tuple[dict, dict]:
    """(config, weights) of an adapter folder, every problem one LoadError line."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise LoadError(f"--adapter-path {path}: no such adapter folder")
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise LoadError(f"{folder}: no {f.name} (not an mlx-lm adapter folder)")
    try:
        config = json.loads(config_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"{config_file}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoadError(f"{config_file}: not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        raise LoadError(
            f"{config_file}: fine_tune_type {kind!r} is not taken (choose from "
            f"{', '.join(FINE_TUNE_TYPES)}; a full fine-tune is a model: run it as MODEL)"
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise LoadError(f"{config_file}: no lora_parameters object")
    scale = params.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        hint = " (mlx-lm's key is 'scale', not 'alpha')" if "alpha" in params else ""
        raise LoadError(f"{config_file}: lora_parameters has no numeric scale{hint}")
    check_safetensors(weights_file)
    try:
        weights = mx.load(str(weights_file))
    except Exception as e:
        raise LoadError(
            f"{weights_file}: not a readable safetensors file ({e})"
        ) from None
    return {**config, "fine_tune_type": kind}, weights


def apply_adapter(source, path):
    """A new Source whose weights hold `path`'s adapter fused in (float32 for the
    adapted modules; a quantized source dequantized whole). `source` is kept."""
    config, adapter = read_adapter(path)
    if fold.is_folded(source.config):
        raise LoadError(
            f"{source.name} is a folded checkpoint (convert): an adapter applies "
            "to the weights it was trained on; pass the original model"
        )
    weights, model_config = dict(source.weights), source.config
    from_quantized = None
    if quant.is_quantized(weights):  # the fused weight is off the quantized grid
        from_quantized = copy.deepcopy(model_config.get("quantization") or {})
        weights, model_config = quant.dequantize_weights(
            weights, model_config, mx.float32
        )
    leaves = LEAVES[config["fine_tune_type"]]
    modules = sorted({k.rsplit(".", 1)[0] for k in adapter})
    for module in modules:
        parts = {leaf: adapter.get(f"{module}.{leaf}") for leaf in leaves}
        missing = [leaf for leaf, v in parts.items() if v is None]
        extra = {k.rsplit(".", 1)[1] for k in adapter if k.startswith(module + ".")}
        extra -= set(leaves)
        if missing or extra:
            what = f"lacks {', '.join(missing)}" if missing else f"has {extra}"
            raise LoadError(
                f"{path}: adapter module {module} {what} "
                f"(a {config['fine_tune_type']} adapter holds {', '.join(leaves)})"
            )
        weights.update(_fused(module, weights, parts, config, path))
    return dataclasses.replace(  # a Source (not imported: source.py calls us)
        source,
        config=model_config,
        weights=weights,
        adapter=str(path),
        adapter_from_quantized=from_quantized,
    )


def _fused(module: str, weights: dict, parts: dict, config: dict, path) -> dict:
    """{module.weight: W + delta} by mlx-lm's own layer's fuse, in float32."""
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    key = f"{module}.weight"
    if key not in weights or weights[key].ndim != 2:
        raise LoadError(
            f"{path}: the adapter names {module}, which is no linear layer of this "
            "model (another model's adapter?)"
        )
    w = weights[key].astype(mx.float32)
    out_dims, in_dims = w.shape
    a, b = parts["lora_a"], parts["lora_b"]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != in_dims or b.shape[1] != out_dims:
        raise LoadError(
            f"{path}: adapter shapes for {module} (lora_a {tuple(a.shape)}, lora_b "
            f"{tuple(b.shape)}) do not fit its weight {tuple(w.shape)}"
        )
    linear = nn.Linear(in_dims, out_dims, bias=False)
    linear.weight = w
    cls = DoRALinear if config["fine_tune_type"] == "dora" else LoRALinear
    layer = cls.from_base(
        linear, r=a.shape[1], scale=float(config["lora_parameters"]["scale"])
    )
    layer.lora_a, layer.lora_b = a.astype(mx.float32), b.astype(mx.float32)
    if "m" in parts:
        layer.m = parts["m"].astype(mx.float32)
    return {key: layer.fuse(dequantize=True).weight}


def adapted_quantization(
    source, quantize: Optional[Tuple[int, int]], quantized_way: str
) -> Tuple[Optional[Tuple[int, int]], Optional[str]]:
    """(quantize, note) for a build on an adapted source: a quantized source was
    dequantized to take the adapter, so --requantize quantizes the adapted
    weights again with its bits and group size; otherwise it runs in float."""
    q = source.adapter_from_quantized
    if q is None or quantize:
        return quantize, None
    if quantized_way == "requantize":
        bits, group = q.get("bits", 4), q.get("group_size", 64)
        return (bits, group), (
            f"adapter fused into the dequantized {bits}-bit g{group} weights, "
            "folded and quantized again with those settings"
        )
    return None, (
        "adapter fused into the dequantized weights: runs in float "
        "(--requantize quantizes them again with the source's settings)"
    )


def adapter_comparison(source, how: dict) -> dict:
    """verify's comparison words with an adapter (`how`: rows.comparison's
    for the base source): FlashNorm adapted here against mlx-lm's own adapted
    model, and what else the differences hold."""
    head = (
        "FlashNorm with the adapter fused into its weights before the fold, "
        "against mlx-lm's own adapted model (its LoRA layers unfused)"
    )
    if how["comparison"] == "stored":  # the source was dequantized to take it
        return {
            "comparison": "adapter",
            "comparison_note": f"{head}: the quantized source is dequantized to "
            "take the adapter and runs in float, mlx-lm's model runs it as stored, "
            "so differences include the stored quantized matmuls' own rounding "
            "(--requantize: both quantized again)",
        }
    return {
        "comparison": "adapter" if how["comparison"] == "float" else how["comparison"],
        "comparison_note": f"{head}; {how['comparison_note']}",
    }


def mlx_lm_adapted(model: nn.Module, path) -> nn.Module:
    """mlx-lm's own adapted model, as `mlx_lm.utils.load(..., adapter_path=)`
    makes it: `load_adapters` (LoRA layers, not fused) on a stock model."""
    from mlx_lm.tuner.utils import load_adapters

    read_adapter(path)  # its problems as one line first
    try:
        load_adapters(model, str(path))
    except (ValueError, KeyError) as e:
        raise LoadError(f"{path}: {' '.join(str(e).split())}") from None
    model.eval()
    return model
