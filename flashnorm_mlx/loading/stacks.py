"""FlashNorm's stacked q|k|v and gate|up where their members are stored in
different formats or settings (docs/design.md section 2i).

FlashNorm runs each stack as one matmul, which takes one format. llama.cpp's
quantizer mixes types within a stack (a Q5_0 q and k with a Q8_0 v where rows
are not whole 256-blocks; a Q4_K q with a Q6_K v, read as float), and mlx-lm's
mixed recipes give v_proj more bits. Exact ways, per stack:
- affine members at different bits or group sizes: each lifted to the stack's
  most bits and smallest group, the same integers, scales and biases (an
  affine b-bit group is a b'-bit one for any b' >= b, and a group of 64 two of
  32 with equal scales): one matmul, a few bits a weight more;
- any other mix (a float member, or a format other than affine): the cheaper
  in memory of running the members as stored, one matmul a member with the
  outputs joined (models/joined.py: nothing added, the source's tensors
  shared), and every member dequantized and stacked in the compute dtype (the
  quantized members' float bytes added). As stored wherever the model may
  hold a `Joined` (not where it is sharded: sharding cuts stacked rows).
"""

from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

from .. import models
from ..limits import AFFINE, q_mode_of
from ..quant import affine_spec, dequantize_weights, quant_params
from .gguf_kquant import pack


def mixed_settings(tensors: dict, config: dict) -> List[Tuple[List[str], str, str]]:
    """The stacks whose members differ in format or setting (quantized beside
    float, or quantized at other settings), each as (its members' module
    paths, the stacked linear's path, the stacked bias's)."""
    if not any(k.endswith(".scales") for k in tensors) or not models.is_covered(config):
        return []
    arch, out = models.architecture(config), []
    for i, prefix in enumerate(arch.layer_prefixes(config)):
        for pair in arch.layer_pairs(config, i):
            parts = [f"{prefix}.{p}" for p in pair.parts]
            stack = (parts, f"{prefix}.{pair.fused}", f"{prefix}.{pair.fused_bias}")
            quantized = [p for p in parts if f"{p}.scales" in tensors]
            if len(parts) < 2 or not quantized:
                continue
            if len(quantized) < len(parts):  # a float member beside them
                if all(f"{p}.weight" in tensors for p in parts):
                    out.append(stack)
                continue
            specs = [quant_params(config, p) for p in parts]
            if any(s is None for s in specs):  # no settings to go by: fuse says so
                continue
            if len({tuple(sorted(s.items())) for s in specs}) > 1:
                out.append(stack)
    return out


def common_settings(
    tensors: dict, config: dict, dtype: mx.Dtype, join: bool = True
) -> Tuple[dict, dict, Dict[str, int]]:
    """(tensors, config) with every `mixed_settings` stack lifted to one
    setting, run as stored (`join`: the model may hold a models.joined.Joined)
    or stacked in float, whichever costs less; the bytes each way added and
    what the float stacks the joined ones avoid would have held."""
    stacks = mixed_settings(tensors, config)
    if not stacks:
        return tensors, config, {}
    tensors, config = dict(tensors), dict(config)
    q = config["quantization"] = dict(config["quantization"])
    added = {"lifted": 0, "float": 0, "members": 0, "joined": 0, "avoided": 0}
    for parts, fused, fused_bias in stacks:
        specs = {p: quant_params(config, p) for p in parts if f"{p}.scales" in tensors}
        affine = len(specs) == len(parts) and all(
            q_mode_of(s) == AFFINE
            and mx.issubdtype(tensors[f"{p}.scales"].dtype, mx.floating)
            for p, s in specs.items()
        )
        if affine:
            grown, n = _lift(tensors, q, specs)
            added["lifted"] += grown
            added["members"] += n
        else:
            floated = _float_bytes(tensors, specs, dtype)
            if join and floated > 0:  # as stored adds nothing: the cheaper
                _as_members(tensors, q, parts, fused, fused_bias)
                added["joined"] += 1
                added["avoided"] += floated
                continue
            for p in specs:  # quant/specs.py's float32 dequantization
                part = {f"{p}.{a}": tensors.pop(f"{p}.{a}", None) for a in _ARRAYS}
                part = {k: v for k, v in part.items() if v is not None}
                tensors.update(dequantize_weights(part, config, dtype)[0])
                q.pop(p, None)
            added["float"] += floated
            added["members"] += len(specs)
    return tensors, config, added


def _lift(tensors: dict, q: dict, specs: dict) -> Tuple[int, int]:
    """Every member of an affine stack at its most bits and smallest group
    (in place); the bytes added and the members changed."""
    bits = max(s["bits"] for s in specs.values())
    group = min(s["group_size"] for s in specs.values())
    grown = n = 0
    for p, s in specs.items():
        if (s["bits"], s["group_size"]) == (bits, group):
            continue
        n += 1
        before = _nbytes(tensors, p)
        tensors.update(_lifted(tensors, p, s, bits, group))
        q[p] = affine_spec(bits, group)
        grown += _nbytes(tensors, p) - before
    return grown, n


def _float_bytes(tensors: dict, specs: dict, dtype: mx.Dtype) -> int:
    """What stacking in float adds: the quantized members' float bytes over
    their stored ones."""
    out = 0
    for p in specs:
        rows, cols = tensors[f"{p}.weight"].shape[0], tensors[f"{p}.scales"].shape[-1]
        in_dims = cols * specs[p]["group_size"]
        out += rows * in_dims * dtype.size - _nbytes(tensors, p)
    return out


def _as_members(tensors: dict, q: dict, parts, fused: str, fused_bias: str) -> None:
    """The stack's members renamed `{fused}.parts.{j}` (in place), as stored,
    for models.joined.join_like; their biases stacked as the stack's (added
    after the deferred scale, as fuse stacks them)."""
    for j, p in enumerate(parts):
        for k in _ARRAYS:
            if f"{p}.{k}" in tensors:
                tensors[f"{fused}.parts.{j}.{k}"] = tensors.pop(f"{p}.{k}")
        if p in q:
            q[f"{fused}.parts.{j}"] = q.pop(p)
    biases = [tensors.pop(f"{p}.bias", None) for p in parts]
    if all(b is not None for b in biases):
        tensors[fused_bias] = mx.concatenate(biases, axis=0)


def _nbytes(tensors: dict, module: str) -> int:
    return sum(
        tensors[f"{module}.{k}"].nbytes for k in _ARRAYS if f"{module}.{k}" in tensors
    )


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


def note(added: Dict[str, int]) -> str:
    """One line: how many stacks or members were taken another way, and the
    memory each way costs."""
    ways = []
    if added.get("lifted"):
        ways.append(f"lifted to the stack's bits (+{_size(added['lifted'])})")
    if added.get("float"):
        ways.append(f"dequantized into a float stack (+{_size(added['float'])})")
    said = []
    if ways:
        said.append(
            f"{added['members']} q|k|v, gate|up members stored with other settings "
            f"than the rest of their stack run {' and '.join(ways)}: FlashNorm "
            "stacks each as one matmul; the same weights, the stored results"
        )
    if added.get("joined"):
        said.append(
            f"{added['joined']} q|k|v, gate|up stacks mixing float and quantized "
            "members run them as stored, one matmul a member (+0 B; stacked in "
            f"float they would add {_size(added['avoided'])}): the stored results"
        )
    return "; ".join(said)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"
