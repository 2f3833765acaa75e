"""Config values checked before a model is built from them.

A config.json (or a GGUF's metadata turned into one) is user input: a width,
layer count or RoPE table that does not make sense would fail deep inside MLX
or mlx-lm, or build a model of absurd size. Each value is checked against the
type mlx-lm's ModelArgs gives it and a range; a problem is one `LoadError` line
naming the file and the key. (checks.py checks the files' structure.)
"""

import dataclasses
import json
import math
import typing
from typing import Dict, List, Optional

from ..errors import LoadError
from ..limits import GROUP_SIZES, MLX_Q_MODE, WEIGHT_BITS, is_int, is_number

# --- config values -----------------------------------------------------------

# Integer fields that may be 0 (all others must be at least 1).
# Gemma 4: 0 KV-shared layers, 0 per-layer input width (none of either).
_NON_NEGATIVE = {
    "max_window_layers",
    "rope_max_length",
    "num_kv_shared_layers",
    "hidden_size_per_layer_input",
    # Granite 4's dense checkpoints (granitemoehybrid): 0 experts, 0 picked.
    "num_local_experts",
    "num_experts_per_tok",
}
# Per-layer lists of OpenELM and their element checks.
_LAYER_LISTS = {
    "num_query_heads": "positive integer",
    "num_kv_heads": "positive integer",
    "ffn_multipliers": "positive number",
}
MAX_LAYERS = 4096  # every module is built before a weight is read
MAX_WIDTH = 1 << 24  # larger widths only come from corrupt configs


def check_config(config, where: str, arg_classes, ranges: bool = True) -> None:
    """Check config values against the ModelArgs dataclasses that will take them
    (ours and stock mlx-lm's): required keys present, each value of the type its
    field declares, sizes positive and within bounds, head counts that divide.
    ranges=False (a family FlashNorm does not cover, whose fields may mean
    anything, e.g. a 0 or a negative bound): types alone. Raises LoadError
    naming `where` (the file) and the key."""
    if not isinstance(config, dict):
        raise LoadError(f"{where}: the config is not a JSON object")
    hints, required = {}, set()
    for cls in map(lambda c: _flat(c, config), arg_classes):
        hints.update(typing.get_type_hints(cls))
        required |= {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        }
    missing = sorted(k for k in required if k not in config)
    if missing:
        raise LoadError(f"{where}: {missing[0]} is missing (the model needs it)")
    for key, hint in hints.items():
        if key in config:
            check = _value_problem if ranges else _type_problem
            problem = check(key, config[key], hint)
            if problem:
                raise LoadError(f"{where}: {key} is {_show(config[key])}: {problem}")
    problem = _relations(config) if ranges else None
    if problem:
        raise LoadError(f"{where}: {problem}")
    _check_quantization(config.get("quantization"), where)
    marker = config.get("flashnorm")  # fold.MARKER, written by `convert`
    if marker is not None and not (
        isinstance(marker, dict)
        and all(isinstance(marker.get(k, False), bool) for k in _MARKER_FLAGS)
    ):
        raise LoadError(f"{where}: flashnorm is {_show(marker)}")


_MARKER_FLAGS = ("folded", "compat", "final_norm_folded")


def _flat(cls, config: dict):
    """The class whose fields `config` holds: a multimodal wrapper's ModelArgs
    (a `text_config` field) whose `from_dict` takes the text config flat, as
    mlx-lm's Qwen3.5 does, is checked as its module's TextModelArgs."""
    fields = {f.name for f in dataclasses.fields(cls)}
    if "text_config" in fields and "text_config" not in config:
        import sys

        # Its module's, or that of the model class it extends (qwen3_5_moe's).
        model = getattr(sys.modules[cls.__module__], "Model", None)
        for c in model.__mro__ if model else ():
            text = getattr(sys.modules[c.__module__], "TextModelArgs", None)
            if text is not None:
                return text
    return cls


def _one_of(values) -> str:
    """ "2, 4 or 8" of (2, 4, 8)."""
    *rest, last = map(str, values)
    return f"{', '.join(rest)} or {last}" if rest else last


