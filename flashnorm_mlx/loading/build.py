"""Build stock, FlashNorm or nonorm models on one checkpoint's weights.

`build_model` builds any mode on a `Source` (source.py). Weights, dtype and
quantization are decided once by `quant.plan_weights`, shared with `convert`
and nonorm; every mode but nonorm is built on the tensors `recipe.Recipe`
makes, the ones `convert` writes.
"""

import contextlib
import dataclasses
import io
from typing import List, Optional, Set, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import engine as engines
from .. import fold, models, quant
from ..errors import LoadError
from ..modes import Mode
from ..parallel import sharding
from . import gguf_kquant, nonorm, stacks, stock_fused
from .adapters import adapted_quantization
from .recipe import Recipe
from .shapes import config_name, mismatch, shapes_of
from .source import Source, folder_weights
from .wrappers import rewrap

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def build_model(
    source: Source,
    mode: Mode,
    dtype: Optional[mx.Dtype] = None,
    quantize: Optional[Tuple[int, int]] = None,
    quantized_way: str = "stored",
    notes: Optional[List[str]] = None,
    group: Optional[mx.distributed.Group] = None,
    engine: Optional[str] = None,
) -> Tuple[nn.Module, dict]:
    """Build the `mode` model on `source`'s weights; returns (model, its
    config). `mode`: a modes.Mode, settled where the model was read
    (models.run_mode). quantize=(bits, group_size): quantize a float source
    after folding; quantized_way: how a quantized source is taken
    (quant/plan.py). `notes` collects a line for the user where the weights
    were not taken as the flags' obvious reading suggests. `group`: split the
    model over it (sharding.shard_model) before its weights are evaluated,
    layer by layer (ShardError where it cannot be split). `engine`: "eager" or
    "compiled" (engine.py; None: `engine.default()`), the same for every mode.
    """
    engine, covered = _settle(source.config, mode, engine)
    # A folder's weights opened again for this build: what it evaluates is freed
    # once in the model, where the caller's Source would keep every source tensor.
    source_weights = _own_handles(source)
    quantize, adapted = adapted_quantization(source, quantize, quantized_way)
    if adapted and notes is not None:
        notes.append(adapted)
    shapes = shapes_of(source_weights)
    try:
        plan = quant.plan_weights(
            source_weights,
            source.config,
            dtype,
            quantize,
            quantized_way,
            read_whole=source.read_whole and source_weights is source.weights,
        )
        by_mlx_lm = quantize if not covered and plan.qspec else None
        if by_mlx_lm:  # -q on a family FlashNorm does not cover: mlx-lm's own
            plan = dataclasses.replace(plan, qspec=None)
        model, config, as_is = _construct(
            source, source_weights, plan, mode, notes, group, by_mlx_lm, dtype
        )
    except (LoadError, ValueError, KeyError, IndexError):
        # Weights that do not fit the config: named as the checkpoint names them.
        why = mismatch(shapes, source.config, config_name(source))
        if why:
            raise LoadError(f"{source.name}: {why}") from None
        raise
    kquant = gguf_kquant.build_note(source, plan, mode, quantized_way, quantize)
    if notes is not None:
        notes.extend(note for note in (plan.note, kquant) if note)
    fused = mode.stacks
    # The caller's handles share the stacked rows only where the build read
    # them (GGUF, read whole): a folder's own fresh handles leave them lazy,
    # and views of the model's tensors would keep its buffers past its life.
    shared_handles = source_weights is source.weights
    del source_weights, plan  # from here the model alone holds the (lazy) weights
    if group is not None:  # quantized first: mlx shards QuantizedLinear as is
        arch = models.architecture(config) if covered else None
        sharding.shard_model(model, group, source.name, own=not covered, arch=arch)
    share = shared_handles and bool(as_is) and group is None and not fused
    _evaluate(model, config, source, as_is, share and covered)
    if fused:  # each rank's own rows, after sharding
        stacks = stock_fused.groups(models.architecture(config))
        stock_fused.fuse_projections(model, stacks)
    mx.eval(model.parameters())
    return engines.run_on(model, engine), config


