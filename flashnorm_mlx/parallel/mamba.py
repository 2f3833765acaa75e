"""Nemotron-H's layers over an mx.distributed group (docs/design.md 2p), ours
and mlx-lm's (stock, nonorm) alike, which share these names; each layer by
the one mixer it holds:
- Mamba-2 by runs of whole groups (`shard_mamba2`): a rank keeps its heads'
  z, x and dt rows of in_proj, its groups' B and C rows, those channels of the
  convolution, its heads' dt_bias, A_log and D, the gated norm's gain on its
  heads (each group's 1/RMS is the rank's own), out_proj's columns summed;
- attention by GQA groups, a ReLU² MLP by hidden columns, experts as
  `sharding.shard_experts` splits them (the router whole on every rank).
Embedding, head and residual stay whole, as for every family (sharding.py).
"""

from typing import List

import mlx.core as mx
import mlx.nn as nn

from ..errors import ShardError
from . import cuts, sharding


def shard_mamba2(m: nn.Module, group, where: str = "") -> None:
    """Split a Mamba-2 mixer by runs of whole groups (in_proj's rows are
    z | x | B | C | dt; the convolution's channels x | B | C)."""
    G, size = m.n_groups, group.size()
    if G < size:
        raise ShardError(
            f"cannot shard {where} over {size} ranks: its Mamba-2 mixer has {G} "
            f"groups, and each rank needs one; launch at most {G} ranks"
        )
    g0, g1 = cuts.runs(G, size)[group.rank()]
    P, N, I = m.head_dim, m.ssm_state_size, m.intermediate_size
    h0, h1 = g0 * (m.num_heads // G), g1 * (m.num_heads // G)
    x = (h0 * P, h1 * P)
    conv = [x, (I + g0 * N, I + g1 * N), (I + (G + g0) * N, I + (G + g1) * N)]
    dt = I + m.conv_dim
    rows = [x] + [(I + a, I + b) for a, b in conv] + [(dt + h0, dt + h1)]
    m.in_proj = cuts.take_rows(m.in_proj, rows)
    if "in_bias" in m:  # ours, added after s
        m.in_bias = cuts.copy_rows(m.in_bias, rows)
    m.conv1d = cuts.take_rows(m.conv1d, conv)
    m.dt_bias, m.A_log, m.D = (
        cuts.copy_rows(a, [(h0, h1)]) for a in (m.dt_bias, m.A_log, m.D)
    )
    if "norm" in m:  # stock's gated norm, or ours keeping its gain
        m.norm.weight = cuts.copy_rows(m.norm.weight, [x])
    m.out_proj = cuts.sum_columns(m.out_proj, x, group, f"{where} out_proj")
    m.num_heads, m.n_groups, m.intermediate_size = h1 - h0, g1 - g0, x[1] - x[0]
    m.conv_dim = m.conv1d.groups = m.intermediate_size + 2 * (g1 - g0) * N


def shard_relu2(mlp: nn.Module, group, where: str = "", summed=True) -> None:
    """up's rows and down's columns (`sharding.shard_mlp`), ours' up_bias too."""
    a, b = sharding.shard_mlp(mlp, group, where, summed)
    if "up_bias" in mlp:
        mlp.up_bias = cuts.copy_rows(mlp.up_bias, [(a, b)])


def shard_moe(moe: nn.Module, arch, group, where: str = "") -> None:
    """`sharding.shard_experts`, with what it does not know of ours: the shared
    expert's up_bias, and the latent out projection's bias once in the sum."""
    shared = moe.get("shared_experts")
    if shared is not None and "up_bias" in shared:
        down, size = shared.down_proj, group.size()
        hidden, unit = cuts.input_width(down), cuts.column_unit(down)
        a, b = cuts.split_ffn(hidden, unit, size, where)[group.rank()]
        shared.up_bias = cuts.copy_rows(shared.up_bias, [(a, b)])
    sharding.shard_experts(moe, arch.moe, group, where)
    latent = moe.get("fc2_latent_proj")
    ours = getattr(moe, "sharding_group", None) is not None  # it sums the block
    if ours and latent is not None and "bias" in latent and group.rank():
        latent.bias = mx.zeros_like(latent.bias)


def shard_layers(layers: List[nn.Module], group, arch) -> None:
    """Every layer's mixer, by what it holds."""
    for i, layer in enumerate(layers):
        m, where = layer.mixer, f"layer {i}"
        if "conv1d" in m:
            shard_mamba2(m, group, where)
        elif "gate" in m:
            shard_moe(m, arch, group, where)
        elif "up_proj" in m:
            shard_relu2(m, group, where)
        else:
            sharding.shard_attention(m, group, where)
