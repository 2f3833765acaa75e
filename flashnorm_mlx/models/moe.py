"""The FlashNorm mixture-of-experts feed-forward (docs/design.md section 2j).

The norm feeds the router and every expert; its gain is folded into the
router's weight and each expert's gate and up (3-D, expert-major, along the
input axis), and its 1/RMS s (one scalar per token) is deferred:
    router logits = s * (xs @ Wr*)          (before softmax and top-k)
    expert e: down_e(silu(s * gate_e) * up_e) * s
The second s is shared by the k experts a token picks, so it rides past down
and the weighted sum to the block's `residual` (h + s * y), as in the dense
GLU. The experts are mlx-lm's `SwitchLinear` (gather_mm, or gather_qmm when
quantized), gate|up stacked into one (experts, 2F, D) weight; the GLU is the
dense layers' `kernels.deferred_glu`, one row per (token, expert) pair.
"""

from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear, _gather_sort, _scatter_unsort

from .. import kernels
from .decoder import MLP, fuse


class SwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU with gate|up in one gather matmul and the deferred
    scale applied in the GLU kernel: (xs, ms, indices) -> (B, L, k, D), which
    owes the factor s = deferred_scale(ms) of each token."""

    def __init__(self, dims: int, hidden: int, num_experts: int, activation="silu"):
        super().__init__()
        self.activation = activation  # the GLU's gate activation (Gemma 4: gelu_tanh)
        self.gate_up_proj = SwitchLinear(dims, 2 * hidden, num_experts, bias=False)
        self.down_proj = SwitchLinear(hidden, dims, num_experts, bias=False)

    def __call__(self, xs, ms, indices):
        # xs (B, L, D), ms (B, L, 1), indices (B, L, k).
        x = mx.expand_dims(xs, (-2, -3))  # (B, L, 1, 1, D)
        k = indices.shape[-1]
        do_sort = indices.size >= 64  # as mlx-lm: experts' rows in order
        idx, inv_order = indices, None
        if do_sort:  # one row per (token, expert) pair, sorted by expert
            flat = indices.flatten()
            order = mx.argsort(flat)
            inv_order = mx.argsort(order)
            x = x.flatten(0, -3)[order // k]  # (N, 1, D)
            idx = flat[order]
            ms_rows = ms.flatten()[order // k][:, None]  # (N, 1)
        else:
            ms_rows = mx.broadcast_to(ms[..., None, :], (*indices.shape, 1))
        gu = self.gate_up_proj(x, idx, sorted_indices=do_sort)  # (..., 1, 2F)
        y = self.down_proj(self.glu(gu, ms_rows, idx), idx, sorted_indices=do_sort)
        if do_sort:
            y = mx.unflatten(y[inv_order], 0, indices.shape)
        return y.squeeze(-2)

    def glu(self, gu, ms_rows, idx):
        """act(s * gate) * up of each (token, expert) row; up's s is owed."""
        n = ms_rows.size  # rows of (token, expert): the GLU kernel's (1, n, .) view
        act = kernels.deferred_glu(
            gu.reshape(1, n, gu.shape[-1]), ms_rows.reshape(1, n, 1), self.activation
        )
        return act.reshape(*gu.shape[:-1], gu.shape[-1] // 2)


class SwitchReLU2(nn.Module):
    """mlx-lm's SwitchMLP with relu² (Nemotron 3's experts: fc1, relu², fc2,
    no gate to carry a second s): given ms, s on each (token, expert) row of
    fc1's output before relu², in its launch (docs/design.md section 2p);
    without, stock's (experts reading a latent row that took s already)."""

    def __init__(self, dims: int, hidden: int, num_experts: int):
        super().__init__()
        self.fc1 = SwitchLinear(dims, hidden, num_experts, bias=False)
        self.fc2 = SwitchLinear(hidden, dims, num_experts, bias=False)

    def __call__(self, x, ms, indices):
        x = mx.expand_dims(x, (-2, -3))  # (B, L, 1, 1, D)
        do_sort = indices.size >= 64  # as mlx-lm: rows in expert order
        idx, inv_order = indices, None
        rows = None if ms is None else mx.expand_dims(ms, (-2, -3))
        if do_sort:
            x, idx, inv_order = _gather_sort(x, indices)
            if rows is not None:  # each row's token's ms, sorted alike
                rows = _gather_sort(rows, indices)[0]
        u = self.fc1(x, idx, sorted_indices=do_sort)
        u = nn.relu2(u) if rows is None else kernels.scaled(u, rows, relu2=True)
        y = self.fc2(u, idx, sorted_indices=do_sort)
        if do_sort:
            y = _scatter_unsort(y, inv_order, indices.shape)
        return y.squeeze(-2)


class SparseMoE(nn.Module):
    """Router, top-k, experts and the weighted sum, as mlx-lm's Qwen3-MoE block;
    called as the dense MLP is, (xs, ms) -> (y, ms): y owes s."""

    def __init__(self, dims: int, hidden: int, num_experts: int, top_k: int, norm_topk):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (
            num_experts,
            top_k,
            norm_topk,
        )
        self.gate = nn.Linear(dims, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(dims, hidden, num_experts)
        self.sharding_group: Optional[mx.distributed.Group] = None

    def route(self, xs, ms):
        """(indices, scores) (B, L, k): the top-k of softmax(s * logits)."""
        z = self.gate(xs)
        return self.pick((z * kernels.deferred_scale(ms, xs.dtype)).astype(z.dtype))

    def pick(self, z):
        """(indices, scores) of the router's logits z, s already on them."""
        gates = mx.softmax(z, axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores

    def __call__(self, xs, ms):
        inds, scores = self.route(xs, ms)
        y = self.switch_mlp(xs, ms, inds)
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        if self.sharding_group is not None:  # each rank's hidden columns summed
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y, ms


class SharedExpertMoE(SparseMoE):
    """Qwen3-Next's and Qwen3.5's block: SparseMoE's routed experts plus a
    shared expert, a dense GLU on the same s, times sigmoid(s * (xs @ w*)):
    s goes before that sigmoid, and the sum owes s (docs/design.md 2j). The
    router's rows and the shared gate's row are one matmul (`gate`, E + 1
    rows, stacked at load), so s is applied once to both."""

    def __init__(self, dims, hidden, num_experts, top_k, norm_topk, shared_hidden):
        super().__init__(dims, hidden, num_experts, top_k, norm_topk)
        self.gate = nn.Linear(dims, num_experts + 1, bias=False)
        self.shared_expert = MLP(
            SimpleNamespace(hidden_size=dims, intermediate_size=shared_hidden)
        )

    def __call__(self, xs, ms):
        z = kernels.scaled(self.gate(xs), ms)  # one launch for router and gate
        inds, scores = self.pick(z[..., :-1])
        y = self.switch_mlp(xs, ms, inds)
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        shared, _ = self.shared_expert(xs, ms)  # owes s too
        y = y + mx.sigmoid(z[..., -1:]) * shared
        if self.sharding_group is not None:  # each rank's hidden columns summed
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y, ms


class SoftmaxOfTopK(SparseMoE):
    """Mixtral's routing: the top-k logits, then their softmax (mlx-lm's
    MixtralSparseMoeBlock). Top-k of s * z is top-k of z (s > 0), so the picks
    are taken on z as stock takes them on its logits; s scales the k picked
    logits before their softmax."""

    def __init__(self, dims: int, hidden: int, num_experts: int, top_k: int):
        super().__init__(dims, hidden, num_experts, top_k, False)

    def route(self, xs, ms):
        z = self.gate(xs)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(-z, kth=k - 1, axis=-1)[..., :k])
        picked = mx.take_along_axis(z, inds, axis=-1)
        picked = (picked * kernels.deferred_scale(ms, xs.dtype)).astype(z.dtype)
        return inds, mx.softmax(picked, axis=-1, precise=True)


def fuse_experts(weights: dict, prefix: str, moe) -> dict:
    """The stacked experts' gate and up (`moe.fed`) -> one `moe.fused` weight,
    rows stacked per expert (axis -2; exact for quantized ones too: groups run
    along the input axis)."""
    parts = [f"{prefix}.{moe.experts}.{f}" for f in moe.fed]
    if f"{parts[0]}.weight" not in weights:
        return weights
    weights = dict(weights)
    fused = f"{prefix}.{moe.experts}.{moe.fused}"
    for suffix in ("weight", "scales", "biases", "bias"):
        tensors = [weights.pop(f"{p}.{suffix}", None) for p in parts]
        if all(t is not None for t in tensors):
            axis = -1 if suffix == "bias" else -2  # a bias is (experts, out)
            weights[f"{fused}.{suffix}"] = mx.concatenate(tensors, axis=axis)
    return weights


def fuse_experts_and_shared(weights: dict, prefix: str, moe) -> dict:
    """`fuse_experts`, then the shared expert's gate and up (`moe.shared`) ->
    one `moe.shared_fused` weight (its bias alike)."""
    weights = fuse_experts(weights, prefix, moe)
    shared = [f"{prefix}.{part}" for part in moe.shared]
    fused = f"{prefix}.{moe.shared_fused}"
    return fuse(weights, shared, fused, fused + "_bias")
