"""The cuts sharding makes (sharding.py): which rows or input columns of a
linear each rank keeps, and the all-summed linear a column cut becomes. A
quantized linear is cut on its group boundaries only; a cut array is copied,
so the whole tensor it came from can be freed.
"""

import copy
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

from ..errors import ShardError
from ..limits import module_q_mode


def runs(total: int, parts: int, unit: int = 1) -> List[Tuple[int, int]]:
    """`total` split into `parts` contiguous [a, b) runs of whole `unit`s, as
    even as can be (the first runs one unit longer); a run may be empty."""
    n, extra = divmod(total // unit, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + (n + (i < extra)) * unit)
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class HeadSplit:
    """One rank's share of an attention layer: query heads [q0, q1) and the
    key/value heads [k0, k1) they attend to, whole GQA groups only."""

    q0: int
    q1: int
    k0: int
    k1: int

    @property
    def n_heads(self) -> int:
        return self.q1 - self.q0

    @property
    def n_kv_heads(self) -> int:
        return self.k1 - self.k0


def split_heads(
    n_heads: int, n_kv_heads: int, size: int, where: str = ""
) -> List[HeadSplit]:
    """Every rank's HeadSplit (index = rank). At least as many key/value heads as
    ranks: contiguous runs of them, each with its query heads (SmolLM2's 9:3 over
    2 ranks: 6:2 and 3:1). Fewer: each key/value head goes to a run of ranks that
    split its query heads and all hold it (5:1 over 2: 3:1 and 2:1). Attention
    needs whole groups per rank (local query heads a multiple of local kv heads,
    in order), which both keep. ShardError with fewer query heads than ranks."""
    at = f" ({where})" if where else ""
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ShardError(
            f"cannot shard{at}: {n_heads} query heads do not form whole groups "
            f"over {n_kv_heads} key/value heads"
        )
    if n_heads < size:
        raise ShardError(
            f"cannot shard over {size} ranks{at}: {n_heads} query heads, and each "
            f"rank needs at least one; launch at most {n_heads} ranks"
        )
    g = n_heads // n_kv_heads
    if n_kv_heads >= size:
        return [HeadSplit(a * g, b * g, a, b) for a, b in runs(n_kv_heads, size)]
    splits = []
    for kv, (r0, r1) in enumerate(runs(size, n_kv_heads)):  # ranks per kv head
        for a, b in runs(g, r1 - r0):
            splits.append(HeadSplit(kv * g + a, kv * g + b, kv, kv + 1))
    return splits


def copy_rows(
    a: mx.array, ranges: Sequence[Tuple[int, int]], axis: int = 0
) -> mx.array:
    """The rows (axis 0) or columns (axis -1) in `ranges`, copied: a view would
    keep the whole source tensor alive."""
    parts = [a[s:e] if axis == 0 else a[..., s:e] for s, e in ranges]
    return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis))


def take_rows(linear: nn.Module, ranges: Sequence[Tuple[int, int]]) -> nn.Module:
    """`linear` (float or quantized) holding only its output rows in `ranges`:
    the all-to-sharded half, which needs no communication to run. Quantization
    groups run along a row, so any row range is exact."""
    part = copy.copy(linear)
    for key in ("weight", "scales", "biases", "bias"):
        if key in linear and linear[key] is not None:
            part[key] = copy_rows(linear[key], ranges)
    return part


class _SumLinear(ShardedToAllLinear):
    """Input columns of a linear layer; its output all-summed over the group,
    then the bias (once). mlx's class, built from the cut arrays, as its own
    constructor wants an even split."""

    def __init__(self, weight, bias, group):
        nn.Module.__init__(self)
        self.group = group
        self.weight = weight
        if bias is not None:
            self.bias = bias


class _QuantizedSumLinear(QuantizedShardedToAllLinear):
    """_SumLinear for a quantized layer (columns cut on group boundaries)."""

    def __init__(self, arrays: dict, bias, layer: nn.QuantizedLinear, group):
        nn.Module.__init__(self)
        self.group = group
        self.group_size, self.bits = layer.group_size, layer.bits
        self.mode = module_q_mode(layer)  # mlx's attribute: its __call__ reads it
        self.weight, self.scales = arrays["weight"], arrays["scales"]
        self.biases = arrays.get("biases")
        if bias is not None:
            self.bias = bias
        self.freeze()


def column_unit(linear: nn.Module) -> int:
    """The finest column split of `linear`: a quantized layer's group size."""
    return linear.group_size if isinstance(linear, nn.QuantizedLinear) else 1


def input_width(linear: nn.Module) -> int:
    cols = linear.weight.shape[1]
    if isinstance(linear, nn.QuantizedLinear):
        cols = cols * 32 // linear.bits
    return cols


def _column_arrays(linear: nn.Module, cols: Tuple[int, int], group, name: str):
    """`linear`'s arrays for its input columns [a, b) (a quantized layer's cut
    on its group boundaries only, else ShardError), its bias apart."""
    a, b = cols
    if not isinstance(linear, nn.QuantizedLinear):
        return {"weight": copy_rows(linear.weight, [cols], -1)}
    gs, bits = linear.group_size, linear.bits
    if a % gs or b % gs or (a * bits) % 32:
        raise ShardError(
            f"cannot shard {name} over {group.size()} ranks: a rank's input columns "
            f"{a}-{b} do not start and end on its quantization groups of {gs} "
            "(quantize with a --q-group-size that divides the head dimension, "
            "or run in float)"
        )
    packed = (a * bits // 32, b * bits // 32)
    arrays = {"weight": copy_rows(linear.weight, [packed], -1)}
    for key in ("scales", "biases"):
        if key in linear and linear[key] is not None:
            arrays[key] = copy_rows(linear[key], [(a // gs, b // gs)], -1)
    return arrays


def sum_columns(linear: nn.Module, cols: Tuple[int, int], group, name: str):
    """The sharded-to-all half: `linear`'s input columns [a, b), output all-summed."""
    arrays = _column_arrays(linear, cols, group, name)
    bias = linear["bias"] if "bias" in linear else None
    if not isinstance(linear, nn.QuantizedLinear):
        return _SumLinear(arrays["weight"], bias, group)
    return _QuantizedSumLinear(arrays, bias, linear, group)


def split_ffn(hidden: int, unit: int, size: int, name: str) -> List[Tuple[int, int]]:
    """Every rank's hidden columns [a, b): as even as whole `unit`s allow."""
    units = hidden // unit
    if units < size:
        if unit > 1:
            what = f"{units} quantization group(s) of {unit}"
            fix = f"launch at most {units} ranks, or quantize with a smaller group"
        else:
            what, fix = f"{hidden} hidden columns", f"launch at most {hidden} ranks"
        raise ShardError(
            f"cannot shard {name} over {size} ranks: its input is {what}, and "
            f"each rank needs at least one; {fix}"
        )
    return runs(hidden, size, unit)


def take_columns(linear: nn.Module, cols: Tuple[int, int], group, name: str):
    """`linear` holding only its input columns [a, b), not summed: for a
    block that all-sums its whole output once (a shared expert's down beside
    the routed experts'). A bias stays on rank 0 alone, added once by the sum."""
    part = copy.copy(linear)
    for key, array in _column_arrays(linear, cols, group, name).items():
        part[key] = array
    if "bias" in linear and group.rank():
        part.bias = mx.zeros_like(linear.bias)
    return part


def copy_expert_rows(a: mx.array, ranges) -> mx.array:
    """Rows (axis -2) of stacked experts' arrays (experts, rows, cols), copied."""
    parts = [a[:, s:e] for s, e in ranges]
    return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, 1))
