"""The paper's speed bound: stock mlx-lm with every RMSNorm removed.

Each RMSNorm  y = x * rsqrt(mean(x^2) + eps) * g  becomes the fixed map
y = x * c  with  c = g / r,  r twice the norm's largest input RMS over token
positions, measured once in float32 over a few random tokens, in order, each
norm seeing the activations of the norms before it already made constant
(`measure_rms`). c is folded into the weights the norm feeds (a pure dict
transform), and the norm modules become nn.Identity: zero norm ops, while
activations stay finite (naive removal overflows to inf/NaN, and NaN arithmetic
runs ~20x slower on CPUs).

Where c goes, per norm (architecture-generic: a walk over the RMSNorm modules):
- a norm in `fold.norm_pairs`: input columns of the linears it feeds;
- the final norm before a tied head: the head is untied (lm_head = embedding * c),
  which costs storage, not decode bandwidth;
- a per-head QK-norm (OpenELM q_norm/k_norm): the q or k output rows of qkv_proj;
- a post-norm (Gemma's, on a sublayer's output before the residual add): the
  output rows of the linear before it (`Architecture.post_norms`).
The gain is the architecture's (`Architecture.gain`: Gemma's 1 + w).
Not the same function as stock (only a bound on its speed).
"""

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from .. import fold, models, quant
from ..errors import LoadError

CALIBRATION_TOKENS = 32
CALIBRATION_SEED = 1234
# r = margin x the largest RMS seen, not the mean: without norms a GLU FFN is
# quadratic in its input's scale, so a token at rho x r grows like rho^(2^layers)
# and overflows when rho > 1 (seen on SmolLM2's 30 layers), while rho < 1 only
# shrinks each block's contribution and the residual stays at embedding scale.
CALIBRATION_MARGIN = 2.0
MARKER = "nonorm"


@dataclass(frozen=True)
class NormSite:
    """One norm and where its calibration constant c (its width) is folded."""

    norm: str  # module path = weight prefix, e.g. "model.layers.0.input_layernorm"
    into: Tuple[str, ...]  # linears that take c on their input columns (or rows)
    rows: Optional[Tuple[int, int]] = None  # QK-norm: rows [a, b) of into[0], per head
    untie: bool = False  # final norm of a tied head: make lm_head = embedding first


# --- walking the modules -----------------------------------------------------


def is_rms_norm(module) -> bool:
    """nn.RMSNorm or a model file's own RMSNorm class."""
    return isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")


def rms_norm_paths(model: nn.Module) -> List[str]:
    return [name for name, m in model.named_modules() if name and is_rms_norm(m)]


def _set_modules(model: nn.Module, new: Dict[str, nn.Module]) -> None:
    """Replace the modules at these dotted paths (mlx's own update_modules)."""
    model.update_modules(tree_unflatten(list(new.items())))


def strip_norms(model: nn.Module) -> List[str]:
    """Replace every RMSNorm module with nn.Identity; returns their paths."""
    paths = rms_norm_paths(model)
    _set_modules(model, {p: nn.Identity() for p in paths})
    return paths


# --- calibration -------------------------------------------------------------


class _ConstantNorm(nn.Module):
    """Calibration stand-in for one norm: measures r, then applies y = x * g / r.

    r is CALIBRATION_MARGIN x the largest input RMS over token positions (and heads,
    for a QK-norm). Norms run in order, so each one measures the input that the norms
    before it, already constant, produce: the nonorm model's own activations,
    not stock's, which keeps deep layers at stock's scale instead of drifting.
    """

    def __init__(self, norm: nn.Module, path: str, rms: dict, arch):
        super().__init__()
        self.norm = norm
        self._path, self._rms, self._arch = path, rms, arch

    def __call__(self, x):
        if self._path not in self._rms:  # a norm called twice keeps its first r
            ms = mx.mean(mx.square(x.astype(mx.float32)), axis=-1)
            rms = mx.sqrt(ms + getattr(self.norm, "eps", 0.0))
            self._rms[self._path] = CALIBRATION_MARGIN * mx.max(rms)
        gain = self._arch.gain(self.norm["weight"]) if "weight" in self.norm else 1.0
        return (x * (gain / self._rms[self._path])).astype(x.dtype)


