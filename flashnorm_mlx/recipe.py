"""The checkpoint `convert` writes, computed in memory: fold (or not), then quantize.

The pipeline is the one `loading.build_model` runs, so a converted checkpoint
gives the same logits as folding at load time in the same dtype (bit for bit
when quantized): dequantize a quantized source to float32, fold the norm gains
in float32 (`fold.fold_gain`; `fold.fold_norms` gives the config marker and the
norm tensors), cast to the output dtype, then quantize every Linear/Embedding
weight whose input width the group size divides, by fold-aware GPTQ
(quant/gptq.py) or exactly as `nn.quantize` (and mlx-lm's convert) would.
Tensors keep their Hugging Face names (q/k/v and gate/up stay separate; our
Llama fuses them at load), so `--compat` checkpoints (all-ones norms kept) also
run in stock mlx-lm. A quantized source taken as stored keeps its tensors.

`fold_checkpoint` is the one way to run GPTQ: `convert` writes what it returns,
`perplexity` builds its FlashNorm model from it. The work goes one layer and
one module at a time, large weights (the embedding) in row chunks, and each
source tensor is released once its output exists, so peak memory stays near
one copy of the model.
"""

import contextlib
import copy
import re
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from . import fold, quant
from .fold import Weights
from .errors import LoadError
from .progress import progress_bar
from .quant import gptq
from .source import Source

