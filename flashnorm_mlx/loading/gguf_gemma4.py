"""llama.cpp's `gemma4` GGUF files, read as the checkpoint mlx-lm's
`gemma4_text` loads (its `sanitize`'s names). docs/design.md section 2n.

What llama.cpp's converter (conversion/gemma.py, `Gemma4Model`, a
`Gemma3Model`) does, each undone exactly (renames, row splits: exact on
quantized rows too) or read from where llama.cpp's code fixes it:
- `norm_shift` is 0: every norm stored as its plain gain w (no 1 + w);
- `filter_tensors`: `layer_scalar` named `layer_output_scale.weight`;
  `modify_tensors`: `router.scale` as `ffn_gate_inp.scale`,
  `router.per_expert_scale` as `ffn_down_exps.scale`, the experts' gate|up
  as one `ffn_gate_up_exps` (gate rows first: split here);
- `generate_extra_tensors`: the global layers' proportional RoPE as one
  `rope_freqs` (1 per rotated pair, 1e30 per unrotated one): its count of
  ones gives `partial_rotary_factor`; the rotation itself spans the whole
  global head (`rope.dimension_count`), as mlx-lm's ProportionalRoPE;
- `set_gguf_parameters`: `layer_types` as `attention.sliding_window_pattern`,
  sliding heads as `*_length_swa`, global heads as `key_length`,
  `head_count_kv` per layer (global heads: `num_global_key_value_heads`),
  `feed_forward_length` per layer where `use_double_wide_mlp` doubles the
  KV-shared layers', per-layer inputs' width, `shared_kv_layers`;
- a layer with `attn_k` and no `attn_v` is a K = V global layer (the graph
  uses k as v); KV-shared layers' k and v are dropped as mlx-lm's sanitize
  drops them; --fuse-qkv's `attn_qkv` is split again.
llama.cpp's code, not the file: attention scale 1, softmax top-k routing
renormalized, a missing `layer_output_scale` skipped (a layer_scalar of 1
here), a KV-shared layer reuses the last (global) or second-to-last
(sliding) layer holding KV, which mlx-lm's "last of the same type" matches
only where those two layers are a sliding then a global one. Refused in one
line where mlx-lm's class cannot hold the file: that KV reuse otherwise,
global KV heads of their own without K = V, a partly rotated sliding head,
a `rope_freqs` not of proportional RoPE, experts in some layers only.
"""

import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..errors import LoadError
from ..models.arch import Architecture
from .gguf import check_type, meta_f32, meta_required, meta_value

_LAYER = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # --fuse-qkv's q|k|v rows: split below
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_exps": "experts.switch_glu.gate_proj",
    "ffn_up_exps": "experts.switch_glu.up_proj",
    "ffn_down_exps": "experts.switch_glu.down_proj",
    "ffn_gate_up_exps": "experts.switch_glu.gate_up_proj",  # split below
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
# 1-D tensors stored under a `.weight`/`.scale` name whose mlx-lm parameter has none.
_BARE = {
    ("layer_output_scale", "weight"): "layer_scalar",
    ("ffn_gate_inp", "scale"): "router.scale",
    ("ffn_down_exps", "scale"): "router.per_expert_scale",
}
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
_SUFFIXES = ("weight", "scales", "biases")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(\w+)")
UNROTATED = 1e29  # rope_freqs of an unrotated pair: 1e30 (angle 0)


def read(
    meta: dict, raw: Dict[str, mx.array], path: Path, arch: str, family: Architecture
) -> Tuple[dict, Dict[str, mx.array], Callable[[str], Optional[str]]]:
    """(config, weights under mlx-lm's names, GGUF name -> our name)."""

    def rename(name: str) -> Optional[str]:
        m = _BLOCK.fullmatch(name)
        if m is None:
            stem, _, suffix = name.rpartition(".")
            if stem in _GLOBAL and suffix in _SUFFIXES:
                return f"{_GLOBAL[stem]}.{suffix}"
            return None
        i, stem, suffix = m.groups()
        if (stem, suffix) in _BARE:
            return f"model.layers.{i}.{_BARE[stem, suffix]}"
        if stem in _LAYER and suffix in _SUFFIXES:
            return f"model.layers.{i}.{_LAYER[stem]}.{suffix}"
        return None

    weights = {}
    for name, value in raw.items():
        if name == "rope_freqs.weight":  # read into the config below
            continue
        ours = rename(name)
        if ours is None:
            raise LoadError(f"{path}: unexpected tensor {name!r} for a {arch} GGUF")
        check_type(name, value, raw, path)
        weights[ours] = value
    config = gemma4_config(meta, raw, weights, path, arch)
    weights = split_fused(weights, config)
    weights = drop_shared_kv(weights, config)
    weights = unit_layer_scalars(weights, config)
    _check_complete(weights, config, path)
    return config, weights, rename