def measure_rms(
    model: nn.Module,
    config: dict,
    n_tokens: int = CALIBRATION_TOKENS,
    seed: int = CALIBRATION_SEED,
) -> Dict[str, float]:
    """{norm path: typical input RMS r}, from one forward pass over random tokens
    with every norm already replaced by its constant x * g / r (see _ConstantNorm).
    """
    paths = rms_norm_paths(model)
    modules = dict(model.named_modules())
    originals = {p: modules[p] for p in paths}
    rms: Dict[str, mx.array] = {}
    arch = models.architecture(config)
    consts = {p: _ConstantNorm(n, p, rms, arch) for p, n in originals.items()}
    _set_modules(model, consts)
    try:
        vocab_size = config["vocab_size"]
        tokens = np.random.default_rng(seed).integers(0, vocab_size, (1, n_tokens))
        mx.eval(model(mx.array(tokens)), rms)
    finally:
        _set_modules(model, originals)
    missing = [p for p in paths if p not in rms]
    if missing:
        raise fold.FoldError(f"nonorm: calibration never reached {missing[0]}")
    return {p: v.item() for p, v in rms.items()}


# --- where each norm's constant goes -----------------------------------------


def norm_sites(model: nn.Module, config: dict, weights: fold.Weights) -> List[NormSite]:
    """A NormSite for every RMSNorm module of the stock `model` (else FoldError)."""
    arch = models.architecture(config)
    pairs = dict(arch.norm_pairs(config, weights))
    posts = arch.post_norm_paths(config)
    modules = dict(model.named_modules())
    sites = []
    for path in rms_norm_paths(model):
        parent_path, _, name = path.rpartition(".")
        parent = modules[parent_path] if parent_path else model
        if path in pairs:
            sites.append(NormSite(path, tuple(pairs[path])))
        elif path in posts:  # rows of the linear whose output it normalizes
            rows = (0, weights[f"{posts[path]}.weight"].shape[-2])
            sites.append(NormSite(path, (posts[path],), rows=rows))
        elif path == arch.final_norm:
            sites.append(NormSite(path, (arch.head,), untie=True))
        elif name in ("q_norm", "k_norm") and "qkv_proj" in parent:
            # qkv_proj rows: [q heads | k heads | v heads], head_dim rows each.
            n_q, n_kv, h = parent.n_heads, parent.n_kv_heads, parent.head_dim
            rows = (0, n_q * h) if name == "q_norm" else (n_q * h, (n_q + n_kv) * h)
            sites.append(NormSite(path, (f"{parent_path}.qkv_proj",), rows=rows))
        elif name in ("q_norm", "k_norm") and f"{name[0]}_proj" in parent:
            # Separate q_proj / k_proj (Qwen3): all their rows, head by head.
            proj = f"{parent_path}.{name[0]}_proj"
            rows = (0, weights[f"{proj}.weight"].shape[0])
            sites.append(NormSite(path, (proj,), rows=rows))
        else:
            raise fold.FoldError(f"nonorm: no place to fold the constant of {path}")
    return sites


def fold_constants(
    weights: fold.Weights, config: dict, sites: List[NormSite], rms: Dict[str, float]
) -> Tuple[fold.Weights, dict]:
    """Fold c = gain / rms of every site into the weights it feeds; drop the gains.

    Pure: new dicts are returned. Weights must be float (dequantize first).
    """
    arch = models.architecture(config)
    weights, config = dict(weights), copy.deepcopy(config)
    for site in sites:
        gain = weights.pop(f"{site.norm}.weight")
        c = arch.gain(gain).astype(mx.float32) / rms[site.norm]  # (width,)
        if site.untie:
            if f"{arch.embed}.scales" in weights:
                raise fold.FoldError("nonorm: cannot untie a quantized embedding")
            weights[f"{arch.head}.weight"] = weights[f"{arch.embed}.weight"]
            config[arch.tie_key] = False
        for linear in site.into:
            if site.rows is None:
                weights = fold.fold_into(weights, c, linear, arch)
            else:
                weights = _fold_rows(weights, c, linear, *site.rows)
    config[MARKER] = {"calibrated_norms": len(sites)}
    return weights, config


