"""Weights that do not fit their config, told in the checkpoint's own words.

A build that fails on such weights fails deep inside: on FlashNorm's stacked
tensors (q|k|v, gate|up), on a fold's broadcast, or on a norm gain missing
from a layer the config adds. `mismatch` names instead the checkpoint's own
tensor and both shapes, measured against stock mlx-lm's model of the same
config (built lazily: no weight of it is ever computed). It is asked only
once a build has failed, so a good checkpoint never pays for it
(docs/design.md section 5a).
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx

from .. import fold, models, quant

Shapes = Dict[str, Tuple[Tuple[int, ...], mx.Dtype]]


def shapes_of(weights: dict) -> Shapes:
    """Each tensor's (shape, dtype): all `mismatch` needs, kept apart from the
    tensors, which a conversion frees as it goes."""
    return {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}


def config_name(source) -> str:
    """What the user calls the config: a folder's config.json, a GGUF's metadata."""
    return "config.json" if source.folder is not None else "the GGUF metadata"


def mismatch(shapes: Shapes, config: dict, where: str) -> Optional[str]:
    """The first way the checkpoint's tensors (`shapes`) do not fit `config`
    (`where` names it): a tensor of another shape, one missing, one left over;
    None where they fit, or where the config is beyond building a model of."""
    try:
        return _mismatch(shapes, config, where)
    except Exception:  # a config no model takes: the caller's own error stands
        return None


def _mismatch(shapes: Shapes, config: dict, where: str) -> Optional[str]:
    # Lazy placeholders: nothing is allocated, nothing is evaluated.
    weights = {k: mx.zeros(s, dtype=d) for k, (s, d) in shapes.items()}
    weights = fold.restore_unit_norms(weights, config)  # a folded checkpoint's
    model_cls, args_cls = models.model_classes(config, ours=False)
    model = model_cls(args_cls.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    have = {k: tuple(v.shape) for k, v in weights.items()}
    packed = {}  # a quantized weight's name -> its bits: compared unpacked
    unknown = set()  # quantized with bits the config does not give: not compared
    for key in [k for k in have if k.endswith(".scales")]:
        module = key[: -len(".scales")]
        if f"{module}.weight" not in have:
            continue
        q = quant.quant_params(config, module)
        if q is None:
            unknown.add(f"{module}.weight")
            have.pop(key)
            have.pop(f"{module}.biases", None)
            continue
        shape = have[f"{module}.weight"]
        have[f"{module}.weight"] = shape[:-1] + (shape[-1] * 32 // q["bits"],)
        packed[f"{module}.weight"] = q["bits"]
        have.pop(key)
        have.pop(f"{module}.biases", None)
    from mlx.utils import tree_flatten

    want = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    for name, shape in want.items():  # in the model's order: the first layer first
        if name in have and name not in unknown and have[name] != shape:
            how = f" ({packed[name]}-bit, unpacked)" if name in packed else ""
            return (
                f"tensor {name} has shape {list(have[name])}{how}, but {where} "
                f"makes it {list(shape)}"
            )
    missing = [k for k in want if k not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"no tensor {missing[0]}{more}, which {where} asks for"
    extra = [k for k in have if k not in want]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"tensor {extra[0]}{more} has no place in the model {where} describes"
    return None