def _settle(config: dict, mode: Mode, engine: Optional[str]) -> Tuple[str, bool]:
    """(the engine, whether FlashNorm covers the model) of a build: a mode
    the family cannot run said in one line, and the eager engine for a model
    FlashNorm does not cover."""
    if not isinstance(mode, Mode):  # names are settled once: models.run_mode
        raise TypeError(
            f"build_model takes a modes.Mode (modes.MODES[name]), not {mode!r}"
        )
    covered = models.is_covered(config)
    if mode.needs_cover:  # a library caller's mode the family cannot run
        if not covered:
            raise models.not_covered(config, f"--mode {mode}")
        models.architecture(config).require(mode.name, config["model_type"])
    try:
        engine = engines.resolve(engine)
    except ValueError as e:
        raise LoadError(str(e)) from None
    if not covered:  # the compiled step is traced for the classes it knows
        engine = "eager"  # (models.stock_note says so)
    return engine, covered


def _construct(
    source, source_weights, plan, mode: Mode, notes, group, by_mlx_lm, dtype
):
    """(model, config, the source tensors it takes unchanged) of `mode`, its
    weights still lazy: nonorm calibrated whole, every other mode on the
    tensors `convert` would write (recipe.py), its activations in mlx-lm's
    dtype (`dtype`: the one asked)."""
    if mode.calibrated:  # the norm-removed speed bound, for `bench`
        return (*nonorm.build_nonorm(plan), set())  # calibrated whole, then split
    recipe = Recipe(source_weights, source.config, plan, keep_norms=not mode.ours)
    # mlx-lm's own model of a wrapper folder is its wrapper class.
    wrapper = source.wrapper if mode.is_mlx_lms else None
    model, config, as_is = _instantiate(
        source.name, recipe, mode.ours, wrapper, notes, group is None
    )
    _set_activations(model, recipe.act_dtype, mode.ours)
    _dtype_notes(notes, dtype, plan, recipe.act_dtype)
    del recipe
    if by_mlx_lm:
        model, config = _mlx_lm_quantized(model, config, *by_mlx_lm)
    return model, config, as_is


def _evaluate(model, config: dict, source: Source, as_is: Set[str], share: bool):
    """Layer by layer, so one layer's source and output tensors coexist at a
    time (a sharded rank's full tensors freed once cut), not the model's;
    `share`: each layer's unchanged tensors are the source's own rows."""
    arch = models.architecture(config) if share else None
    for i, layer in enumerate(getattr(model, "layers", [])):
        mx.eval(layer.parameters())
        if share:
            pairs = arch.layer_pairs(config, i)
            _share_rows(layer, arch.layer.format(i=i), pairs, source.weights, as_is)


def _mlx_lm_quantized(model, config: dict, bits: int, group_size: int):
    """(model, config) quantized as `mlx_lm.convert -q` quantizes it, with its
    class's own `quant_predicate` (some families keep layers at 8 bits)."""
    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(io.StringIO()):  # its bits-per-weight line
        return quantize_model(model, config, group_size, bits)


def _share_rows(layer, prefix: str, pairs, weights: dict, as_is: Set[str]) -> None:
    """Point `weights`' tensors that `layer` stacked unchanged (q|k|v and
    gate|up of a quantized source as stored) at the stacked tensor's rows: the
    same values, held once, where the Source (GGUF, read whole) would keep a
    second copy of them for as long as it lives."""
    params = dict(tree_flatten(layer.parameters()))
    for pair in (p for p in pairs if p.in_order):  # the layer's own pairs
        for suffix in ("weight", "scales", "biases"):
            keys = [f"{prefix}.{part}.{suffix}" for part in pair.parts]
            whole = params.get(f"{pair.fused}.{suffix}")
            if len(keys) < 2 or whole is None or not as_is.issuperset(keys):
                continue
            parts = [weights[k] for k in keys]
            if sum(p.shape[0] for p in parts) != whole.shape[0] or any(
                (p.dtype, p.shape[1:]) != (whole.dtype, whole.shape[1:]) for p in parts
            ):
                continue
            start = 0
            for k, p in zip(keys, parts):
                weights[k] = whole[start : start + p.shape[0]]  # a view once evaluated
                start += p.shape[0]
            mx.eval([weights[k] for k in keys])


