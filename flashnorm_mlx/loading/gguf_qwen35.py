"""llama.cpp's `qwen35`, `qwen35moe` and `qwen3next` GGUF files, read as the
checkpoints mlx-lm's `qwen3_5`, `qwen3_5_moe` and `qwen3_next` load (their
`sanitize`'s layout: Conv1d (C, K, 1), norms as gains). docs/design.md, "GGUF".

What llama.cpp's converter (conversion/qwen.py) does, each undone exactly (row
or column moves, exact on quantized rows too) or up to float32 rounding:
- `Qwen3NextModel.modify_tensors`: `A_log` stored as A = -exp(A_log) (`ssm_a`),
  read back as log(-A); `dt_bias` named `ssm_dt.bias`; the Conv1d squeezed to
  (C, K); the 1 + w norms stored as 1 + w, which is the gain mlx-lm's sanitize
  makes (the gated norm's plain gain as it is); Qwen3-Next's per-key-head
  in_proj_qkvz split into `attn_qkv` ([all q | all k | all v]) and
  `attn_gate` (all z), put back per key head here;
- `_LinearAttentionVReorderBase` (qwen35, qwen35moe), where value heads
  outnumber key heads: the value heads moved from grouped (by key head) to
  tiled order in attn_qkv's v rows, attn_gate, ssm_beta, ssm_alpha, ssm_a,
  ssm_dt, the conv's v channels and ssm_out's columns; moved back. A
  quantized ssm_out's columns move in whole 32-wide groups, so only where
  head_v_dim is a multiple of 32 (every released Qwen3.5: 128);
- `_QwenMtpMixin`: the multi-token-prediction block appended as more blocks
  (`nextn_predict_layers`), dropped as mlx-lm drops `mtp.`;
- `Qwen2MoeModel`: experts stacked (E, out, in), or gate|up in one
  `ffn_gate_up_exps` (gate rows first); the shared expert's gate a row;
- `ModelBase.modify_tensors` with --fuse-qkv: an attention layer's q|k|v rows
  in one `attn_qkv`, split again.
llama.cpp's qwen35moe graph renormalizes the top-k scores (its code, not the
file, says so); Qwen3.5's interleaved MRoPE is plain RoPE on text positions.
"""

import re
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx

from ..errors import LoadError
from ..models.arch import Architecture
from .gguf import check_type, meta_f32, meta_required, meta_value

PREFIX = "language_model."  # mlx-lm's Qwen3.5 module path of the text model
_LAYER = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # per head [q | gate] rows, as Hugging Face's
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_up_exps": "mlp.switch_mlp.gate_up_proj",  # split below
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
_SUFFIXES = ("weight", "scales", "biases", "bias")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
GROUP = 32  # GGUF's quantization groups, along a row


def read(
    meta: dict, raw: Dict[str, mx.array], path: Path, arch: str, family: Architecture
) -> Tuple[dict, Dict[str, mx.array], Callable[[str], Optional[str]]]:
    """(config, weights under mlx-lm's names, GGUF name -> our name)."""
    config = qwen35_config(meta, raw, path, arch)
    next_ = arch == "qwen3next"
    top = "" if next_ else PREFIX
    n_layers = config["num_hidden_layers"]

    def rename(name: str) -> Optional[str]:
        """Our name of a GGUF tensor; "" for the MTP block's; None if unknown."""
        m = _BLOCK.fullmatch(name)
        if m is None:
            stem, _, suffix = name.rpartition(".")
            if stem == "output" and suffix in _SUFFIXES:
                return f"{top}lm_head.{suffix}"
            if stem in _GLOBAL and suffix in _SUFFIXES:
                return f"{top}{_GLOBAL[stem]}.{suffix}"
            return None
        i, rest = int(m.group(1)), m.group(2)
        if i >= n_layers:
            return ""  # the multi-token-prediction block
        layer = f"{top}model.layers.{i}"
        if rest == "ssm_a":
            return f"{layer}.linear_attn.A_log"
        if rest == "ssm_dt.bias":
            return f"{layer}.linear_attn.dt_bias"
        stem, _, suffix = rest.rpartition(".")
        if stem in _LAYER and suffix in _SUFFIXES:
            return f"{layer}.{_LAYER[stem]}.{suffix}"
        return None

    weights = {}
    for name, value in raw.items():
        ours = rename(name)
        if ours is None:
            raise LoadError(f"{path}: unexpected tensor {name!r} for a {arch} GGUF")
        if ours:
            check_type(name, value, raw, path)
            weights[ours] = value
    weights = split_qkv(weights, config, top)
    weights = split_gate_up(weights)
    weights = a_log(weights)
    weights = conv_layout(weights)
    if next_:
        weights = qkvz_rows(weights, config)
    else:
        weights = untile_value_heads(weights, config, path)
    for k, v in list(weights.items()):
        if k.endswith("shared_expert_gate.weight") and v.ndim == 1:
            weights[k] = v[None]  # stored {n_embd}: mlx-lm's (1, n_embd)
    _check_complete(weights, config, path, top, next_)
    return config, weights, lambda n: rename(n) or None


