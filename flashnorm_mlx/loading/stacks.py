"""FlashNorm's stacked q|k|v and gate|up where their members are stored with
different quantization settings (docs/design.md section 2i).

FlashNorm runs each stack as one matmul, which takes one format. llama.cpp's
quantizer mixes types within a stack (a Q5_0 q and k with a Q8_0 v where rows
are not whole 256-blocks; a Q4_K q with a Q6_K v), and mlx-lm's mixed recipes
give v_proj more bits. Two exact ways, the cheaper first:
- affine members at different bits or group sizes: each lifted to the stack's
  most bits and smallest group, the same integers, scales and biases (an
  affine b-bit group is a b'-bit one for any b' >= b, and a group of 64 two of
  32 with equal scales): the function as stored, a few bits a weight more;
- any other mix (a member in float, or a format other than affine): every
  member dequantized and stacked in the compute dtype (gguf_kquant.float_pairs
  for a float member; here for the rest).
"""

from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

from .. import models
from ..limits import AFFINE, q_mode_of
from ..quant import affine_spec, quant_params
from .gguf_kquant import pack


def mixed_settings(tensors: dict, config: dict) -> List[List[str]]:
    """The stacks whose quantized members (all of them quantized) differ in
    setting, each as its members' module paths."""
    if not any(k.endswith(".scales") for k in tensors) or not models.is_covered(config):
        return []
    arch, out = models.architecture(config), []
    for i, prefix in enumerate(arch.layer_prefixes(config)):
        for pair in arch.layer_pairs(config, i):
            parts = [f"{prefix}.{p}" for p in pair.parts]
            if len(parts) < 2 or any(f"{p}.scales" not in tensors for p in parts):
                continue
            specs = [quant_params(config, p) for p in parts]
            if any(s is None for s in specs):  # no settings to go by: fuse says so
                continue
            settings = {tuple(sorted(s.items())) for s in specs}
            if len(settings) > 1:
                out.append(parts)
    return out


def common_settings(
    tensors: dict, config: dict, dtype: mx.Dtype
) -> Tuple[dict, dict, Dict[str, int]]:
    """(tensors, config) with every `mixed_settings` stack at one setting, and
    the bytes each way added: {"lifted": ..., "float": ...}."""
    stacks = mixed_settings(tensors, config)
    if not stacks:
        return tensors, config, {}
    tensors, config = dict(tensors), dict(config)
    q = config["quantization"] = dict(config["quantization"])
    added = {"lifted": 0, "float": 0, "members": 0}
    for parts in stacks:
        specs = {p: quant_params(config, p) for p in parts}
        affine = all(
            q_mode_of(s) == AFFINE
            and mx.issubdtype(tensors[f"{p}.scales"].dtype, mx.floating)
            for p, s in specs.items()
        )
        bits = max(s["bits"] for s in specs.values())
        group = min(s["group_size"] for s in specs.values())
        for p, s in specs.items():
            if affine and (s["bits"], s["group_size"]) == (bits, group):
                continue
            before = sum(tensors[f"{p}.{k}"].nbytes for k in ("weight", "scales"))
            before += tensors[f"{p}.biases"].nbytes if f"{p}.biases" in tensors else 0
            if affine:
                tensors.update(_lifted(tensors, p, s, bits, group))
                q[p] = affine_spec(bits, group)
            else:
                tensors.update(_dequantized(tensors, p, s, dtype))
                q.pop(p, None)
            after = sum(
                tensors[f"{p}.{k}"].nbytes for k in _ARRAYS if f"{p}.{k}" in tensors
            )
            added["lifted" if affine else "float"] += after - before
            added["members"] += 1
    return tensors, config, added


_ARRAYS = ("weight", "scales", "biases")


def _lifted(tensors: dict, module: str, spec: dict, bits: int, group: int) -> dict:
    """One affine member at `bits` and `group`: its integers repacked, its
    scales and biases repeated, the same weights bit for bit."""
    packed, scales = tensors[f"{module}.weight"], tensors[f"{module}.scales"]
    biases = tensors[f"{module}.biases"]
    ints = mx.dequantize(  # the stored integers, exactly (< 2**8)
        packed,
        mx.ones(scales.shape, mx.float32),
        mx.zeros(scales.shape, mx.float32),
        group_size=spec["group_size"],
        bits=spec["bits"],
    )
    flat = np.array(ints).astype(np.uint8).reshape(-1, ints.shape[-1])
    words = mx.array(pack(flat, bits)).reshape(*ints.shape[:-1], -1)
    times = spec["group_size"] // group
    return {
        f"{module}.weight": words,
        f"{module}.scales": mx.repeat(scales, times, axis=-1),
        f"{module}.biases": mx.repeat(biases, times, axis=-1),
    }


def _dequantized(tensors: dict, module: str, spec: dict, dtype: mx.Dtype) -> dict:
    keys = [f"{module}.{k}" for k in _ARRAYS]
    packed, scales, biases = (tensors.pop(k, None) for k in keys)
    if mx.issubdtype(scales.dtype, mx.floating):  # float32 math (quant/specs.py)
        scales = scales.astype(mx.float32)
        biases = None if biases is None else biases.astype(mx.float32)
    w = mx.dequantize(
        packed,
        scales,
        biases,
        group_size=spec["group_size"],
        bits=spec["bits"],
        mode=q_mode_of(spec),
    )
    return {f"{module}.weight": w.astype(dtype)}


def note(added: Dict[str, int]) -> str:
    """One line: how many members were taken another way, and the memory."""
    ways = []
    if added.get("lifted"):
        ways.append(f"lifted to the stack's bits (+{_size(added['lifted'])})")
    if added.get("float"):
        ways.append(f"dequantized into a float stack (+{_size(added['float'])})")
    return (
        f"{added['members']} q|k|v, gate|up members stored with other settings "
        f"than the rest of their stack run {' and '.join(ways)}: FlashNorm "
        "stacks each as one matmul; the same weights, the stored results"
    )


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"