def _instantiate(
    name: str, recipe: Recipe, ours: bool, wrapper=None, notes=None, joinable=True
):
    """(model, config, keys of the source tensors it takes unchanged) of our
    class (`ours`) or mlx-lm's on the recipe's tensors; weights that do not
    fit the config are one LoadError line. wrapper: a multimodal wrapper's
    config (stock: mlx-lm's wrapper class around the text model; the config
    returned stays the text model's, which the rest of the build reads).
    joinable: the model may run a mixed stack's members apart (not sharded)."""
    tensors, config = recipe.tensors(), recipe.config
    if ours:  # a Q5_0 q|k with a Q8_0 v lifted to one setting, a Q4_K q|k
        # with a Q6_K v (read as float) run as stored (stacks.py)
        tensors, config, added = stacks.common_settings(
            tensors, config, recipe.out_dtype, join=joinable
        )
        if added and notes is not None:
            notes.append(stacks.note(added))
    as_is = {k for k, v in tensors.items() if recipe.src.get(k) is v}
    norm_gains = recipe.as_stored and not fold.is_folded(config) and ours
    built = config
    if wrapper is not None:
        built, tensors = rewrap(wrapper, config, tensors)
    # A family FlashNorm does not cover: its config checked for types alone
    # (checks.py), so mlx-lm's class may fail on a value in any way.
    bad = (ValueError, KeyError) if models.is_covered(config) else Exception
    try:
        model = models.instantiate(built, tensors, ours, norm_gains)
        return model, config, as_is
    except bad as e:  # weights or config that do not fit
        # mlx-lm lists missing parameters on lines of their own: keep one line.
        why = " ".join(str(e).split()) or type(e).__name__
        raise LoadError(f"{name}: {why}") from None


def _own_handles(source: Source) -> dict:
    """The weights of a folder source, its checked files (`Source.files`)
    opened again, lazily, for one build alone: the tensors it reads (to fold,
    stack or cut a shard from) are then freed once used, where `source`'s own
    (shared) handles would keep them. Anything else (GGUF, which mx.load reads
    whole; weights not as the files hold them, `folder=None`): `source`'s."""
    if source.folder is None or not source.files or source.adapter is not None:
        return source.weights  # not the files'
    try:
        fresh = folder_weights(source.files, source.config, source.wrapper)
    except LoadError:
        return source.weights
    same = fresh.keys() == source.weights.keys() and all(
        (fresh[k].shape, fresh[k].dtype) == (v.shape, v.dtype)
        for k, v in source.weights.items()
    )
    return fresh if same else source.weights


def _set_activations(model: nn.Module, dtype: mx.Dtype, ours: bool) -> None:
    """Our embeddings cast to `dtype`, the dtype stock's first norm promotes
    them to (its norms were loaded in it); the model records it for
    `model_dtype`."""
    model.__dict__["_act_dtype"] = dtype
    if ours:
        for _, m in model.named_modules():
            if hasattr(type(m), "act_dtype"):
                m.act_dtype = dtype


def _dtype_notes(notes, given, plan, act: mx.Dtype) -> None:
    """One line where --dtype was not what the activations run in (stored
    quantized weights are not cast), and one where they run slow here."""
    if notes is None:
        return
    name = str(act).replace("mlx.core.", "")
    if given is not None and plan.as_stored and given != act:
        notes.append(
            f"--dtype {str(given).replace('mlx.core.', '')}: the stored quantized "
            f"weights and norms are not cast, so activations run in {name}, as "
            "mlx-lm's do on this checkpoint (--dequantize or --requantize to "
            "choose the weights' dtype)"
        )
    slow = quant.slow_note(act)
    if slow and slow not in notes:
        notes.append(slow)


def model_dtype(model: nn.Module) -> str:
    """The compute dtype: the activations' where loading set it, else the
    quantization scales' dtype, else the first float weight's."""
    act = model.__dict__.get("_act_dtype")
    if act is not None:
        return str(act).replace("mlx.core.", "")
    params = tree_flatten(model.parameters())
    floats = [(k, v) for k, v in params if mx.issubdtype(v.dtype, mx.floating)]
    scales = [v for k, v in floats if k.endswith(".scales")]
    v = scales[0] if scales else floats[0][1]
    return str(v.dtype).replace("mlx.core.", "")


def bits_per_weight(model: nn.Module) -> float:
    """Parameter bits per weight, as mlx-lm's `compute_bits_per_weight` but over
    parameters alone (that one also counts buffers such as our RoPE angles)."""
    from mlx_lm.utils import get_total_parameters

    return 8 * weight_bytes(model) / get_total_parameters(model)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters a forward pass reads (quantized packs and scales included)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
