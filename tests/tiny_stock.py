"""Tiny random models of families FlashNorm does not cover (they run as stock),
in Hugging Face layout: config.json, safetensors, the byte-level tokenizer.

The tensors' names and shapes are those of mlx-lm's own class for the config
(for these families its names are the Hugging Face ones); norm gains random in
[0.25, 4] as in tiny.py, biases non-zero.
"""

from pathlib import Path

import numpy as np
import tiny

_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=tiny.VOCAB,
    rope_theta=10000.0,
    max_position_embeddings=512,
    # The tokenizer's own (tiny.write_tokenizer): transformers' defaults for
    # these families name ids past the tiny vocabulary.
    bos_token_id=None,
    eos_token_id=258,
)

# One per family: Olmo2 (QK-norm over all heads, norms after each sublayer),
# Granite (Llama with multipliers), StarCoder2 (LayerNorms with biases, a plain
# MLP), OLMoE (top-2 of 4 experts). Heads tied and not: greedy text that does
# not repeat one token.
CONFIGS = {
    "olmo2": dict(model_type="olmo2", rms_norm_eps=1e-6, tie_word_embeddings=True),
    "granite": dict(
        model_type="granite",
        rms_norm_eps=1e-5,
        logits_scaling=2.0,
        attention_multiplier=0.2,
        embedding_multiplier=1.0,
        residual_multiplier=0.5,
        attention_bias=True,
        mlp_bias=False,
        tie_word_embeddings=False,
    ),
    "starcoder2": dict(
        model_type="starcoder2", norm_epsilon=1e-5, tie_word_embeddings=False
    ),
    # Mixture of experts, as mlx-lm stores it: experts stacked (3-D weights).
    "olmoe": dict(
        model_type="olmoe",
        rms_norm_eps=1e-5,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}


# Configs written as the families' real checkpoints write them, where that
# differs from the type mlx-lm's ModelArgs declares (and mlx-lm loads them):
# Nemotron-H's layer pattern is one string (Hugging Face's config class, every
# shipped Nemotron-H and Nemotron 3), its time_step_limit ends in Infinity;
# Hunyuan-A13B gives moe_topk, num_shared_expert and moe_intermediate_size per
# layer; Step 3.5 gives rope_theta per layer.
SHIPPED = {
    "nemotron_h": dict(
        model_type="nemotron_h",
        architectures=["NemotronHForCausalLM"],
        hybrid_override_pattern="M-*-",
        num_hidden_layers=4,
        head_dim=16,
        attention_bias=False,
        mlp_bias=False,
        use_bias=False,
        mlp_hidden_act="relu2",
        layer_norm_epsilon=1e-5,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=2,
        expand=2,
        chunk_size=128,
        mamba_hidden_act="silu",
        use_conv_bias=True,
        time_step_limit=[0.0, float("inf")],
        time_step_min=0.001,
        time_step_max=0.1,
        tie_word_embeddings=False,
    ),
    "hunyuan": dict(
        model_type="hunyuan",
        attention_bias=False,
        moe_topk=[2, 2],
        num_experts=4,
        num_shared_expert=[1, 1],
        moe_intermediate_size=[32, 32],
        use_mixed_mlp_moe=True,
        use_qk_norm=True,
        rms_norm_eps=1e-5,
        use_cla=False,
        cla_share_factor=2,
        rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
        tie_word_embeddings=True,
    ),
    "step3p5": dict(
        model_type="step3p5",
        num_attention_groups=2,
        head_dim=16,
        rope_theta=[10000.0, 5000.0],
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=8,
        moe_num_experts=4,
        moe_top_k=2,
        moe_intermediate_size=32,
        share_expert_dim=32,
        moe_layers_enum="1",
    ),
}


def config(model_type: str) -> dict:
    return {**_BASE, **CONFIGS.get(model_type, SHIPPED.get(model_type))}


def weights(cfg: dict, seed: int = 0) -> dict:
    """Random tensors for every parameter of mlx-lm's class for `cfg`."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    shapes = {
        k: v.shape
        for k, v in tree_flatten(model_cls(args_cls.from_dict(cfg)).parameters())
    }
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in shapes.items():
        if len(shape) == 2 and "embed" in name:
            w[name] = rng.standard_normal(shape)
        elif len(shape) == 2:
            w[name] = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif "norm" in name and name.endswith(".weight"):
            w[name] = rng.uniform(0.25, 4.0, size=shape)
        else:  # biases (a LayerNorm's too): far from 0, either sign
            w[name] = rng.uniform(-0.5, 0.5, size=shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


def make(path: Path, model_type: str, seed: int = 0) -> Path:
    cfg = config(model_type)
    return tiny.write_model(path, cfg, weights(cfg, seed))
