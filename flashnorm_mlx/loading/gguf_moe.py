"""llama.cpp's `qwen3moe` GGUF files, read as Qwen3-MoE (docs/design.md section 2j).

Its layout holds the model exactly: the router (`ffn_gate_inp`, (experts, width))
and the experts' gate, up and down already stacked expert-major
(`ffn_{gate,up,down}_exps`, (experts, out, in)), as mlx-lm's `sanitize` stacks
them. llama.cpp runs every qwen3moe layer sparse and renormalizes the top-k
scores (its code, not the file, says so), so the config does too. Any other
mixture-of-experts GGUF is refused in one line.
"""

from pathlib import Path
from typing import List

from ..errors import LoadError

ARCH = "qwen3moe"  # general.architecture
MODEL_TYPE = "qwen3_moe"
NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}


def moe_config(meta: dict, arch: str, path: Path) -> dict:
    """The config's mixture-of-experts keys ({} for a file without experts)."""
    experts = meta.get(f"{arch}.expert_count")
    experts = int(experts.item() if hasattr(experts, "item") else experts or 0)
    if not experts:
        return {}
    if arch != ARCH:
        raise LoadError(
            f"{path}: mixture-of-experts GGUF files are read for {ARCH} only, "
            f"not {arch}"
        )

    def count(key: str) -> int:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise LoadError(f"{path}: GGUF metadata has no {arch}.{key}")
        return int(v.item() if hasattr(v, "item") else v)

    return dict(
        num_experts=experts,
        num_experts_per_tok=count("expert_used_count"),
        moe_intermediate_size=count("expert_feed_forward_length"),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


def layer_modules(config: dict, modules: List[str]) -> List[str]:
    """A layer's expected modules: the experts in place of the dense GLU."""
    if not config.get("num_experts"):
        return modules
    return [m for m in modules if not m.startswith("mlp.")] + list(NAMES.values())