def _per_layer(v, n: int, what: str, path: Path) -> List[int]:
    """A per-layer metadata value (one number or an array of n) as n ints."""
    v = v if isinstance(v, list) else [v] * n
    if len(v) != n:
        raise LoadError(f"{path}: {what} has {len(v)} entries for {n} layers")
    return [int(x) for x in v]


def gemma4_config(meta: dict, raw: dict, weights: dict, path: Path, arch: str) -> dict:
    """mlx-lm's gemma4_text config of the file (Gemma4Model.set_gguf_parameters)."""
    a = arch
    n = int(meta_required(meta, f"{a}.block_count", path))
    types = _layer_types(meta, a, n, path)
    head = int(meta_required(meta, f"{a}.attention.key_length_swa", path))
    head_full = int(meta_required(meta, f"{a}.attention.key_length", path))
    _check_head_dims(meta, a, head, head_full, path)
    shared = int(meta_value(meta, f"{a}.attention.shared_kv_layers", 0) or 0)
    _check_shared(types, n - shared, shared, path)
    kv_swa, kv_full, k_eq_v = _kv_heads(meta, a, types, weights, n - shared, path)
    ff = _feed_forward(meta, a, n, n - shared, path)
    softcap = meta_value(meta, f"{a}.final_logit_softcapping")
    per_layer = int(meta_value(meta, f"{a}.embedding_length_per_layer_input", 0) or 0)
    config = {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "hidden_size": int(meta_required(meta, f"{a}.embedding_length", path)),
        "num_hidden_layers": n,
        "intermediate_size": ff[0],
        # The KV-shared layers' width doubled (or the file has none).
        "use_double_wide_mlp": ff != [ff[0]] * n,
        "num_attention_heads": int(
            meta_required(meta, f"{a}.attention.head_count", path)
        ),
        "num_key_value_heads": kv_swa,
        "num_global_key_value_heads": kv_full if k_eq_v else None,
        "attention_k_eq_v": k_eq_v,
        "head_dim": head,
        "global_head_dim": head_full,
        "rms_norm_eps": meta_f32(
            meta_required(meta, f"{a}.attention.layer_norm_rms_epsilon", path)
        ),
        "vocab_size": int(raw["token_embd.weight"].shape[0]),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": per_layer,
        "sliding_window": int(
            meta_required(meta, f"{a}.attention.sliding_window", path)
        ),
        "layer_types": types,
        "rope_parameters": _rope_parameters(meta, a, raw, head_full, path),
        "max_position_embeddings": int(meta_value(meta, f"{a}.context_length", 131072)),
        # Written only where set (Gemma3Model): mlx-lm's default is 30, not none.
        "final_logit_softcapping": meta_f32(softcap) if softcap else None,
        "tie_word_embeddings": "output.weight" not in raw,
        "enable_moe_block": False,
    }
    if per_layer:
        rows = raw["per_layer_token_embd.weight"].shape[0]
        config["vocab_size_per_layer_input"] = int(rows)
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        tid = meta_value(meta, f"tokenizer.ggml.{name}_token_id")
        if tid is not None:
            config[key] = int(tid)
    config.update(_expert_fields(meta, a, weights, n, path))
    return config


def _layer_types(meta: dict, a: str, n: int, path: Path) -> List[str]:
    """Each layer's attention, from the file's sliding-window flags."""
    swa = meta_required(meta, f"{a}.attention.sliding_window_pattern", path)
    if not isinstance(swa, list) or len(swa) != n:
        raise LoadError(f"{path}: attention.sliding_window_pattern is not {n} flags")
    return ["sliding_attention" if s else "full_attention" for s in swa]


def _check_head_dims(meta: dict, a: str, head: int, head_full: int, path: Path):
    """Values as wide as keys, and RoPE over the whole head: mlx-lm's gemma4
    has no field for anything else."""
    for key, want in (
        ("attention.value_length_swa", head),
        ("attention.value_length", head_full),
        ("rope.dimension_count_swa", head),  # mlx-lm rotates all of a sliding head
        ("rope.dimension_count", head_full),
    ):
        got = int(meta_value(meta, f"{a}.{key}", want))
        if got != want:
            raise LoadError(f"{path}: {key} {got} is not {want}; not mlx-lm's gemma4")


