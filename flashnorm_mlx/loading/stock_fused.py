"""stock_fused: stock mlx-lm with q|k|v and gate|up each one matmul, nothing else.

FlashNorm both fuses the projections that read one input and does the norm
work; its lead over stock_fused is what the norm work alone buys (bench's
honest attribution, docs/design.md section 4c). The function is stock's:
stacking rows, quantized ones too, changes no output element.
"""

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..limits import module_q_mode


def groups(arch) -> Tuple[Tuple[str, ...], ...]:
    """The stock module names of each `arch` pair with more than one part, a
    hybrid family's mixers' too (Qwen3.5's DeltaNet inputs)."""
    pairs = dict.fromkeys((*arch.pairs, *(m.pair for m in arch.mixers)))
    return tuple(
        tuple(part.rpartition(".")[2] for part in pair.parts)
        for pair in pairs
        if len(pair.parts) > 1
    )


_ARRAYS = ("weight", "scales", "biases", "bias")


def _axis(key: str) -> int:
    # The rows' axis: a weight's (and its scales') -2, a bias's -1; 2-D or 3-D.
    return -1 if key == "bias" else -2


class Stacked(nn.Module):
    """The parts' rows stacked into one (quantized) linear, computed once per
    input (and, for stacked experts, per indices)."""

    def __init__(self, parts: List[nn.Module]):
        super().__init__()
        for key in _ARRAYS:
            if key in parts[0]:
                stacked = mx.concatenate([p[key] for p in parts], axis=_axis(key))
                setattr(self, key, stacked)
        self.experts = parts[0].weight.ndim == 3
        p0 = parts[0]
        self.quant = (
            (p0.group_size, p0.bits, module_q_mode(p0)) if "scales" in p0 else None
        )
        # The last (input, output): the parts call with the same x in turn.
        object.__setattr__(self, "_last", ((None,), None))

    def cached(self, x: mx.array, *args, **kwargs) -> mx.array:
        key = (x, *args, *kwargs.values())
        last = self._last[0]
        if len(last) != len(key) or any(a is not b for a, b in zip(last, key)):
            out = self._gather(x, *args, **kwargs) if self.experts else self._matmul(x)
            object.__setattr__(self, "_last", (key, out))
        return self._last[1]

    def _gather(self, x, indices, sorted_indices=False):
        """As mlx-lm's (Quantized)SwitchLinear: each row through its expert."""
        if self.quant is None:
            y = mx.gather_mm(
                x,
                self.weight.swapaxes(-1, -2),
                rhs_indices=indices,
                sorted_indices=sorted_indices,
            )
        else:
            group_size, bits, q_mode = self.quant
            y = mx.gather_qmm(
                x,
                self.weight,
                self.scales,
                self.get("biases"),
                rhs_indices=indices,
                transpose=True,
                group_size=group_size,
                bits=bits,
                mode=q_mode,
                sorted_indices=sorted_indices,
            )
        if "bias" in self:
            y = y + mx.expand_dims(self.bias[indices], -2)
        return y

    def _matmul(self, x):
        if self.quant is None:  # as nn.Linear: a bias rides in the same launch
            if "bias" in self:
                return mx.addmm(self.bias, x, self.weight.T)
            return x @ self.weight.T
        else:
            group_size, bits, q_mode = self.quant
            y = mx.quantized_matmul(
                x,
                self.weight,
                self.scales,
                self.get("biases"),
                transpose=True,
                group_size=group_size,
                bits=bits,
                mode=q_mode,
            )
        return y + self.bias if "bias" in self else y


class Part(nn.Module):
    """One projection's columns of a `Stacked` output (a view, no launch)."""

    def __init__(self, stacked: Stacked, start: int, stop: int):
        super().__init__()
        object.__setattr__(self, "_stacked", stacked)  # not a child: counted once
        self.start, self.stop = start, stop

    def __call__(self, x, *args, **kwargs):
        return self._stacked.cached(x, *args, **kwargs)[..., self.start : self.stop]


def _signature(m: nn.Module) -> Optional[Tuple]:
    """What must match for rows to stack: which arrays, their trailing shapes and
    the quantization; None for a module that is not a plain (quantized) linear."""
    if "weight" not in m or any(k not in _ARRAYS for k, _ in m.parameters().items()):
        return None
    if m.get("global_scale") is not None:  # nvfp4 experts' own scales: not stacked
        return None

    def others(a: mx.array, key: str):  # the shape but the rows' axis
        return tuple(n for i, n in enumerate(a.shape) if i != a.ndim + _axis(key))

    shapes = tuple((k, others(m[k], k), m[k].dtype) for k in _ARRAYS if k in m)
    quant = (m.group_size, m.bits, module_q_mode(m)) if "scales" in m else 0
    return shapes, quant


def fuse_projections(model: nn.Module, stacks: Tuple[Tuple[str, ...], ...]) -> int:
    """Stack each group of `stacks` (`groups(arch)`) found in `model` (in place);
    returns how many were stacked. A group whose parts differ (e.g. quantized
    apart) stays."""
    found = [
        (m, names)
        for _, m in model.named_modules()
        for names in stacks
        if all(n in m for n in names)
    ]
    done = 0
    for module, names in found:
        parts = [module[n] for n in names]
        sigs = {_signature(p) for p in parts}
        if len(sigs) != 1 or None in sigs:
            continue
        stacked = Stacked(parts)
        setattr(module, "_".join(n.split("_")[0] for n in names) + "_stacked", stacked)
        start = 0
        for name, part in zip(names, parts):
            stop = start + part.weight.shape[-2]
            setattr(module, name, Part(stacked, start, stop))
            start = stop
        done += 1
    return done