def _fold_rows(weights: fold.Weights, c: mx.array, linear: str, a: int, b: int):
    """Scale output rows [a, b) of `linear` (heads of width len(c)) by c, per head;
    stacked experts' (E, out, in) rows of every expert."""
    out = dict(weights)
    experts = weights[linear + ".weight"].ndim == 3
    for suffix in (".weight", ".bias"):
        w = weights.get(linear + suffix)
        if w is None:
            continue
        if experts:  # rows on axis 1 of the weight (E, out, in) and bias (E, out)
            part = w[:, a:b].astype(mx.float32)
            c_rows = mx.tile(c, (part.shape[1] // c.shape[0],))
            part = part * c_rows.reshape(1, -1, *[1] * (w.ndim - 2))
            out[linear + suffix] = mx.concatenate(
                [w[:, :a], part.astype(w.dtype), w[:, b:]], axis=1
            )
            continue
        part = w[a:b].astype(mx.float32)
        shape = part.shape
        part = part.reshape(-1, c.shape[0], *shape[1:]) * c.reshape(
            1, -1, *[1] * (len(shape) - 1)
        )
        out[linear + suffix] = mx.concatenate(
            [w[:a], part.reshape(shape).astype(w.dtype), w[b:]], axis=0
        )
    return out


# --- building ----------------------------------------------------------------


def _stock_sanitized(config: dict, weights: fold.Weights) -> fold.Weights:
    """`weights` as a fresh stock instance's `sanitize` leaves them: a model's
    sanitize may change the model too (Gemma's pops its head once), so the
    calibration model's own is not called twice."""
    model_cls, args_cls = models.model_classes(config, ours=False)
    model = model_cls(args_cls.from_dict(config))
    return model.sanitize(weights) if hasattr(model, "sanitize") else weights


def build_nonorm(plan: "quant.WeightPlan") -> Tuple[nn.Module, dict]:
    """Stock mlx-lm class, norms removed, constants folded; returns (model, config).

    Same weights as every variant (`quant.plan_weights`): float32 for the
    calibration and the fold, then quantized as the plan says.
    """
    weights, config, qspec = plan.weights, plan.config, plan.qspec
    if plan.as_stored:
        # nonorm changes weights: dequantize, fold, quantize again as stored.
        qspec = quant.source_qspec(weights, config)
        weights, config = quant.dequantize_weights(weights, config, mx.float32)
    if fold.is_folded(config):
        # A folded checkpoint with unit gains is the same function as the original.
        weights = fold.restore_unit_norms(weights, config)
    weights = fold.map_floats(weights, lambda v: v.astype(mx.float32))

    # Calibrate in float32 on mlx-lm's class (and its sanitize).
    calib = models.instantiate(config, weights, ours=False)
    weights = _stock_sanitized(config, weights)
    rms = measure_rms(calib, config)
    sites = norm_sites(calib, config, weights)
    del calib
    weights, config = fold_constants(weights, config, sites, rms)

    arch = models.architecture(config)
    embed, head = arch.embed, arch.head
    if qspec and embed in qspec and head not in qspec and f"{head}.weight" in weights:
        qspec[head] = qspec[embed]  # an untied head takes its embedding's settings

    weights = fold.map_floats(weights, lambda v: v.astype(plan.dtype))
    if qspec:  # as loading and convert quantize (recipe.py)
        weights = quant.quantize_weights(weights, qspec)
        config = quant.with_quantization(config, qspec)
    model_cls, args_cls = models.model_classes(config, ours=False)
    model = model_cls(args_cls.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    stripped = strip_norms(model)
    if set(stripped) != {s.norm for s in sites}:
        raise fold.FoldError(
            "nonorm: the norm modules changed between calibration and build"
        )
    models.quantize_like(model, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise LoadError(f"nonorm: weights do not match the model: {e}") from None
    mx.eval(model.parameters())
    return model, config