def qwen35_config(meta: dict, raw: dict, path: Path, arch: str) -> dict:
    """mlx-lm's flat text config of the file (qwen3_5, qwen3_5_moe or qwen3_next)."""

    a = arch
    block_count = int(meta_required(meta, f"{a}.block_count", path))
    layers = block_count - int(meta_value(meta, f"{a}.nextn_predict_layers", 0) or 0)
    heads = int(meta_required(meta, f"{a}.attention.head_count", path))
    hidden = int(meta_required(meta, f"{a}.embedding_length", path))
    head_dim = int(meta_value(meta, f"{a}.attention.key_length", 0) or hidden // heads)
    v_heads = int(meta_required(meta, f"{a}.ssm.time_step_rank", path))
    rope_dim = int(meta_value(meta, f"{a}.rope.dimension_count", head_dim))
    kind = meta_value(meta, f"{a}.rope.scaling.type", "none")
    if kind not in ("none", None):
        raise LoadError(f"{path}: {a} with RoPE scaling {kind!r} is not supported")
    interval = int(meta_value(meta, f"{a}.full_attention_interval", 4))
    _check_layer_pattern(meta, path, a, layers, interval)
    experts = int(meta_value(meta, f"{a}.expert_count", 0) or 0)
    config = {
        "model_type": "qwen3_5_moe" if experts else "qwen3_5",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(
            meta_value(meta, f"{a}.attention.head_count_kv", heads)
        ),
        "head_dim": head_dim,
        "rms_norm_eps": meta_f32(
            meta_required(meta, f"{a}.attention.layer_norm_rms_epsilon", path)
        ),
        "vocab_size": int(raw["token_embd.weight"].shape[0]),
        "max_position_embeddings": int(meta_value(meta, f"{a}.context_length", 4096)),
        "linear_num_key_heads": int(meta_required(meta, f"{a}.ssm.group_count", path)),
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": int(meta_required(meta, f"{a}.ssm.state_size", path)),
        "linear_value_head_dim": int(meta_required(meta, f"{a}.ssm.inner_size", path))
        // v_heads,
        "linear_conv_kernel_dim": int(
            meta_required(meta, f"{a}.ssm.conv_kernel", path)
        ),
        "full_attention_interval": interval,
        "tie_word_embeddings": "output.weight" not in raw,
        "attention_bias": False,
    }
    ff = int(meta_value(meta, f"{a}.feed_forward_length", 0) or 0)
    if ff or not experts:  # an all-sparse file may have none: no dense layer reads it
        config["intermediate_size"] = int(
            meta_required(meta, f"{a}.feed_forward_length", path)
        )
    elif a == "qwen3next":  # a field mlx-lm's qwen3_next requires
        config["intermediate_size"] = int(
            meta_required(meta, f"{a}.expert_feed_forward_length", path)
        )
    theta = meta_f32(meta_value(meta, f"{a}.rope.freq_base", 10000.0))
    if experts:
        config.update(_expert_fields(meta, path, a, experts))
    if a == "qwen3next":
        _as_qwen3_next(config, raw, layers, theta, rope_dim / head_dim)
    else:
        rope = {"type": "default", "rope_theta": theta}
        rope["partial_rotary_factor"] = rope_dim / head_dim
        sections = meta_value(meta, f"{a}.rope.dimension_sections")
        if sections:
            rope["mrope_section"] = [int(s) for s in sections[:3]]
        config["rope_parameters"] = rope
    return config


def _check_layer_pattern(meta: dict, path: Path, a: str, layers: int, interval: int):
    """mlx-lm's layers attend every interval-th only: a file whose recurrent
    layers say otherwise is refused, not run wrong."""
    recurrent = meta_value(meta, f"{a}.attention.recurrent_layers")
    if recurrent is None:
        return
    want = [bool((i + 1) % interval) for i in range(layers)]
    if [bool(r) for r in recurrent[:layers]] != want:
        raise LoadError(
            f"{path}: its recurrent layers are not every layer but each "
            f"{interval}th, the only pattern mlx-lm's {a} runs"
        )


def _expert_fields(meta: dict, path: Path, a: str, experts: int) -> dict:
    """The MoE block's config fields of a file with `experts` experts."""
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(meta_required(meta, f"{a}.expert_used_count", path)),
        moe_intermediate_size=int(
            meta_required(meta, f"{a}.expert_feed_forward_length", path)
        ),
        shared_expert_intermediate_size=int(
            meta_value(meta, f"{a}.expert_shared_feed_forward_length", 0) or 0
        ),
        norm_topk_prob=True,  # llama.cpp's graph renormalizes
        decoder_sparse_step=1,
    )


