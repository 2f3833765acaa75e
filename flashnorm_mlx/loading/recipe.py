"""One weight pipeline for loading and `convert`: fold (or not), then quantize.

`Recipe.module` is the one per-module transform (dequantize, fold in float32,
cast, quantize), so a converted checkpoint holds exactly the tensors loading
builds; `fold_checkpoint` runs it a layer and a module at a time, each source
tensor released once used, so peak memory stays near one copy of the model
(docs/design.md section 5a).
"""

import contextlib
import copy
import math
import re
import time
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .. import estimate, fold, models, quant
from ..errors import LoadError
from ..fold import Weights
from ..progress import counter, progress_bar
from ..quant import gptq, kquant
from .shapes import config_name, mismatch, shapes_of
from .source import Source

# Weights with more elements are computed in row chunks (16 MB of float32 each).
CHUNK_ELEMENTS = 1 << 22

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class Recipe:
    """How each output tensor is made from the source (nothing computed up front).

    weights, config: the source's; plan: `quant.plan_weights` on them (the
    weights, dtype and quantization). keep_norms: no fold, the norms kept
    (all-ones ones restored on a folded source), for mlx-lm's class. compat: a fold keeps all-ones norm
    tensors. output: for a file (`convert`): a quantized source taken as
    stored keeps its tensors' dtypes, and a folded source's config records
    `compat`. A folded source is never folded again.
    """

    def __init__(
        self, weights, config, plan, keep_norms=False, compat=False, output=False
    ):
        # Not a copy: release() empties the caller's dict, so tensors go once done.
        self.src, self.src_config = weights, config
        self.gains: Weights = {}  # linear module -> the norm gain folded into it
        self.hessians: gptq.Hessians = {}  # module -> GPTQ Hessian (fold basis)
        self._hinv: Weights = {}
        self.as_stored = plan.as_stored
        self.out_dtype, self.qspec = plan.dtype, plan.qspec
        # Stored quantized tensors are not cast (mlx-lm's load casts nothing):
        # activations follow mlx-lm's promotion, at least the plan's dtype. A
        # GGUF's are (`cast_stored`: llama.cpp computes in float32).
        self._cast = not self.as_stored or (plan.cast_stored and not output)
        self.act_dtype = plan.dtype
        if self.as_stored:
            self.act_dtype = quant.activation_dtype(weights, plan.dtype)
        # Stored norms loaded widened to it (exact), so stock's promote alike.
        self._widen = self.as_stored and not output
        # A GGUF's K-quants, read in float32: written in the file's float16,
        # loaded in the activations' dtype (docs/design.md section 2i).
        file_dtype = kquant.file_dtype(config)
        self._written = file_dtype if output or not file_dtype else self.act_dtype
        self._float_read = set(kquant.floats_of(config) or ())
        covered = models.is_covered(config)
        self._arch = models.architecture(config) if covered else None
        self._uncast = self._arch.uncast if covered else ()
        self._stock = None  # what calibration runs
        if fold.is_folded(config):  # cast, quantized or dequantized, never folded
            self._refolded(plan, keep_norms or compat, compat if output else None)
        elif self.as_stored:
            self.config = config if keep_norms else quant.mark_norm_gains(config)
            self._finish(self.src)
        elif keep_norms:
            self.config = plan.config
            self._finish(plan.weights)
        else:
            arch = self._arch  # folding: a family FlashNorm covers
            for norm, linears in arch.norm_pairs(config, weights):
                stored = weights[f"{norm}.weight"]
                # Stock rounds Gemma's 1 + w at the run's dtype, not at the
                # checkpoint's (docs/design.md section 2h).
                if arch.gain_offset:
                    stored = stored.astype(self.out_dtype)
                gain = arch.folded_gain(config, norm, stored)
                self.gains.update({m: gain for m in linears})
            # Lazy: only its keys, config and small (1-D) tensors are evaluated.
            floats = fold.map_floats(plan.weights, lambda v: v.astype(mx.float32))
            self._stock = (plan.weights, plan.config)
            folded, self.config = fold.fold_norms(floats, plan.config, compat=compat)
            self._finish(folded)

    def _refolded(self, plan, unit_norms: bool, compat: Optional[bool]):
        unit = fold.restore_unit_norms if unit_norms else fold.drop_unit_norms
        # With unit gains a folded checkpoint is stock's function: calibrate on it.
        self._stock = (fold.restore_unit_norms(self.src, self.src_config), plan.config)
        self.config = copy.deepcopy(plan.config)
        if compat is not None:  # a file says whether it keeps all-ones norms
            self.config[fold.MARKER]["compat"] = compat
        self._finish(unit(self.src if self.as_stored else plan.weights, plan.config))

    def _finish(self, out: Weights) -> None:
        """The output's tensor names, its config's quantization block, and the
        tensors made whole (all but the 2-D weights, which `module` makes)."""
        if not self.as_stored:
            self.config = {
                k: v
                for k, v in self.config.items()
                if k not in ("quantization", "quantization_config")
            }
        if self.qspec:
            self.config = quant.with_quantization(self.config, self.qspec)
        # 2-D weights are made per module (row chunks if large), the rest as is;
        # a quantized weight's scales and biases come with it (those of one
        # that is not 2-D, mlx-lm's stacked experts as stored, as is too).
        self.order = [k for k in out if not _packs_matrix(k, out)]
        self.modules = [
            k[: -len(".weight")] for k in self.order if _is_matrix(k, out[k])
        ]
        self.small = {
            k: self._small(k, out[k]) for k in self.order if not _is_matrix(k, out[k])
        }

    def _out(self, v: mx.array) -> mx.array:
        """A float tensor in the output dtype (as stored in a file: unchanged).
        One already in it is returned itself (build_model tells the tensors a
        model takes unchanged by identity)."""
        if self._cast and mx.issubdtype(v.dtype, mx.floating):
            return v if v.dtype == self.out_dtype else v.astype(self.out_dtype)
        return v

    def _stored(self, key: str, v: mx.array) -> mx.array:
        """`_out`, but a GGUF's K-quants (scales and biases, float-read weights),
        read in float32, written in the file's float16 (loaded: `_written`)."""
        module, _, suffix = key.rpartition(".")
        narrow = suffix in ("scales", "biases") or module in self._float_read
        written = self._written
        if (
            narrow
            and v.dtype == mx.float32
            and written is not None
            and written != v.dtype
        ):
            return v.astype(written)
        return self._out(v)

    def _small(self, k: str, v: mx.array) -> mx.array:
        if self._uncast and k.endswith(self._uncast):
            return v
        if self._widen and quant.is_norm(k, v) and v.dtype != self.act_dtype:
            return v.astype(self.act_dtype)
        return self._out(v)

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
        """Output tensors of one module for a range of its rows (all ops are
        row-wise): the one transform loading and `convert` both run."""
        keys = [f"{module}.{s}" for s in ("weight", "scales", "biases")]
        whole = rows == slice(None)  # the source's own tensors, not slices of them
        part = {
            k: self.src[k] if whole else self.src[k][rows]
            for k in keys
            if k in self.src
        }
        if self.as_stored:
            return {k: self._stored(k, v) for k, v in part.items()}
        if f"{module}.scales" in part:
            part, _ = quant.dequantize_weights(part, self.src_config, mx.float32)
        part = fold.map_floats(part, lambda v: v.astype(mx.float32))
        if module in self.gains:
            part = fold.fold_into(part, self.gains[module], module, self._arch)
        q = (self.qspec or {}).get(module)
        # Calibration measured every linear; GPTQ takes the ones quantized.
        by_gptq = q and module in self.hessians
        gptq_weight = part.pop(f"{module}.weight") if by_gptq else None
        part = fold.map_floats(part, lambda v: v.astype(self.out_dtype))
        if not q:
            return part
        if gptq_weight is not None:  # float32 in; rows are independent in GPTQ
            if module not in self._hinv:  # once per module, row chunks share it
                self._hinv[module] = gptq.inverse_cholesky(self.hessians[module])
            hinv = self._hinv[module]
            if gptq_weight.ndim == 3:  # stacked experts: the rows are experts
                hinv = hinv[rows]
            out = gptq.quantize_weight(
                gptq_weight, None, q["bits"], q["group_size"], self.out_dtype, hinv
            )
        else:
            out = quant.rtn(part.pop(f"{module}.weight"), q)
        return {**part, **{f"{module}.{k}": v for k, v in out.items()}}

    def tensors(self) -> Weights:
        """Every output tensor, lazily, in the source's order: what loading
        builds a model on (`convert` computes the same, module by module)."""
        modules, out = set(self.modules), {}
        for key in self.order:
            module = key[: -len(".weight")]
            if key.endswith(".weight") and module in modules:
                out.update(self.module(module))
            elif key in self.small:
                out[key] = self.small[key]
        return out

    def release(self, module: str) -> None:
        """Drop the source tensors of a module once its output is computed."""
        for s in ("weight", "scales", "biases"):
            self.src.pop(f"{module}.{s}", None)
        self._hinv.pop(module, None)
        self.hessians.pop(module, None)


