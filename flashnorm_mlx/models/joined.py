"""A stacked q|k|v or gate|up whose members stay as stored: one matmul a
member, outputs joined (docs/design.md section 2i).

FlashNorm stacks the linears one norm feeds into one matmul, which takes one
format. Where a stack mixes a float member with quantized ones (a GGUF's Q6_K
v, read as float, beside Q4_K q and k), stacking in float would hold every
member dequantized beside the source's; `Joined` runs each member as the
checkpoint holds it instead, with the stacked linear's interface (x -> the
stacked rows' output), so the deferred 1/RMS and any bias apply after it as
for the stack. Its tensors are named `{stack}.parts.{j}.{weight,...}`
(`loading/stacks.py` names them so); `join_like` builds the modules.
"""

import re
from typing import List

import mlx.core as mx
import mlx.nn as nn

PART = re.compile(r"^(.*)\.parts\.(\d+)\.weight$")


class Joined(nn.Module):
    """Members (Linear or QuantizedLinear, any settings) read the same input;
    the output is their outputs side by side, as the stacked rows give it."""

    def __init__(self, parts: List[nn.Module]):
        super().__init__()
        self.parts = parts

    def __call__(self, x):
        return mx.concatenate([p(x) for p in self.parts], axis=-1)


def join_like(model: nn.Module, weights: dict) -> None:
    """Replace each stacked linear of `model` whose rows `weights` hold as
    members (`{stack}.parts.{j}.weight`) by a `Joined` of float linears of
    their shapes (`models.quantize_like` then quantizes those with scales)."""
    counts = {}
    for k in weights:
        m = PART.match(k)
        if m:
            counts[m[1]] = max(counts.get(m[1], 0), int(m[2]) + 1)
    for path, n in counts.items():
        *parents, name = path.split(".")
        owner = model
        for p in parents:
            owner = owner[int(p)] if isinstance(owner, list) else owner[p]
        in_dims = owner[name].weight.shape[-1]
        outs = [weights[f"{path}.parts.{j}.weight"].shape[0] for j in range(n)]
        setattr(owner, name, Joined([nn.Linear(in_dims, o, bias=False) for o in outs]))