def _check_shared(types: List[str], first_shared: int, shared: int, path: Path):
    """KV-shared layers reuse the last sliding and global layers before them
    in mlx-lm; llama.cpp reuses layer first_shared - 1 or - 2: they must agree."""
    if shared and (
        first_shared < 2
        or types[first_shared - 1] != "full_attention"
        or types[first_shared - 2] != "sliding_attention"
    ):
        raise LoadError(
            f"{path}: KV-shared layers after a {types[first_shared - 1]} layer reuse "
            "other layers in llama.cpp than in mlx-lm"
        )


def _kv_heads(meta, a: str, types, weights: dict, first_shared: int, path: Path):
    """(sliding layers' KV heads, global layers' KV heads, K = V) as mlx-lm's
    gemma4 holds them: one count per layer type."""
    n = len(types)
    kv = _per_layer(
        meta_required(meta, f"{a}.attention.head_count_kv", path),
        n,
        "head_count_kv",
        path,
    )
    # K = V global layers: k without v (the converter writes none; the graph
    # takes k as v). mlx-lm's attention_k_eq_v is one flag for every global layer.
    k_eq_v = {
        f"model.layers.{i}.self_attn.v_proj.weight" not in weights
        and f"model.layers.{i}.self_attn.qkv_proj.weight" not in weights
        for i in range(first_shared)
        if types[i] == "full_attention"
    }
    if len(k_eq_v) > 1:
        raise LoadError(f"{path}: some global layers have a v projection, some not")
    k_eq_v = bool(k_eq_v and k_eq_v.pop())
    by_type = {t: {kv[i] for i in range(n) if types[i] == t} for t in set(types)}
    if any(len(counts) > 1 for counts in by_type.values()):
        raise LoadError(f"{path}: head_count_kv differs between layers of one type")
    swa_kv = by_type.get("sliding_attention") or by_type["full_attention"]
    kv_swa, kv_full = min(swa_kv), min(by_type.get("full_attention") or swa_kv)
    if kv_full != kv_swa and not k_eq_v:  # mlx-lm: only K = V layers have their own
        raise LoadError(
            f"{path}: global layers with {kv_full} KV heads, sliding ones {kv_swa}, "
            "without K = V: not mlx-lm's gemma4"
        )
    return kv_swa, kv_full, k_eq_v


def _feed_forward(meta: dict, a: str, n: int, first_shared: int, path: Path):
    """Each layer's MLP width: one width, or the KV-shared layers' doubled."""
    ff = _per_layer(
        meta_required(meta, f"{a}.feed_forward_length", path),
        n,
        "feed_forward_length",
        path,
    )
    double = [2 * ff[0] if i >= first_shared > 0 else ff[0] for i in range(n)]
    if ff != [ff[0]] * n and ff != double:
        raise LoadError(f"{path}: feed_forward_length {ff} is not mlx-lm's gemma4's")
    return ff


def _rope_parameters(meta: dict, a: str, raw: dict, head_full: int, path: Path):
    """mlx-lm's per-layer-type RoPE: proportional and partial on the global
    layers, the default on the sliding ones."""
    return {
        "full_attention": {
            "partial_rotary_factor": _partial_rotary(raw, head_full, path),
            "rope_theta": meta_f32(meta_required(meta, f"{a}.rope.freq_base", path)),
            "rope_type": "proportional",
        },
        "sliding_attention": {
            "rope_theta": meta_f32(
                meta_value(meta, f"{a}.rope.freq_base_swa", 10000.0)
            ),
            "rope_type": "default",
        },
    }


def _expert_fields(meta: dict, a: str, weights: dict, n: int, path: Path) -> dict:
    """The MoE block's fields where every layer has a router; {} where none has."""
    routers = [f"model.layers.{i}.router.proj.weight" in weights for i in range(n)]
    if any(routers) and not all(routers):
        raise LoadError(f"{path}: experts in some layers only: not mlx-lm's gemma4")
    if not all(routers):
        return {}
    return dict(
        enable_moe_block=True,
        num_experts=int(meta_required(meta, f"{a}.expert_count", path)),
        top_k_experts=int(meta_required(meta, f"{a}.expert_used_count", path)),
        moe_intermediate_size=int(
            meta_required(meta, f"{a}.expert_feed_forward_length", path)
        ),
    )


