"""llama.cpp's `qwen3moe` GGUF files, read as Qwen3-MoE (docs/design.md section 2j).

Its layout holds the model exactly: the router (`ffn_gate_inp`, (experts, width))
and the experts' gate, up and down already stacked expert-major
(`ffn_{gate,up,down}_exps`, (experts, out, in)), as mlx-lm's `sanitize` stacks
them. The names are the family's `ARCH.moe.gguf` (models/arch.py). llama.cpp
runs every qwen3moe layer sparse and renormalizes the top-k scores (its code,
not the file, says so), so the config does too. A mixture-of-experts GGUF of a
family whose MoE declares no GGUF names is refused in one line.
"""

from pathlib import Path
from typing import List

from .. import models
from ..errors import LoadError
from ..models.arch import Architecture


def _moe_archs() -> List[str]:
    """llama.cpp architectures whose experts we read (their ARCH.moe.gguf)."""
    archs = (models.architecture({"model_type": mt}) for mt in models.ARCHITECTURES)
    return list(
        dict.fromkeys(a.gguf.arch for a in archs if a.gguf and a.moe and a.moe.gguf)
    )


def moe_config(meta: dict, arch: str, path: Path, family: Architecture) -> dict:
    """The config's mixture-of-experts keys ({} for a file without experts)."""
    experts = meta.get(f"{arch}.expert_count")
    experts = int(experts.item() if hasattr(experts, "item") else experts or 0)
    if not experts:
        return {}
    if family.moe is None or not family.moe.gguf:
        raise LoadError(
            f"{path}: mixture-of-experts GGUF files are read for "
            f"{', '.join(_moe_archs())} only, not {arch}"
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


def layer_modules(config: dict, modules: List[str], family: Architecture) -> List[str]:
    """A layer's expected modules: the experts in place of the dense GLU."""
    if family.moe is None or not config.get(family.moe.count_key):
        return modules
    dense = f"{family.feed_forward}."
    kept = [m for m in modules if not m.startswith(dense)]
    return kept + list(family.moe.gguf_names().values())