def _show(v) -> str:
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _type_problem(key: str, value, hint) -> Optional[str]:
    """A value whose JSON type the field cannot take (None always passes:
    mlx-lm declares many optional fields plainly). The hint is mlx-lm's, but
    the value is written by the checkpoints people ship, and mlx-lm's classes
    take what they write beside it: a string for a list of one-character
    strings (Nemotron-H's "M-M*-" pattern, indexed per layer), a list of
    numbers for a number (per-layer values: Hunyuan's moe_topk, Gemma 3n's
    intermediate_size, Step 3.5's rope_theta). What the class then cannot
    take is its own one-line error (build._instantiate)."""
    if value is None:
        return None
    union = typing.get_origin(hint) is typing.Union
    kinds = typing.get_args(hint) if union else (hint,)
    for t in kinds:  # Optional[X]: X
        if _shipped_form(value, t):
            return None
        t = typing.get_origin(t) or t  # List[int]: list
        if t is bool and isinstance(value, (bool, int)):
            return None
        if t in (int, float) and is_number(value):
            return None
        if t in (list, tuple) and isinstance(value, list):  # JSON has no tuple
            return None
        if t in (str, dict) and isinstance(value, t):
            return None
        if t not in (bool, int, float, str, list, tuple, dict, type(None)):
            return None  # a type we do not check
    names = [(typing.get_origin(t) or t).__name__ for t in kinds]
    return f"expected {' or '.join(n for n in names if n != 'NoneType')}"


def _shipped_form(value, hint) -> bool:
    """`value` is another form checkpoints write for a field of type `hint`
    that mlx-lm's classes take as it is (see _type_problem)."""
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if origin in (list, tuple) and args and args[0] is str:
        return isinstance(value, str)
    if hint in (int, float):
        return isinstance(value, list) and all(map(is_number, value))
    return False


def _value_problem(key: str, value, hint) -> Optional[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if key in _LAYER_LISTS:
        ok = is_int if _LAYER_LISTS[key] == "positive integer" else is_number
        if not isinstance(value, list) or not all(ok(v) and v > 0 for v in value):
            return f"expected a list of {_LAYER_LISTS[key]}s, one per layer"
        return None
    if hint is bool:
        return None if isinstance(value, bool) else "expected true or false"
    if hint is int:
        low = 0 if key in _NON_NEGATIVE else 1
        high = MAX_LAYERS if key.startswith("num_") and "layers" in key else MAX_WIDTH
        if key == "max_position_embeddings":
            high = 2**31 - 1
        if not is_int(value) or not low <= value <= high:
            return f"expected an integer from {low} to {high}"
        return None
    if hint is float:
        if not is_number(value) or value <= 0:
            return "expected a positive number"
        if "eps" in key and value > 1:
            return "expected an epsilon of at most 1"
        return None
    if hint is str:
        return None if isinstance(value, str) else "expected a string"
    if origin in (list, List):
        if _shipped_form(value, hint):  # Nemotron-H's pattern string
            return None
        if not isinstance(value, list):
            return "expected a list"
        if args and args[0] is str and not all(isinstance(v, str) for v in value):
            return "expected a list of strings"
        return None
    if origin in (dict, Dict) or hint is dict:
        if value is None:  # DeepSeek V3's `rope_scaling: Dict = None`: none
            return None
        if not isinstance(value, dict):
            return "expected an object"
        if (
            key == "rope_parameters"
            and value
            and all(isinstance(v, dict) for v in value.values())
        ):  # Gemma 4's: one RoPE per layer type, each checked as a flat one
            return next(
                filter(None, (_value_problem(key, v, hint) for v in value.values())),
                None,
            )
        if any(
            not isinstance(v, str) and not is_number(v) and v is not None
            for v in value.values()
            if not isinstance(v, (list, bool))
        ):
            return "expected numbers and strings inside"
        return _scaling_problem(key, value)
    return None


# RoPE scaling types and the keys mlx-lm's rope_utils reads without a default.
_ROPE_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
    # Phi-3's (mlx-lm's SuScaledRoPE): one factor per rotated pair, or one number.
    "longrope": ("short_factor", "long_factor"),
    "su": ("short_factor", "long_factor"),
}