def _is_matrix(key: str, value: mx.array) -> bool:
    # A linear's weight: 2-D, or 3-D for stacked experts (experts, out, in).
    return key.endswith(".weight") and value.ndim in (2, 3)


def _packs_matrix(key: str, out: Weights) -> bool:
    """`key` is the scales or biases of a quantized 2-D weight in `out`."""
    if not key.endswith((".scales", ".biases")):
        return False
    weight = key.rsplit(".", 1)[0] + ".weight"
    return weight in out and _is_matrix(weight, out[weight])


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
    quantized_way: str = "stored",
    compat: bool = False,
    q_method: str = gptq.DEFAULT_METHOD,
    calibration: gptq.Calibration = gptq.Calibration(),
    progress: bool = False,
    bar=None,
    on_layer: Optional[Callable[[int, int], None]] = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    on_stage: Optional[Callable[[str], None]] = None,
    on_step: Optional[Callable[[str], None]] = None,
    on_slow: estimate.Say = None,
) -> Tuple[Weights, dict]:
    """(weights, config) of the checkpoint for `source`'s `weights`, a dict this
    call empties as it goes (pass a copy to keep yours).

    q_method: "gptq" (fold-aware, calibrated on `calibration` windows of offline
    text; needs a tokenizer), "rtn", or "auto" (`gptq.resolve`); recorded in the config's flashnorm
    block. bar: a live rich Progress to add tasks to (else one of our own when
    `progress`). on_layer(i, n): called after layer group i of n.
    on_stage(text): told as each stage ends (calibration, all layer groups);
    on_step(text): where the work is within a stage, before each of its steps.
    on_slow(line): told once, GPTQ on the CPU alone, after the first
    calibration batch or layer group, where what is left would take more
    than `estimate.threshold()`, naming --q-method rtn as the fast choice.
    """
    stage = on_stage or (lambda text: None)
    step = on_step or (lambda text: None)
    q_method = gptq.resolve(q_method)
    recipe = _recipe(source, weights, dtype, quantize, quantized_way, compat, q_method)
    slow = None  # GPTQ's column loop is minutes where RTN is seconds on the CPU
    if q_method == "gptq" and recipe.qspec:
        slow = _Slow(on_slow) if mx.default_device() == mx.cpu else None
        _calibrate(recipe, source, calibration, bar, progress, step, stage, slow)
    recipe.drop_calibration_source()  # source tensors go as modules are done
    # Nothing is folded in a quantized checkpoint kept as stored: it is copied.
    verb = "copying" if recipe.as_stored else "folding"
    with _bar(bar, progress, f"[bold]{verb}[/] {{task.description}}") as b:
        if slow:
            on_layer = slow.layers(on_layer)
        done = _compute(recipe, b, on_layer, chunk_elements, step)
    groups = len(layer_groups(recipe.order))
    if recipe.as_stored:
        stage(f"copied {groups} layer groups as stored")
    else:
        stage(f"folded{' and quantized' if recipe.qspec else ''} {groups} layer groups")
    return done, recipe.config


