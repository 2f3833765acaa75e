"""--seed as mlx-lm seeds: the same replies as `mlx_lm generate` and `mlx_lm
chat` for the same seed (docs/design.md section 5d).

mlx-lm calls `mx.random.seed(seed)` before `load`, and building its model
draws from the generator (each Linear, Embedding and LoRA layer is initialised
at random before the checkpoint's weights replace it), so sampling starts from
the generator as the build leaves it. Our build draws differently (another
class, folded tensors, a sharded build's init), so after it the generator is
seeded again and mlx-lm's build is replayed lazily (nothing is evaluated: no
weight is read, nothing is computed) to leave it where mlx-lm's is.
"""

import glob
from pathlib import Path
from typing import Optional


def seed_as_mlx_lm(
    seed: int,
    source,
    adapter_path: Optional[str] = None,
    draft: Optional[str] = None,
) -> None:
    """Seed MLX's generator as `mlx_lm generate --seed SEED` leaves it once it
    loaded the model, its adapter and the --draft-model (in that order). Where
    mlx-lm could not build one (a GGUF: the draws of mlx-lm's class for its
    config; a class it lacks) the seed alone."""
    import mlx.core as mx

    mx.random.seed(seed)
    try:
        _replay_build(source.folder, source.config, adapter_path, source.weights)
        if draft is not None:  # a folder (mlx-lm loads no GGUF draft)
            from .loading.source import resolve

            path = resolve(draft)
            if path.is_dir():
                _replay_build(path, {}, None)
    except Exception:  # mlx-lm could not load it either: nothing to match
        mx.random.seed(seed)


def _replay_build(
    folder: Optional[Path], config: dict, adapter_path: Optional[str], weights=None
) -> None:
    """mlx-lm's `load(MODEL, adapter_path=...)` up to its weights, lazily: its
    `load_model` on the folder (the class, quantized as the checkpoint says),
    then `load_adapters` (LoRA layers), each drawing as they do in mlx-lm."""
    import mlx.nn as nn
    from mlx_lm.utils import load_adapters, load_model

    from .mlx_lm_compat import stock_classes

    if folder is not None and glob.glob(str(folder / "model*.safetensors")):
        model, _ = load_model(folder, lazy=True)
    else:  # a GGUF: mlx-lm's class for its config, quantized as load_model
        model_class, args_class = stock_classes(config)
        model = model_class(args_class.from_dict(config))
        q, weights = config.get("quantization"), weights or {}
        if q:  # each QuantizedLinear draws its initial weight too
            nn.quantize(
                model,
                group_size=q["group_size"],
                bits=q["bits"],
                mode=q.get("mode", "affine"),
                class_predicate=lambda p, m: f"{p}.scales" in weights,
            )
    if adapter_path is not None:
        load_adapters(model, adapter_path)