def _as_qwen3_next(config: dict, raw: dict, layers: int, theta, partial: float):
    """`config` made qwen3_next's: its flat RoPE fields, its dense layers, and
    the MoE fields mlx-lm's class requires even where the file has no experts."""
    experts = config.get("num_experts", 0)
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in raw]
    config.update(
        model_type="qwen3_next",
        rope_theta=theta,
        partial_rotary_factor=partial,
        mlp_only_layers=dense if experts else [],
    )
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        config.setdefault(key, 0)
    config.setdefault("shared_expert_intermediate_size", 0)
    config.setdefault("decoder_sparse_step", 1)


# --- weight transforms (each dict -> dict) -----------------------------------


def split_qkv(weights: dict, config: dict, top: str = "") -> dict:
    """An attention layer's `attn_qkv` (the converter's --fuse-qkv: q|k|v rows,
    q's per head [q | gate]) as q_proj, k_proj and v_proj; a DeltaNet layer's
    attn_qkv is its in_proj_qkv."""
    from ..models.qwen3_5 import layer_kind

    h, kv = config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    q = 2 * config["num_attention_heads"] * h
    out = dict(weights)
    for i in range(config["num_hidden_layers"]):
        if layer_kind(config, i) != "gated_attention":
            continue
        p = f"{top}model.layers.{i}"
        for suffix in ("weight", "scales", "biases"):
            qkv = out.pop(f"{p}.linear_attn.in_proj_qkv.{suffix}", None)
            if qkv is not None:
                for name, part in zip("qkv", mx.split(qkv, [q, q + kv])):
                    out[f"{p}.self_attn.{name}_proj.{suffix}"] = part
    return out


def split_gate_up(weights: dict) -> dict:
    """`ffn_gate_up_exps` (E, 2F, D), gate rows first, as two stacked linears."""
    out = {}
    for k, v in weights.items():
        if ".switch_mlp.gate_up_proj." in k:
            gate, up = mx.split(v, 2, axis=-2)
            out[k.replace("gate_up_proj", "gate_proj")] = gate
            out[k.replace("gate_up_proj", "up_proj")] = up
        else:
            out[k] = v
    return out


def a_log(weights: dict) -> dict:
    """`ssm_a` holds A = -exp(A_log) (Qwen3NextModel.modify_tensors): log(-A)."""
    return {
        k: mx.log(-v.astype(mx.float32)) if k.endswith(".A_log") else v
        for k, v in weights.items()
    }


def conv_layout(weights: dict) -> dict:
    """The squeezed Conv1d (C, K) in MLX's layout (C, K, 1)."""
    return {
        k: v[..., None] if k.endswith("conv1d.weight") and v.ndim == 2 else v
        for k, v in weights.items()
    }