def _recipe(source, weights, dtype, quantize, quantized_way, compat, q_method):
    """The fold's Recipe for `weights`, once they are known to fit the config and
    the flags to fit the source."""
    # Before any work: weights that do not fit the config would fold into a
    # checkpoint nothing can load (builds ask only once they fail, build.py).
    why = mismatch(shapes_of(weights), source.config, config_name(source))
    if why:
        raise LoadError(f"{source.name}: {why}")
    plan = quant.plan_weights(
        weights, source.config, dtype, quantize, quantized_way, True, q_method
    )
    if plan.as_stored and dtype is not None:
        raise LoadError(
            "--dtype would round the stored scales and norm gains: a quantized "
            "source is written as stored; pass --dequantize or --requantize to "
            "fold it and choose a dtype"
        )
    recipe = Recipe(weights, source.config, plan, compat=compat, output=True)
    if recipe.qspec:  # until calibration says otherwise: round-to-nearest
        recipe.config[fold.MARKER]["quantization_method"] = {"method": "rtn"}
    return recipe


def _calibrate(recipe, source, calibration, bar, progress, step, stage, slow):
    """GPTQ's calibration pass over `calibration` windows, with its bar."""
    with _bar(bar, progress, "[bold]calibrating GPTQ on[/] {task.description}") as b:
        n = calibration.num_seqs
        task = b.add_task("text windows", total=n)
        advance = counter(b, task, n, step, "calibrating GPTQ: {done}/{total} windows")
        advance(0)
        if slow:
            advance = slow.watch(advance, n, "calibration windows")
        recipe.calibrate(source.tokenizer, calibration, advance)
        stage(
            f"calibrated GPTQ on {calibration.num_seqs} windows of "
            f"{calibration.seq_len} tokens"
        )