def _partial_rotary(raw: dict, head_full: int, path: Path) -> float:
    """`partial_rotary_factor` from rope_freqs: ones (rotated), then 1e30s."""
    if "rope_freqs.weight" not in raw:
        raise LoadError(f"{path}: no rope_freqs tensor (the global layers' RoPE)")
    f = np.array(raw["rope_freqs.weight"].astype(mx.float32)).reshape(-1)
    rotated = int((f == 1.0).sum())
    if f.shape != (head_full // 2,) or not (
        (f[:rotated] == 1.0).all() and (f[rotated:] > UNROTATED).all()
    ):
        raise LoadError(f"{path}: rope_freqs is not a proportional RoPE's; not read")
    return 2 * rotated / head_full


def _head_dim(config: dict, i: int) -> int:
    full = config["layer_types"][i] == "full_attention"
    return config["global_head_dim"] if full else config["head_dim"]


def split_fused(weights: dict, config: dict) -> dict:
    """--fuse-qkv's `attn_qkv` (q|k|v rows) and `ffn_gate_up_exps` (gate|up
    rows per expert) split into mlx-lm's modules (rows only: exact quantized)."""
    out = {}
    for k, v in weights.items():
        if ".self_attn.qkv_proj." in k:
            i = int(k.split(".")[2])
            h = _head_dim(config, i)
            q = config["num_attention_heads"] * h
            kv = config["num_key_value_heads"] * h
            for name, part in zip("qkv", mx.split(v, [q, q + kv])):
                out[k.replace(".qkv_proj.", f".{name}_proj.")] = part
        elif ".switch_glu.gate_up_proj." in k:
            gate, up = mx.split(v, 2, axis=-2)
            out[k.replace(".gate_up_proj.", ".gate_proj.")] = gate
            out[k.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            out[k] = v
    return out


def unit_layer_scalars(weights: dict, config: dict) -> dict:
    """A layer without `layer_output_scale` (llama.cpp's graph then scales by
    nothing) gets mlx-lm's layer_scalar of 1, so its class loads strictly."""
    out = dict(weights)
    for i in range(config["num_hidden_layers"]):
        out.setdefault(f"model.layers.{i}.layer_scalar", mx.ones((1,)))
    return out


def drop_shared_kv(weights: dict, config: dict) -> dict:
    """KV-shared layers' k, v and k_norm dropped, as mlx-lm's sanitize drops
    them (those layers read an earlier layer's cache)."""
    first = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    own = (".self_attn.k_proj.", ".self_attn.v_proj.", ".self_attn.k_norm.")
    return {
        k: v
        for k, v in weights.items()
        if not (any(s in k for s in own) and int(k.split(".")[2]) >= first)
    }


def _check_complete(weights: dict, config: dict, path: Path) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        need.append("lm_head.weight")
    if config["hidden_size_per_layer_input"]:
        need += [
            "model.embed_tokens_per_layer.weight",
            "model.per_layer_model_projection.weight",
            "model.per_layer_projection_norm.weight",
        ]
    first_shared = config["num_hidden_layers"] - config["num_kv_shared_layers"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        mods = ["input_layernorm", "post_attention_layernorm"]
        mods += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        mods += ["self_attn.q_proj", "self_attn.o_proj", "self_attn.q_norm"]
        mods += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        if i < first_shared:
            mods += ["self_attn.k_proj", "self_attn.k_norm"]
            full = config["layer_types"][i] == "full_attention"
            if not (full and config["attention_k_eq_v"]):
                mods.append("self_attn.v_proj")
        if config["hidden_size_per_layer_input"]:
            mods += ["per_layer_input_gate", "per_layer_projection"]
            mods.append("post_per_layer_input_norm")
        if config["enable_moe_block"]:
            mods += ["router.proj", "pre_feedforward_layernorm_2"]
            mods += ["post_feedforward_layernorm_1", "post_feedforward_layernorm_2"]
            mods += [f"experts.switch_glu.{n}_proj" for n in ("gate", "up", "down")]
            need += [f"{p}.router.scale", f"{p}.router.per_expert_scale"]
        need += [f"{p}.{m}.weight" for m in mods]
    missing = [k for k in need if k not in weights]
    if missing:
        raise LoadError(
            f"{path}: {len(missing)} tensors missing or of a type MLX cannot read "
            f"(first: {missing[0]})"
        )
