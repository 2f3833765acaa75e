"""Fold-aware quantization: GPTQ on the folded weights, weighted by real activations.

Why: folding a gain vector into a weight (W* = W diag(g)) spreads each
quantization group's range when the gains differ within the group, so plain
round-to-nearest (RTN) gives every column of a group the error of its largest
gain: on the embedded SmolLM2, RTN 4-bit FlashNorm was +12.7% (group 32) and
+36.7% (group 64) perplexity over stock's own RTN.

What: GPTQ (Frantar et al. 2022) quantizes one input column at a time and
spreads each column's rounding error over the columns not yet quantized, so
as to minimize ||(W* - Q) x||^2 over calibration inputs x. The x that matters
is what the folded weight really multiplies: a norm-fed linear sees the
residual over its RMS, without the gain (x = x_stock / g, x_stock being what
stock mlx-lm's linear sees), so its Hessian is D^-1 H_stock D^-1, D = diag(g).
o_proj and down_proj see stock's inputs up to a per-token factor that FlashNorm
applies after them, so their error reaches the model as stock's would: H_stock.
The Hessians come from stock mlx-lm's float32 model on calibration text that the
perplexity evaluation never scores (`texts.calibration_text`).

Same storage as RTN: MLX's affine format, the same bits and group size, so the
same bits per weight, and a `--compat` checkpoint still loads in stock mlx-lm.
The embedding (and a tied head) stays RTN, as stock's.
"""

from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.quant.gptq import Catcher
from mlx_lm.quant.gptq import quantize as pack

from .. import fold, models
from ..errors import LoadError
from ..texts import calibration_text

METHODS = ("auto", "gptq", "rtn")
# auto: GPTQ where a GPU runs it, round-to-nearest on the CPU, where GPTQ's
# column loop takes minutes (310 s against RTN's 9 s on SmolLM2-135M, 2 cores).
DEFAULT_METHOD = "auto"
DAMPING = 0.01  # of the mean Hessian diagonal, as GPTQ and mlx-lm use
PACKED_BITS = (2, 4, 8)  # what mlx-lm's GPTQ packer writes


def resolve(method: str) -> str:
    """ "gptq" or "rtn": `method`, with "auto" made the one that finishes in
    seconds on the default device."""
    if method != "auto":
        return method
    return "rtn" if mx.default_device() == mx.cpu else "gptq"


def auto_note(method: str, quantizes: bool) -> Optional[str]:
    """The one line where "auto" chose round-to-nearest on the CPU (None else)."""
    if method != "auto" or not quantizes or resolve(method) != "rtn":
        return None
    return AUTO_RTN_NOTE


# The figure: perplexity on the embedded SmolLM2-135M, -q 4-bit group 64, 8
# windows of 128 tokens, against stock's RTN (29.8): FlashNorm by GPTQ 33.3, by
# RTN 43.1 (flashnorm-mlx perplexity -q --q-method gptq|rtn, 2-core CPU).
AUTO_RTN_NOTE = (
    "quantizing by round-to-nearest, seconds on the CPU; --q-method gptq "
    "calibrates fold-aware GPTQ instead, minutes on a CPU: on the embedded "
    "SmolLM2 at 4-bit it kept perplexity within 12% of stock's where RTN "
    "lost 45%"
)


def check_qspec(qspec: dict) -> None:
    """LoadError, before any work, for bit widths the GPTQ packer cannot write."""
    bad = sorted({v["bits"] for v in qspec.values()} - set(PACKED_BITS))
    if bad:
        raise LoadError(
            f"--q-method gptq writes {', '.join(map(str, PACKED_BITS))}-bit weights, "
            f"not {', '.join(map(str, bad))}-bit: pass --q-method rtn, or "
            "--q-bits 2, 4 or 8"
        )


Hessians = Dict[str, mx.array]