class _Slow:
    """GPTQ's one estimate: after the first calibration batch, else after the
    first layer group, what is left of its stage at that pace."""

    WHAT = "GPTQ on the CPU"
    HINT = "--q-method rtn is the fast choice (round-to-nearest: seconds, less exact)"

    def __init__(self, say: estimate.Say):
        self.say, self.told = say, False

    def _tell(self, piece: str, seconds: float, left: float, stage="") -> None:
        what = f"{self.WHAT}, {stage}" if stage else self.WHAT
        then = "then every layer; " if stage else ""  # calibration alone measured
        line = estimate.projection(piece, seconds, left, what, then + self.HINT)
        self.told = self.told or estimate.tell(self.say, line)

    def watch(self, advance: Callable[[int], None], total: int, what: str):
        start, done = time.perf_counter(), [0]

        def watched(n: int) -> None:
            advance(n)
            done[0] += n
            if done[0] == n and n and not self.told:  # the first batch
                piece = f"the first {n} {what}"
                left = (total - n) / n
                self._tell(piece, time.perf_counter() - start, left, "calibrating")

        return watched

    def layers(self, on_layer):
        start = time.perf_counter()

        def watched(i: int, n: int) -> None:
            if i == 0 and not self.told:
                self._tell("layer group 1", time.perf_counter() - start, n - 1)
            if on_layer is not None:
                on_layer(i, n)

        return watched


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
    # A "row" is axis 0: an output row, or a whole expert of stacked experts.
    per_row = math.prod(src.shape[1:]) * (16 if src.dtype == mx.uint32 else 1)
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
