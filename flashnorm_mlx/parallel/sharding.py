"""Splitting a model over an mx.distributed group: a model's `shard(group)`.

Started by `mlx.launch -n N ...`, each command joins the launch's group, builds
its model with `shard_model` applied before the weights are evaluated, and
prints on rank 0 only. Attention splits by whole GQA groups (`split_heads`):
each rank takes a run of key/value heads and the query heads that attend to
them, unevenly where the counts do not divide, and where there are fewer
key/value heads than ranks a key/value head is held by every rank whose query
heads need it. q|k|v and gate|up keep their rows for those heads and hidden
columns; o_proj and down_proj their input columns, the outputs all-summed
(cuts.py).
The same functions split ours, mlx-lm's (stock) and nonorm's models, whose
layers share these names. FlashNorm needs nothing more: every rank holds the
whole residual row, so the per-token mean square is exact locally, and the
folded gains live on input columns, which a row split keeps whole.
"""

import copy
from typing import List, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import ShardError
from .cuts import (
    HeadSplit,
    column_unit,
    copy_expert_rows,
    copy_rows,
    input_width,
    runs,
    split_ffn,
    split_heads,
    sum_columns,
    take_columns,
    take_rows,
)


def shard_attention(attn: nn.Module, group, where: str = "") -> HeadSplit:
    """Split one attention module over `group` by whole GQA groups (split_heads):
    its q, k and v rows, fused as q|k|v (ours, OpenELM's; with our `qkv_bias`)
    or three linears (mlx-lm's Llama, Qwen2, Qwen3), and the o_proj/out_proj
    columns that read its query heads; the local head counts set. The same for
    FlashNorm, stock and nonorm, which share these names."""
    # mlx-lm's Mixtral names its head counts num_heads / num_key_value_heads.
    counts = ("n_heads", "n_kv_heads")
    if not hasattr(attn, "n_heads"):  # mlx-lm's gpt-oss: num_attention_heads
        q_name = "num_heads" if hasattr(attn, "num_heads") else "num_attention_heads"
        counts = (q_name, "num_key_value_heads")
    hq, hkv = (getattr(attn, c) for c in counts)
    mine = split_heads(hq, hkv, group.size(), where)[group.rank()]
    fused = "qkv_proj" in attn
    # Row blocks of k and v heads after q's: 2, or Gemma 4's K = V layer's 1
    # (k alone) and KV-shared layer's 0 (q alone: it reads the same kv heads
    # of its source layer, split alike).
    kv_sets = getattr(attn, "kv_row_sets", 2)
    if fused:  # (rows are output features, quantized or not)
        h = attn.qkv_proj.weight.shape[0] // (hq + kv_sets * hkv)
    else:  # mlx-lm's Qwen2 keeps no head_dim
        h = getattr(attn, "head_dim", None) or attn.q_proj.weight.shape[0] // hq
    q = [(mine.q0 * h, mine.q1 * h)]
    kv = [(mine.k0 * h, mine.k1 * h)]
    if fused:  # rows [q heads | k heads | v heads]
        k_at, v_at = hq * h, (hq + hkv) * h
        rows = q + ([(a + k_at, b + k_at) for a, b in kv] if kv_sets > 0 else [])
        rows += [(a + v_at, b + v_at) for a, b in kv] if kv_sets > 1 else []
        attn.qkv_proj = take_rows(attn.qkv_proj, rows)
        if "qkv_bias" in attn:
            attn.qkv_bias = copy_rows(attn.qkv_bias, rows)
    else:  # mlx-lm's gated attention: q_proj rows per head [q | gate], 2h
        qh = attn.q_proj.weight.shape[0] // hq
        attn.q_proj = take_rows(attn.q_proj, [(mine.q0 * qh, mine.q1 * qh)])
        attn.k_proj = take_rows(attn.k_proj, kv)
        attn.v_proj = take_rows(attn.v_proj, kv)
    if "gate_proj" in attn:  # our gated attention's gate rows, per query head
        attn.gate_proj = take_rows(attn.gate_proj, q)
    out = "o_proj" if "o_proj" in attn else "out_proj"
    label = f"{where} {out}".strip()
    setattr(attn, out, sum_columns(attn[out], q[0], group, label))
    if "sinks" in attn:  # one per query head (gpt-oss)
        attn.sinks = copy_rows(attn.sinks, [(mine.q0, mine.q1)])
    setattr(attn, counts[0], mine.n_heads)
    setattr(attn, counts[1], mine.n_kv_heads)
    return mine