def _scaling_problem(key: str, value: dict) -> Optional[str]:
    if "scaling" not in key and key != "rope_parameters":  # ministral3's dict
        return None
    kind = value.get("rope_type", value.get("type"))
    if value and not isinstance(kind, str):
        return "expected a 'type' or 'rope_type' string"
    missing = [k for k in _ROPE_KEYS.get(kind, ()) if k not in value]
    if missing:
        return f"{kind} scaling needs {missing[0]!r}"
    for k, v in value.items():
        items = v if isinstance(v, list) and v and k.endswith("_factor") else [v]
        if ("factor" in k or "original" in k) and not all(
            x is None or (is_number(x) and x > 0) for x in items
        ):
            return f"{k} must be a positive number (or a list of them)"
    return None


# A family's config object and the keys its class reads from it with no default.
_OBJECT_KEYS = {
    "ministral3": (
        "rope_parameters",
        ("rope_theta", "llama_4_scaling_beta", "original_max_position_embeddings"),
    ),
}


def _relations(config: dict) -> Optional[str]:
    """Head counts that divide, per-layer lists of the right length, the
    keys a family reads from a config object."""
    key, inner = _OBJECT_KEYS.get(config.get("model_type"), (None, ()))
    if key is not None and not isinstance(config.get(key), dict):
        return f"{key} is missing (the model needs it)"
    missing = [k for k in inner if k not in config.get(key, {})]
    if missing:
        return f"{key} needs {missing[0]!r}"
    heads = config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    if is_int(heads) and is_int(hidden) and not config.get("head_dim"):
        if hidden % heads:
            return (
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
    kv = config.get("num_key_value_heads") or heads
    if is_int(heads) and is_int(kv) and heads % kv:
        return (
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    layers = config.get("num_hidden_layers", config.get("num_transformer_layers"))
    for key in ("layer_types", "no_rope_layers", *_LAYER_LISTS):
        v = config.get(key)
        if isinstance(v, list) and is_int(layers) and len(v) != layers:
            return f"{key!r} has {len(v)} entries for {layers} layers"
    pairs = _rotary_pairs(config)
    for key in ("short_factor", "long_factor"):
        v = (config.get("rope_scaling") or {}).get(key)
        if pairs and isinstance(v, list) and len(v) != pairs:
            return f"rope_scaling {key} has {len(v)} entries for {pairs} rotary pairs"
    q, k = config.get("num_query_heads"), config.get("num_kv_heads")
    if isinstance(q, list) and isinstance(k, list):
        if any(is_int(a) and is_int(b) and a % b for a, b in zip(q, k)):
            return "'num_query_heads' are not multiples of 'num_kv_heads'"
    return None


def _rotary_pairs(config: dict) -> Optional[int]:
    """Phi-3's su/longrope: one factor per rotated pair (mlx-lm's SuScaledRoPE)."""
    scaling = config.get("rope_scaling")
    if not isinstance(scaling, dict) or scaling.get("type") not in ("longrope", "su"):
        return None
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    h = config.get("head_dim") or (
        hidden // heads if is_int(heads) and is_int(hidden) else None
    )
    partial = config.get("partial_rotary_factor", 1.0)
    if not is_int(h) or not is_number(partial):
        return None
    return int(h * partial) // 2


def _check_quantization(q, where: str) -> None:
    if q is None:
        return
    if not isinstance(q, dict):
        raise LoadError(f"{where}: quantization is not an object")
    for name, block in [("quantization", q)] + [
        (f"quantization[{k!r}]", v) for k, v in q.items() if isinstance(v, dict)
    ]:
        bits, group = block.get("bits"), block.get("group_size")
        if bits not in WEIGHT_BITS or not is_int(bits):
            raise LoadError(
                f"{where}: {name} bits {_show(bits)} (need {_one_of(WEIGHT_BITS)})"
            )
        if group not in GROUP_SIZES or not is_int(group):
            raise LoadError(
                f"{where}: {name} group_size {_show(group)} (need {_one_of(GROUP_SIZES)})"
            )
    for k, v in q.items():
        if k not in ("bits", "group_size", MLX_Q_MODE) and not isinstance(
            v, (dict, bool)
        ):
            raise LoadError(f"{where}: quantization[{k!r}] is {_show(v)}")
