"""llama.cpp's `lfm2` and `lfm2moe` GGUF files, read as the checkpoints
mlx-lm's `lfm2` and `lfm2_moe` load (docs/design.md, "GGUF").

What llama.cpp's converter (conversion/lfm2.py) does, each undone exactly:
- `LFM2Model.modify_tensors` / `LFM2MoeModel.modify_tensors`: the short
  convolution's (C, 1, K) squeezed to (C, K): MLX's (C, K, 1); everything
  else renamed only (no Q/K permutation: llama.cpp runs LFM2's RoPE as NEOX,
  Hugging Face's half-split), the final norm as `token_embd_norm`; with
  --fuse-qkv (`ModelBase.modify_tensors`) q|k|v rows in one `attn_qkv`;
- `set_gguf_parameters`: the attention layers are those whose
  `head_count_kv` entry is not 0; the GLU's width is written adjusted
  (`_add_feed_forward_length`), so it is read with no adjustment;
- LFM2-MoE: the experts stacked (E, out, in), `expert_bias` as
  `exp_probs_b.bias`, the dense layers leading (`leading_dense_block_count`).
  The file has no `norm_topk_prob` or `routed_scaling_factor`: llama.cpp's
  graph renormalizes the top-k weights and scales them by
  `expert_weights_scale` (1 where absent), so the config says so; a Hugging
  Face checkpoint with other values is not what its GGUF runs.
"""

import re
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from ..errors import LoadError
from ..models.arch import Architecture
from .gguf import check_type, meta_f32, meta_required, meta_value