# Weights with more elements are computed in row chunks (16 MB of float32 each).
CHUNK_ELEMENTS = 1 << 22

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class Recipe:
    """How each output tensor is made from the source (nothing computed up front).

    quantize=(bits, group_size): quantize the folded float weights with these
    settings (a quantized source is dequantized first). Without it, a quantized
    source is taken as `quantized` says (quant/plan.py): "stored" writes its tensors
    unchanged, marked for FlashNorm to apply the norm gains in its kernels;
    "dequantize" folds it in float; "requantize" folds and quantizes again with
    its own settings. A folded source is accepted only when float and asked to
    be quantized or cast: it is never folded again, and a folded quantized
    tensor is never dequantized and requantized (that would quantize twice).
    """

    def __init__(self, weights, config, quantize, dtype, quantized, compat):
        # Not a copy: release() empties the caller's dict, so tensors go once done.
        self.src, self.src_config = weights, config
        self.gains: Weights = {}  # linear module -> the norm gain folded into it
        self.hessians: gptq.Hessians = {}  # module -> GPTQ Hessian (fold basis)
        self._hinv: Weights = {}
        self.as_stored = False
        # The same decision as loading (quant.plan_weights), for a file to write.
        plan = quant.plan_weights(
            weights, config, dtype, quantize, quantized, output=True
        )
        if plan.stored_quantized:
            self._as_stored(dtype)
            return
        self.out_dtype, self.qspec = plan.dtype, plan.qspec
        if fold.is_folded(config):  # cast or quantized, never folded again
            self._refolded(compat)
            return
        for norm, linears in fold.norm_pairs(config, weights):
            self.gains.update({m: weights[f"{norm}.weight"] for m in linears})
        # Lazy: only its keys, config and small (1-D) tensors are ever evaluated.
        floats = fold.map_floats(plan.weights, lambda v: v.astype(mx.float32))
        self._stock = (plan.weights, plan.config)  # what calibration runs
        folded, self.config = fold.fold_norms(floats, plan.config, compat=compat)
        self._finish(folded)

    def _refolded(self, compat):
        unit = fold.restore_unit_norms if compat else fold.drop_unit_norms
        weights = unit(self.src, self.src_config)
        # With unit gains a folded checkpoint is stock's function: calibrate on it.
        stock = fold.restore_unit_norms(self.src, self.src_config)
        self._stock = (stock, self.src_config)
        self.config = copy.deepcopy(self.src_config)
        self.config[fold.MARKER]["compat"] = compat
        self._finish(weights)

    def _as_stored(self, dtype):
        """A quantized source's own tensors, unchanged: folding would change
        them, so the config's marker says the gains ride in the kernels."""
        if dtype is not None:
            raise LoadError(
                "--dtype would round the stored scales and norm gains: a quantized "
                "source is written as stored; pass --dequantize or --requantize to "
                "fold it and choose a dtype"
            )
        self.as_stored = True
        self.qspec, self.out_dtype = None, quant.source_dtype(self.src)
        self.config = fold.mark_norm_gains(self.src_config)
        self._stock = None
        self.modules = [
            k[: -len(".weight")] for k, v in self.src.items() if _is_matrix(k, v)
        ]
        self.small = {k: v for k, v in self.src.items() if not _is_matrix(k, v)}
        self.order = [k for k in self.src if not k.endswith((".scales", ".biases"))]

    def _finish(self, folded: Weights) -> None:
        self.config = {
            k: v
            for k, v in self.config.items()
            if k not in ("quantization", "quantization_config")
        }
        if self.qspec:
            self.config = quant.with_quantization(self.config, self.qspec)
            # Until `calibrate` says otherwise: round-to-nearest.
            self.config[fold.MARKER]["quantization_method"] = {"method": "rtn"}
        # 2-D weights are made per module (row chunks if large), the rest as is.
        self.modules = [
            k[: -len(".weight")] for k, v in folded.items() if _is_matrix(k, v)
        ]
        self.small = {
            k: v.astype(self.out_dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in folded.items()
            if not _is_matrix(k, v)
        }
        self.order = list(folded)

    def calibrate(self, tokenizer, calibration: "gptq.Calibration", advance=None):
        """GPTQ Hessians of every quantized linear, from stock's float32 model on
        calibration text (a full float copy of the model while it runs)."""
        if not self.qspec:
            return
        if tokenizer is None:
            raise LoadError(
                "GPTQ calibrates on text and this model has no tokenizer: pass "
                "--tokenizer, or --q-method rtn"
            )
        data = gptq.calibration_data(tokenizer, calibration)
        self.hessians = gptq.hessians(*self._stock, data, advance=advance)
        self.config[fold.MARKER]["quantization_method"] = {
            "method": "gptq",
            "calibration": calibration.describe(),
            "damping": gptq.DAMPING,
        }

    def drop_calibration_source(self) -> None:
        self._stock = None

    def rows(self, module: str) -> int:
        return self.src[f"{module}.weight"].shape[0]

    def module(self, module: str, rows: slice = slice(None)) -> Weights:
        """Output tensors of one module for a range of its rows (all ops are row-wise).

        The same dict transforms, in the same order, as `loading.build_model`,
        so the result is bit-identical to folding and quantizing in memory.
        """
        keys = [f"{module}.{s}" for s in ("weight", "scales", "biases")]
        part = {k: self.src[k][rows] for k in keys if k in self.src}
        if self.as_stored:
            return part
        if f"{module}.scales" in part:
            part, _ = quant.dequantize_weights(part, self.src_config, mx.float32)
        part = fold.map_floats(part, lambda v: v.astype(mx.float32))
        if module in self.gains:
            part = fold.fold_gain(part, self.gains[module], module)
        q = (self.qspec or {}).get(module)
        if q and module in self.hessians:  # rows are independent in GPTQ
            if module not in self._hinv:  # once per module, row chunks share it
                self._hinv[module] = gptq.inverse_cholesky(self.hessians[module])
            w = part.pop(f"{module}.weight")
            part = fold.map_floats(part, lambda v: v.astype(self.out_dtype))
            out = gptq.quantize_weight(
                w, None, q["bits"], q["group_size"], self.out_dtype, self._hinv[module]
            )
            return {**part, **{f"{module}.{k}": v for k, v in out.items()}}
        part = fold.map_floats(part, lambda v: v.astype(self.out_dtype))
        return _quantized(part, {module: q}) if q else part

    def release(self, module: str) -> None:
        """Drop the source tensors of a module once its output is computed."""
        for s in ("weight", "scales", "biases"):
            self.src.pop(f"{module}.{s}", None)
        self._hinv.pop(module, None)
        self.hessians.pop(module, None)


def _is_matrix(key: str, value: mx.array) -> bool:
    return key.endswith(".weight") and value.ndim == 2


def _quantized(weights: Weights, qspec: dict) -> Weights:
    """mx.quantize each module in qspec, as nn.QuantizedLinear/Embedding do."""
    out = {}
    for key, value in weights.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        q = qspec.get(module)
        if q is None:
            out[key] = value
            continue
        w, scales, *biases = mx.quantize(
            value, group_size=q["group_size"], bits=q["bits"], mode=q["mode"]
        )
        out[key], out[f"{module}.scales"] = w, scales
        if biases:
            out[f"{module}.biases"] = biases[0]
    return out


def layer_groups(keys: List[str]) -> List[Tuple[str, List[str]]]:
    """Tensor names grouped per transformer layer, then the rest (embeddings, head)."""
    layers: Dict[int, List[str]] = {}
    rest = []
    for k in keys:
        m = _LAYER_RE.search(k)
        if m:
            layers.setdefault(int(m.group(1)), []).append(k)
        else:
            rest.append(k)
    groups = [(f"layer {i}", layers[i]) for i in sorted(layers)]
    return groups + ([("embeddings and head", rest)] if rest else [])


def fold_checkpoint(
    source: Source,
    weights: Weights,
    quantize: Optional[Tuple[int, int]] = None,
    dtype: Optional[mx.Dtype] = None,
    quantized: str = "stored",
    compat: bool = False,
    q_method: str = gptq.DEFAULT_METHOD,
    calibration: gptq.Calibration = gptq.Calibration(),
    progress: bool = False,
    bar=None,
    on_layer: Optional[Callable[[int, int], None]] = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    on_stage: Optional[Callable[[str], None]] = None,
    on_step: Optional[Callable[[str], None]] = None,
) -> Tuple[Weights, dict]:
    """(weights, config) of the checkpoint for `source`'s `weights`, a dict this
    call empties as it goes (pass a copy to keep yours).

    q_method: "gptq" (fold-aware, calibrated on `calibration` windows of offline
    text; needs a tokenizer) or "rtn"; recorded in the config's flashnorm
    block. bar: a live rich Progress to add tasks to (else one of our own when
    `progress`). on_layer(i, n): called after layer group i of n.
    on_stage(text): told as each stage ends (calibration, all layer groups);
    on_step(text): where the work is within a stage, before each of its steps.
    """
    stage = on_stage or (lambda text: None)
    step = on_step or (lambda text: None)
    recipe = Recipe(weights, source.config, quantize, dtype, quantized, compat)
    if q_method == "gptq" and recipe.qspec:
        gptq.check_qspec(recipe.qspec)
        with _bar(
            bar, progress, "[bold]calibrating GPTQ on[/] {task.description}"
        ) as b:
            task = b.add_task("text windows", total=calibration.num_seqs)
            done = [0]

            def advance(n):
                b.advance(task, n)
                done[0] += n
                step(f"calibrating GPTQ: {done[0]}/{calibration.num_seqs} windows")

            step(f"calibrating GPTQ: 0/{calibration.num_seqs} windows")
            recipe.calibrate(source.tokenizer, calibration, advance)
            stage(
                f"calibrated GPTQ on {calibration.num_seqs} windows of "
                f"{calibration.seq_len} tokens"
            )
    recipe.drop_calibration_source()  # source tensors go as modules are done
    # Nothing is folded in a quantized checkpoint kept as stored: it is copied.
    verb = "copying" if recipe.as_stored else "folding"
    with _bar(bar, progress, f"[bold]{verb}[/] {{task.description}}") as b:
        done = _compute(recipe, b, on_layer, chunk_elements, step)
    groups = len(layer_groups(recipe.order))
    if recipe.as_stored:
        stage(f"copied {groups} layer groups as stored")
    else:
        stage(f"folded{' and quantized' if recipe.qspec else ''} {groups} layer groups")
    return done, recipe.config


@contextlib.contextmanager
def _bar(bar, progress: bool, label: str):
    if bar is not None:
        yield bar
    else:
        with progress_bar(progress, label) as own:
            yield own


def _compute(
    recipe: Recipe,
    bar,
    on_layer: Optional[Callable[[int, int], None]],
    chunk_elements: int,
    step: Callable[[str], None],
) -> Weights:
    """Evaluate the checkpoint one layer, one module at a time (bounded memory)."""
    done: Weights = {}
    modules = set(recipe.modules)
    groups = layer_groups(recipe.order)
    task = bar.add_task("", total=len(groups))
    for i, (name, keys) in enumerate(groups):
        bar.update(task, description=name)
        verb = "copying" if recipe.as_stored else "folding"
        step(f"{verb} {name} (layer group {i + 1}/{len(groups)})")
        for key in keys:
            module = key[: -len(".weight")]
            if key.endswith(".weight") and module in modules:
                done.update(_module_output(recipe, module, chunk_elements))
                recipe.release(module)
            else:
                done[key] = recipe.small.pop(key)
                mx.eval(done[key])
        if on_layer is not None:
            on_layer(i, len(groups))
        bar.advance(task)
    # Back to the source's tensor order, a packed weight followed by its scales.
    order = [name for key in recipe.order for name in (key, *_siblings(key))]
    return {k: done[k] for k in order if k in done}


def _siblings(key: str) -> Tuple[str, ...]:
    if not key.endswith(".weight"):
        return ()
    return tuple(key[: -len("weight")] + s for s in ("scales", "biases"))


def _module_output(recipe: Recipe, module: str, chunk_elements: int) -> Weights:
    """One module's output tensors; a large one in row chunks, so its float32
    temporaries stay near chunk_elements (a packed uint32 row holds <= 16 values)."""
    rows = recipe.rows(module)
    src = recipe.src[f"{module}.weight"]
    per_row = src.shape[-1] * (16 if src.dtype == mx.uint32 else 1)
    step = max(1, chunk_elements // per_row)
    if rows <= step:
        out = recipe.module(module)
        mx.eval(out)
        return out
    parts = []
    for r in range(0, rows, step):
        parts.append(recipe.module(module, slice(r, r + step)))
        mx.eval(parts[-1])
    out = {k: mx.concatenate([p[k] for p in parts]) for k in parts[0]}
    mx.eval(out)
    return out