def shard_mlp(
    mlp: nn.Module, group, where: str = "", summed: bool = True
) -> Tuple[int, int]:
    """Split a GLU feed-forward over `group`: gate and up rows and down's input
    columns, the same hidden columns on each (a quantized down_proj splits on
    its group boundaries only), down's output all-summed unless `summed` is
    False (its block sums it). Ours (gate_up_proj, optional gate_up_bias),
    OpenELM's (proj_1 = gate|up, proj_2) and mlx-lm's (gate/up/down_proj, and
    LFM2's w1/w3/w2)."""
    if "proj_1" in mlp:
        fused, down = "proj_1", "proj_2"
    elif "w1" in mlp:  # mlx-lm's LFM2: w1 gate, w3 up, w2 down
        fused, down = None, "w2"
    else:
        fused = "gate_up_proj" if "gate_up_proj" in mlp else None
        down = "down_proj"
    hidden = input_width(mlp[down])
    label = f"{where} {down}".strip()
    a, b = split_ffn(hidden, column_unit(mlp[down]), group.size(), label)[group.rank()]
    if fused:  # rows [gate | up]
        rows = [(a, b), (hidden + a, hidden + b)]
        setattr(mlp, fused, take_rows(mlp[fused], rows))
        if "gate_up_bias" in mlp:
            mlp.gate_up_bias = copy_rows(mlp.gate_up_bias, rows)
    else:
        names = ("w1", "w3") if down == "w2" else ("gate_proj", "up_proj")
        for name in (n for n in names if n in mlp):  # a ReLU² MLP: up alone
            setattr(mlp, name, take_rows(mlp[name], [(a, b)]))
    cut = sum_columns if summed else take_columns
    setattr(mlp, down, cut(mlp[down], (a, b), group, label))
    return a, b