_LAYER = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_qkv": "self_attn.qkv_proj",  # --fuse-qkv's q|k|v rows: split below
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    "ffn_gate_inp": "feed_forward.gate",
    "ffn_gate_exps": "feed_forward.switch_mlp.gate_proj",
    "ffn_up_exps": "feed_forward.switch_mlp.up_proj",
    "ffn_down_exps": "feed_forward.switch_mlp.down_proj",
}
# The dense GLU: Hugging Face's w1/w3/w2 in lfm2, mlx-lm's names in lfm2_moe.
_GLU = {
    "lfm2": {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"},
    "lfm2moe": {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"},
}
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "token_embd_norm": "model.embedding_norm",
}
_SUFFIXES = ("weight", "scales", "biases", "bias")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(\w+)")
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def read(
    meta: dict, raw: Dict[str, mx.array], path: Path, arch: str, family: Architecture
) -> Tuple[dict, Dict[str, mx.array], Callable[[str], Optional[str]]]:
    """(config, weights under mlx-lm's names, GGUF name -> our name)."""
    config = lfm2_config(meta, raw, path, arch)
    layer_names = {**_LAYER, **{k: f"feed_forward.{v}" for k, v in _GLU[arch].items()}}

    def rename(name: str) -> Optional[str]:
        m = _BLOCK.fullmatch(name)
        if m is None:
            stem, _, suffix = name.rpartition(".")
            if stem in _GLOBAL and suffix in _SUFFIXES:
                return f"{_GLOBAL[stem]}.{suffix}"
            return None
        i, stem, suffix = m.groups()
        if stem == "exp_probs_b" and suffix == "bias":
            return f"model.layers.{i}.feed_forward.expert_bias"
        if stem in layer_names and suffix in _SUFFIXES:
            return f"model.layers.{i}.{layer_names[stem]}.{suffix}"
        return None

    weights = {}
    for name, value in raw.items():
        ours = rename(name)
        if ours is None:
            raise LoadError(f"{path}: unexpected tensor {name!r} for a {arch} GGUF")
        check_type(name, value, raw, path)
        weights[ours] = value
    weights = split_qkv(weights, config)
    weights = conv_layout(weights)
    _check_complete(weights, config, path, arch)
    return config, weights, rename


def lfm2_config(meta: dict, raw: dict, path: Path, arch: str) -> dict:
    """mlx-lm's lfm2 (or lfm2_moe) config of the file."""

    a = arch
    if "output.weight" in raw:  # mlx-lm's class reads its head from the embedding
        raise LoadError(f"{path}: an {a} GGUF with its own output head is not run")
    if int(meta_value(meta, f"{a}.attention.sliding_window", 0) or 0):
        raise LoadError(f"{path}: {a} with a sliding window is not in mlx-lm's {a}")
    layers = int(meta_required(meta, f"{a}.block_count", path))
    heads = int(meta_required(meta, f"{a}.attention.head_count", path))
    kv = meta_required(meta, f"{a}.attention.head_count_kv", path)
    kv = kv if isinstance(kv, list) else [kv] * layers
    attention = [i for i, n in enumerate(kv) if n]
    hidden = int(meta_required(meta, f"{a}.embedding_length", path))
    ff = int(meta_required(meta, f"{a}.feed_forward_length", path))
    config = {
        "model_type": "lfm2" if a == "lfm2" else "lfm2_moe",
        "vocab_size": int(raw["token_embd.weight"].shape[0]),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(max(kv)),
        "max_position_embeddings": int(meta_value(meta, f"{a}.context_length", 128000)),
        "norm_eps": meta_f32(
            meta_required(meta, f"{a}.attention.layer_norm_rms_epsilon", path)
        ),
        "conv_bias": any(k.endswith("shortconv.in_proj.bias") for k in raw),
        "conv_L_cache": int(meta_required(meta, f"{a}.shortconv.l_cache", path)),
        "rope_theta": meta_f32(meta_value(meta, f"{a}.rope.freq_base", 1000000.0)),
        "full_attn_idxs": attention,
    }
    if a == "lfm2":
        config.update(  # the file's width is the adjusted one: no adjustment
            block_dim=hidden,
            block_ff_dim=ff,
            block_multiple_of=1,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
        )
        return config
    gating = int(meta_value(meta, f"{a}.expert_gating_func", SIGMOID))
    if gating != SIGMOID:
        raise LoadError(f"{path}: {a} expert gating {gating} is not LFM2-MoE's sigmoid")
    scale = float(meta_value(meta, f"{a}.expert_weights_scale", 0.0) or 0.0)
    config.update(
        intermediate_size=ff,
        moe_intermediate_size=int(
            meta_required(meta, f"{a}.expert_feed_forward_length", path)
        ),
        num_experts=int(meta_required(meta, f"{a}.expert_count", path)),
        num_experts_per_tok=int(meta_required(meta, f"{a}.expert_used_count", path)),
        num_dense_layers=int(meta_value(meta, f"{a}.leading_dense_block_count", 0)),
        use_expert_bias=any(k.endswith("exp_probs_b.bias") for k in raw),
        norm_topk_prob=True,  # llama.cpp's graph renormalizes (build_moe_ffn)
        routed_scaling_factor=scale or 1.0,
    )
    return config


def split_qkv(weights: dict, config: dict) -> dict:
    """The converter's --fuse-qkv `attn_qkv` (q|k|v rows) as q, k and v."""
    h = config["hidden_size"] // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * h, config["num_key_value_heads"] * h
    out = {}
    for k, v in weights.items():
        if ".self_attn.qkv_proj." in k:
            for name, part in zip("qkv", mx.split(v, [q, q + kv])):
                out[k.replace(".qkv_proj.", f".{name}_proj.")] = part
        else:
            out[k] = v
    return out


def conv_layout(weights: dict) -> dict:
    """The squeezed convolution (C, K) in MLX's layout (C, K, 1)."""
    return {
        k: v[..., None] if k.endswith("conv.conv.weight") and v.ndim == 2 else v
        for k, v in weights.items()
    }


def _check_complete(weights: dict, config: dict, path: Path, arch: str) -> None:
    need = ["model.embed_tokens.weight", "model.embedding_norm.weight"]
    dense = [f"feed_forward.{n}" for n in _GLU[arch].values()]
    experts = ["feed_forward.gate"] + [
        f"feed_forward.switch_mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        if i in config["full_attn_idxs"]:
            mods = ["q_proj", "k_proj", "v_proj", "out_proj", "q_layernorm"]
            mods = [f"self_attn.{m}" for m in mods + ["k_layernorm"]]
        else:
            mods = ["conv.conv", "conv.in_proj", "conv.out_proj"]
        sparse = arch == "lfm2moe" and i >= config["num_dense_layers"]
        mods += ["operator_norm", "ffn_norm"] + (experts if sparse else dense)
        need += [f"{p}.{m}.weight" for m in mods]
    missing = [n for n in need if n not in weights]
    if missing:
        raise LoadError(
            f"{path}: {len(missing)} tensors missing or of a type MLX cannot read "
            f"(first: {missing[0]})"
        )