class ExpertCatcher(nn.Module):
    """Each expert's own Hessian (experts, in, in) of a stacked-experts linear
    (mlx-lm's SwitchLinear), from the rows routed to that expert alone
    (mlx-lm's GPTQ pools every expert's rows into one)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        n, _, d = module.weight.shape
        self.H = mx.zeros((n, d, d))

    def __call__(self, x, indices, *args, **kwargs):
        # x (..., 1, d) per token or per (token, expert); indices the experts.
        rows = mx.broadcast_to(x.squeeze(-2), (*indices.shape, x.shape[-1]))
        rows, idx = rows.reshape(-1, x.shape[-1]), np.array(indices).reshape(-1)
        order = np.argsort(idx, kind="stable")
        bounds = np.searchsorted(idx[order], np.arange(self.H.shape[0] + 1))
        parts = []
        for e in range(self.H.shape[0]):
            sel = rows[mx.array(order[bounds[e] : bounds[e + 1]])]
            parts.append(sel.T @ sel if sel.shape[0] else mx.zeros(self.H.shape[1:]))
        self.H = self.H + mx.stack(parts)
        return self.module(x, indices, *args, **kwargs)


@dataclass(frozen=True)
class Calibration:
    """Which text windows calibrate: `num_seqs` windows of `seq_len` tokens,
    drawn with `seed` from `texts.calibration_text()`."""

    num_seqs: int = 16
    seq_len: int = 128
    seed: int = 0

    def describe(self) -> dict:
        return {**asdict(self), "text": "pydoc topics, odd-numbered (never scored)"}


def calibration_data(tokenizer, calib: Calibration) -> mx.array:
    """(num_seqs, seq_len) token windows, deterministic for a seed."""
    tokens = np.asarray(tokenizer.encode(calibration_text()), dtype=np.int32)
    slots = len(tokens) // calib.seq_len
    rng = np.random.default_rng(calib.seed)
    starts = rng.choice(slots, size=min(calib.num_seqs, slots), replace=False)
    rows = [tokens[s * calib.seq_len : (s + 1) * calib.seq_len] for s in sorted(starts)]
    return mx.array(np.stack(rows))


def hessians(
    weights: fold.Weights,
    config: dict,
    data: mx.array,
    batch_size: int = 4,
    advance: Optional[Callable[[int], None]] = None,
) -> Hessians:
    """{linear (Hugging Face name): H} in the folded weights' basis, from stock
    mlx-lm's float32 model over `data` (float, unfolded `weights`)."""
    weights = fold.map_floats(weights, lambda v: v.astype(mx.float32))
    model = models.instantiate(config, weights, ours=False)
    catchers = [
        (name, Catcher(m) if type(m) is nn.Linear else ExpertCatcher(m))
        for name, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
        if type(m) in (nn.Linear, SwitchLinear)
    ]
    model.update_modules(tree_unflatten(catchers))
    for s in range(0, data.shape[0], batch_size):
        model(data[s : s + batch_size])
        mx.eval([c.H for _, c in catchers])
        if advance:
            advance(min(batch_size, data.shape[0] - s))
    out = {name: c.H for name, c in catchers}
    arch = models.architecture(config)
    for norm, linears in fold.norm_pairs(config, weights):
        gain = arch.folded_gain(config, norm, weights[f"{norm}.weight"])
        inv = 1.0 / gain.astype(mx.float32)
        # A linear stock holds as no Linear (GLM's router) has none: kept float.
        for linear in (lin for lin in linears if lin in out):
            out[linear] = out[linear] * inv[:, None] * inv[None, :]
    return out


def inverse_cholesky(H: mx.array) -> mx.array:
    """Upper Cholesky factor of H^-1 (damped), as GPTQ uses it; in float64 with
    numpy's LAPACK (MLX's CPU linalg took seconds for a 1536-wide H here).
    Stacked experts' (experts, in, in): each expert's own."""
    if H.ndim == 3:
        return mx.stack([inverse_cholesky(h) for h in H])
    h = np.array(H, dtype=np.float64)
    # Damped, and never singular (a linear that calibration never reached).
    h[np.diag_indices_from(h)] += max(DAMPING * np.mean(np.diag(h)), 1e-6)
    inv = np.linalg.inv(h)
    return mx.array(np.linalg.cholesky(inv).T.astype(np.float32))


def quantize_weight(
    w: mx.array,
    H: Optional[mx.array],
    bits: int,
    group_size: int,
    dtype: mx.Dtype,
    hinv: Optional[mx.array] = None,
) -> Dict[str, mx.array]:
    """GPTQ of one (out, in) weight: {"weight" (packed), "scales", "biases"};
    of stacked experts' (experts, out, in), each expert on its own Hessian.

    Scales and biases are rounded to `dtype` (what the checkpoint stores) before
    the columns are quantized against them. Rows are independent, so any row
    range of a weight gives the same rows as the whole (`hinv`: the
    `inverse_cholesky(H)` of an earlier range, to reuse).
    """
    Hinv = inverse_cholesky(H) if hinv is None else hinv
    if w.ndim == 3:
        each = [
            quantize_weight(w[e], None, bits, group_size, dtype, Hinv[e])
            for e in range(w.shape[0])
        ]
        return {k: mx.stack([q[k] for q in each]) for k in each[0]}
    W = w.astype(mx.float32)
    n_bins = 2**bits - 1
    all_scales, all_biases = [], []
    for i in range(0, W.shape[1], group_size):
        j = i + group_size
        _, scales, biases = mx.quantize(W[:, i:j], group_size=group_size, bits=bits)
        scales = scales.astype(dtype).astype(mx.float32)
        biases = biases.astype(dtype).astype(mx.float32)
        group, errors = W[:, i:j], []
        for k in range(group_size):
            col = group[:, k : k + 1]
            q = mx.clip(mx.round((col - biases) / scales), 0, n_bins) * scales + biases
            err = (col - q) / Hinv[i + k, i + k]
            # Hinv is upper triangular: columns before k are left as they are.
            group = group - err @ Hinv[i + k : i + k + 1, i:j]
            errors.append(err)
        W[:, i:j] = group
        W[:, j:] = W[:, j:] - mx.concatenate(errors, axis=1) @ Hinv[i:j, j:]
        mx.eval(W)
        all_scales.append(scales)
        all_biases.append(biases)
    scales = mx.concatenate(all_scales, axis=1)
    biases = mx.concatenate(all_biases, axis=1)
    return {
        "weight": pack(W, bits, scales, biases),
        "scales": scales.astype(dtype),
        "biases": biases.astype(dtype),
    }