def shard_experts(moe_module: nn.Module, moe, group, where: str = "") -> None:
    """Split a mixture-of-experts feed-forward (`moe`: its `arch.MoE`) over
    `group`: each expert's gate and up rows and down's input columns, the same
    hidden columns of every expert on a rank (a quantized down on its group
    boundaries); the router stays whole on every rank, so every rank routes
    each token alike, and the block all-sums its output (its `sharding_group`,
    as mlx-lm's Qwen3-MoE). Ours (gate|up fused) and mlx-lm's (split) alike."""
    experts = moe_module[moe.experts.rpartition(".")[2]]
    down = experts[moe.down]
    cols = down.weight.shape[-1]
    if "scales" in down:
        cols = cols * 32 // down.bits
    unit = down.group_size if "scales" in down else 1
    label = f"{where} experts' {moe.down}".strip()
    a, b = split_ffn(cols, unit, group.size(), label)[group.rank()]
    keys = ("weight", "scales", "biases", "bias")
    fused = moe.fused in experts
    for name in (moe.fused,) if fused else moe.fed:
        lin = experts[name]
        rows = [(a, b), (cols + a, cols + b)] if fused else [(a, b)]
        for key in keys:
            if key in lin and lin[key] is not None:
                lin[key] = (
                    copy_rows(lin[key], rows, -1)
                    if key == "bias"
                    else copy_expert_rows(lin[key], rows)
                )
    if "scales" in down:
        gs, bits = down.group_size, down.bits
        if a % gs or b % gs or (a * bits) % 32:
            raise ShardError(
                f"cannot shard {label} over {group.size()} ranks: columns {a}-{b} "
                f"do not fall on its quantization groups of {gs}"
            )
        down.weight = copy_rows(down.weight, [(a * bits // 32, b * bits // 32)], -1)
        for key in ("scales", "biases"):
            if key in down and down[key] is not None:
                down[key] = copy_rows(down[key], [(a // gs, b // gs)], -1)
    else:
        down.weight = copy_rows(down.weight, [(a, b)], -1)
    if "gate_up_bias" in experts:  # ours, added after the deferred scale
        experts.gate_up_bias = copy_rows(
            experts.gate_up_bias, [(a, b), (cols + a, cols + b)], -1
        )
    if "bias" in down and group.rank():  # added once, after the all-sum
        down.bias = mx.zeros_like(down.bias)
    if moe.shared:  # a shared expert's hidden columns, summed with the experts'
        name = moe.shared[0].rpartition(".")[0].rpartition(".")[2]
        summed = not hasattr(moe_module, "sharding_group")  # else the block sums
        shard_mlp(moe_module[name], group, f"{where} {name}".strip(), summed=summed)
    if hasattr(moe_module, "sharding_group"):  # ours, mlx-lm's Qwen3-MoE: it sums
        moe_module.sharding_group = group
    else:  # mlx-lm's Mixtral: each expert's output summed before the weighting
        name = moe.experts.rpartition(".")[2]
        setattr(moe_module, name, _SummedExperts(experts, group))


class _SummedExperts(nn.Module):
    """A rank's share of the experts (B, L, k, D), all-summed over the group:
    the weighted sum of the k experts after it is linear, so exact."""

    def __init__(self, experts: nn.Module, group):
        super().__init__()
        self.experts = experts
        self.group = group

    def __call__(self, *args, **kwargs):
        y = self.experts(*args, **kwargs)
        return mx.distributed.all_sum(y, group=self.group)


def shard_deltanet(net: nn.Module, group, where: str = "") -> None:
    """Split a gated DeltaNet (Qwen3.5's) over `group` by runs of key heads,
    each with the value heads that read them (value head j reads key head
    j // (value heads / key heads)): the rows of q, k, v, z, b and a (ours
    fused as `in_proj`, mlx-lm's Qwen3.5 four linears, its Qwen3-Next two,
    whose rows run per key head), the convolution's channels,
    dt_bias and A_log, and out_proj's input columns, all-summed."""
    nk, nv = net.num_k_heads, net.num_v_heads
    dk, dv, r = net.head_k_dim, net.head_v_dim, nv // nk
    if nk < group.size():
        raise ShardError(
            f"cannot shard {where} over {group.size()} ranks: {nk} key heads, and "
            f"each rank needs at least one; launch at most {nk} ranks"
        )
    k0, k1 = runs(nk, group.size())[group.rank()]
    qk = [(k0 * dk, k1 * dk), (nk * dk + k0 * dk, nk * dk + k1 * dk)]
    vals = (k0 * r * dv, k1 * r * dv)
    heads = (k0 * r, k1 * r)
    conv = qk + [(2 * nk * dk + vals[0], 2 * nk * dk + vals[1])]
    if "in_proj" in net:  # ours: rows qkv | z | b | a
        at = [net.conv_dim, net.conv_dim + net.value_dim]
        at.append(at[1] + nv)
        rows = conv + [(at[0] + vals[0], at[0] + vals[1])]
        rows += [(o + heads[0], o + heads[1]) for o in at[1:]]
        net.in_proj = take_rows(net.in_proj, rows)
    elif "in_proj_qkvz" in net:  # mlx-lm's Qwen3-Next: rows per key head
        per = 2 * dk + 2 * r * dv
        net.in_proj_qkvz = take_rows(net.in_proj_qkvz, [(k0 * per, k1 * per)])
        net.in_proj_ba = take_rows(net.in_proj_ba, [(k0 * 2 * r, k1 * 2 * r)])
    else:
        net.in_proj_qkv = take_rows(net.in_proj_qkv, conv)
        net.in_proj_z = take_rows(net.in_proj_z, [vals])
        net.in_proj_b = take_rows(net.in_proj_b, [heads])
        net.in_proj_a = take_rows(net.in_proj_a, [heads])
    net.conv1d.weight = copy_rows(net.conv1d.weight, conv)
    net.dt_bias, net.A_log = (copy_rows(a, [heads]) for a in (net.dt_bias, net.A_log))
    net.out_proj = sum_columns(net.out_proj, vals, group, f"{where} out_proj".strip())
    net.num_k_heads, net.num_v_heads = k1 - k0, (k1 - k0) * r
    net.key_dim, net.value_dim = (k1 - k0) * dk, (k1 - k0) * r * dv
    net.conv_dim = net.conv1d.groups = 2 * net.key_dim + net.value_dim
    if hasattr(net, "splits"):  # ours: where in_proj's rows part
        net.splits = [net.conv_dim, net.conv_dim + net.value_dim]
        net.splits.append(net.splits[1] + net.num_v_heads)


def shard_short_conv(conv: nn.Module, group, where: str = "") -> None:
    """Split a short gated convolution (LFM2's) over `group` by channels: the
    B, C and x rows of in_proj (with ours `in_bias`), the depthwise Conv1d's
    channels (each reads its own), out_proj's input columns, all-summed (a
    quantized out_proj on its group boundaries)."""
    D = conv.conv.weight.shape[0]
    label = f"{where} conv out_proj".strip()
    unit = column_unit(conv.out_proj)
    a, b = split_ffn(D, unit, group.size(), label)[group.rank()]
    rows = [(a, b), (D + a, D + b), (2 * D + a, 2 * D + b)]
    conv.in_proj = take_rows(conv.in_proj, rows)
    if "in_bias" in conv:
        conv.in_bias = copy_rows(conv.in_bias, rows)
    conv.conv = take_rows(conv.conv, [(a, b)])
    conv.conv.groups = b - a
    conv.out_proj = sum_columns(conv.out_proj, (a, b), group, label)
    if hasattr(conv, "args"):  # mlx-lm's: its first state is args.hidden_size wide
        conv.args = copy.copy(conv.args)
        conv.args.hidden_size = b - a


def _mixer(layer: nn.Module, arch):
    """(module, kind) of the token mixer `layer` holds, by `arch`'s contract."""
    for m in arch.mixers:
        if m.module in layer:
            return layer[m.module], m.kind
    return layer[arch.attention], "attention"


def shard_layers(layers: List[nn.Module], group, arch=None) -> None:
    """Every block's mixer (attention or, in a hybrid family, whichever
    `arch.mixers` it holds) and feed-forward, each layer by its own head
    counts (OpenELM's vary); embedding, head and residual stay whole. `arch`
    (models/arch.py) names the modules, its `moe` the layers with experts;
    without it (mlx-lm's classes) they are found under Llama's or OpenELM's names."""
    moe = arch.moe if arch is not None else None
    at, _, router = moe.router.rpartition(".") if moe else ("", "", "")
    for i, layer in enumerate(layers):
        if arch is not None:
            attn, kind = _mixer(layer, arch)
        else:
            attn = layer["self_attn"] if "self_attn" in layer else layer["attn"]
            kind = "attention"
        if kind == "gated_deltanet":
            shard_deltanet(attn, group, f"layer {i}")
        elif kind == "short_conv":
            shard_short_conv(attn, group, f"layer {i}")
        else:
            shard_attention(attn, group, f"layer {i}")
        if at in layer and router in layer[at]:  # this layer's experts
            shard_experts(layer[at], moe, group, f"layer {i}")
        elif arch is not None:
            shard_mlp(layer[arch.feed_forward], group, f"layer {i}")
        else:
            shard_mlp(
                layer["mlp"] if "mlp" in layer else layer["ffn"], group, f"layer {i}"
            )


# Where our model classes live (models/): those shard themselves.
_OUR_MODELS = __package__.rpartition(".")[0] + ".models."


def shard_model(
    model: nn.Module, group, name: str = "the model", own: bool = False, arch=None
) -> None:
    """Split `model` over `group` in place: ours by its own `shard`, mlx-lm's
    (stock, nonorm) by `shard_layers` (`arch`: the family's contract, experts
    too), as mlx-lm's own needs head counts that divide; `own` (mlx-lm's class
    of an uncovered family): by its own `shard`. ShardError (one line) else."""
    size = group.size()
    ours = type(model).__module__.startswith(_OUR_MODELS)
    try:
        if own:
            if not hasattr(model, "shard"):
                raise ShardError(
                    f"{name}: mlx-lm's {type(model).__module__} class has no "
                    "tensor-parallel shard; run it in one process"
                )
            model.shard(group)
        elif ours and hasattr(model, "shard"):
            model.shard(group)
        elif hasattr(model, "layers") and not ours:  # the family's split, if its own
            split = getattr(arch, "shard_layers", None) or shard_layers
            split(model.layers, group, arch)
        else:
            raise ShardError(
                f"{name}: {type(model).__module__}.{type(model).__name__} has no "
                "tensor-parallel shard; run it in one process"
            )
    except (ValueError, AssertionError) as e:  # mlx's and mlx-lm's own checks
        raise ShardError(f"cannot shard {name} over {size} ranks: {e}") from None