def untiled(x: mx.array, axis: int, groups: int, per: int) -> mx.array:
    """Undo `_reorder_v_heads`: along `axis`, blocks tiled [g0h0, g1h0, ...]
    back to grouped [g0h0, g0h1, ...] (`groups` key heads of `per` value heads)."""
    axis %= x.ndim
    shape = x.shape
    block = shape[axis] // (groups * per)
    t = x.reshape(*shape[:axis], per, groups, block, *shape[axis + 1 :])
    return t.swapaxes(axis, axis + 1).reshape(shape)


def untile_value_heads(weights: dict, config: dict, path: Path) -> dict:
    """Every value-head axis back in Hugging Face's grouped order (a no-op
    where there are as many key heads as value heads)."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if nk == nv:
        return weights
    r, dv = nv // nk, config["linear_value_head_dim"]
    qk = 2 * nk * config["linear_key_head_dim"]
    out = dict(weights)
    for k, v in weights.items():
        if ".linear_attn." not in k:
            continue
        mod = k.rsplit(".", 2)[-2] if not k.endswith((".A_log", ".dt_bias")) else ""
        if mod in ("in_proj_qkv", "conv1d"):  # q and k rows stay; v's move
            out[k] = mx.concatenate([v[:qk], untiled(v[qk:], 0, nk, r)])
        elif mod in ("in_proj_z", "in_proj_b", "in_proj_a") or not mod:
            out[k] = untiled(v, 0, nk, r)
        elif mod == "out_proj":
            if f"{k.rsplit('.', 1)[0]}.scales" in weights and dv % GROUP:
                raise LoadError(
                    f"{path}: quantized ssm_out columns were moved per value head "
                    f"of width {dv}, not a whole number of {GROUP}-wide groups: "
                    "not held exactly"
                )
            out[k] = untiled(v, -1, nk, r)
    return out


def qkvz_rows(weights: dict, config: dict) -> dict:
    """Qwen3-Next's in_proj_qkvz per key head [q | k | v | z] from `attn_qkv`
    ([all q | all k | all v]) and `attn_gate` (all z) (Qwen3NextModel's split)."""
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    vd = config["linear_num_value_heads"] // nk * config["linear_value_head_dim"]
    out = dict(weights)
    for k in weights:
        if ".linear_attn.in_proj_qkv." not in k:
            continue
        z_key = k.replace("in_proj_qkv", "in_proj_z")
        qkv, z = out.pop(k), out.pop(z_key)
        cols = qkv.shape[1:]
        q, kk, v = mx.split(qkv, [nk * dk, 2 * nk * dk])
        parts = [
            p.reshape(nk, -1, *cols) for p in (q, kk, v, z)  # (nk, width of each, ...)
        ]
        qkvz = mx.concatenate(parts, axis=1).reshape(nk * (2 * dk + 2 * vd), *cols)
        out[k.replace("in_proj_qkv", "in_proj_qkvz")] = qkvz
    return out


def _check_complete(
    weights: dict, config: dict, path: Path, top: str, next_: bool
) -> None:
    from ..models.qwen3_5 import layer_kind

    need = [f"{top}model.embed_tokens.weight", f"{top}model.norm.weight"]
    if not config["tie_word_embeddings"]:
        need.append(f"{top}lm_head.weight")
    mixers = {
        "gated_attention": ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"),
        "gated_deltanet": ("conv1d", "norm", "out_proj")
        + (("in_proj_qkvz", "in_proj_ba") if next_ else ("in_proj_qkv", "in_proj_z")),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"{top}model.layers.{i}"
        kind = layer_kind(config, i)
        mod = "self_attn" if kind == "gated_attention" else "linear_attn"
        need += [f"{p}.{mod}.{m}.weight" for m in mixers[kind]]
        if kind == "gated_deltanet":
            need += [f"{p}.linear_attn.A_log", f"{p}.linear_attn.dt_bias"]
            if not next_:
                need += [f"{p}.linear_attn.in_proj_{x}.weight" for x in "ba"]
        need += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        sparse = config.get("num_experts") and i not in config.get(
            "mlp_only_layers", []
        )
        ffn = ("gate", "switch_mlp.gate_proj") if sparse else ("gate_proj",)
        need += [f"{p}.mlp.{m}.weight" for m in ffn]
    missing = [n for n in need if n not in weights]
    if missing:
        raise LoadError(
            f"{path}: {len(missing)} tensors missing or of a type MLX cannot read "
            f"(first: {missing[0]})"
        )
