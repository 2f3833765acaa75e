"""Write a folded (and optionally quantized) checkpoint that loads without folding.

A quantized source (unless --dequantize, --requantize or -q) is written as
stored instead: its tensors unchanged, its config marked (`fold.mark_norm_gains`)
so that FlashNorm applies the norm gains in its kernels, as it does when it
runs the source itself. What follows is the folding path.

The pipeline is the one `loading.build_model` runs in memory, so a converted
checkpoint gives the same logits as folding at load time in the same dtype (bit
for bit when quantized): dequantize a quantized source to float32, fold the norm
gains in float32 (`fold.fold_gain`; `fold.fold_norms` gives the config marker and
the norm tensors), cast to the output dtype, then `mx.quantize` every
Linear/Embedding weight whose input width the group size divides, exactly as
`nn.quantize` (and mlx-lm's convert) would. Tensors keep their Hugging Face
names (q/k/v and gate/up stay separate; our Llama fuses them at load), so
`--compat` checkpoints (all-ones norms kept) also run in stock mlx-lm.

The work goes one layer and one module at a time, large weights (the embedding)
in row chunks, and each source tensor is released once its output exists, so
peak memory stays near one copy of the model. The files go into a temporary
sibling folder that is renamed into place at the very end.
"""

import copy
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx

from . import fold, gptq, quant
from .progress import progress_bar
from .errors import LoadError
from .source import Source, read_source, resolve

Weights = Dict[str, mx.array]

# Files of a Hugging Face folder that make up its tokenizer (copied verbatim).
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
    "generation_config.json",
)

# Weights with more elements are computed in row chunks (16 MB of float32 each).
CHUNK_ELEMENTS = 1 << 22

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class Recipe:
    """How each output tensor is made from the source (nothing computed up front).

    quantize=(bits, group_size): quantize the folded float weights with these
    settings (a quantized source is dequantized first). Without it, a quantized
    source is taken as `quantized` says (quant.py): "stored" writes its tensors
    unchanged, marked for FlashNorm to apply the norm gains in its kernels;
    "dequantize" folds it in float; "requantize" folds and quantizes again with
    its own settings. A folded source is accepted only when float and asked to
    be quantized or cast: it is never folded again, and a folded quantized
    tensor is never dequantized and requantized (that would quantize twice).
    """

    def __init__(self, weights, config, quantize, dtype, quantized, compat):
        self.src, self.src_config = dict(weights), config
        self.gains: Weights = {}  # linear module -> the norm gain folded into it
        self.hessians: gptq.Hessians = {}  # module -> GPTQ Hessian (fold basis)
        self._hinv: Weights = {}
        self.as_stored = False
        if fold.is_folded(config):
            self._refolded(quantize, dtype, compat)
            return
        # The same decision as loading (quant.plan_weights), for a file to write.
        plan = quant.plan_weights(
            weights, config, dtype, quantize, quantized, output=True
        )
        if plan.stored_quantized:
            self._as_stored(dtype)
            return
        self.out_dtype, self.qspec = plan.dtype, plan.qspec
        for norm, linears in fold.norm_pairs(config, weights):
            self.gains.update({m: weights[f"{norm}.weight"] for m in linears})
        # Lazy: only its keys, config and small (1-D) tensors are ever evaluated.
        floats = fold.map_floats(plan.weights, lambda v: v.astype(mx.float32))
        self._stock = (plan.weights, plan.config)  # what calibration runs
        folded, self.config = fold.fold_norms(floats, plan.config, compat=compat)
        self._finish(folded)

    def _refolded(self, quantize, dtype, compat):
        if fold.is_quantized(self.src):
            raise LoadError(
                "source is already folded and quantized: nothing to fold, and "
                "requantizing a folded quantized checkpoint would quantize twice"
            )
        if quantize is None and dtype is None:
            raise LoadError(
                "source is already folded (config.json has 'flashnorm'); "
                "pass -q or --dtype to quantize or cast it"
            )
        unit = fold.restore_unit_norms if compat else fold.drop_unit_norms
        weights = unit(self.src, self.src_config)
        # With unit gains a folded checkpoint is stock's function: calibrate on it.
        stock = fold.restore_unit_norms(self.src, self.src_config)
        self._stock = (stock, self.src_config)
        self.config = copy.deepcopy(self.src_config)
        self.config[fold.MARKER]["compat"] = compat
        self.qspec = quant.uniform_qspec(weights, *quantize) if quantize else None
        self.out_dtype = dtype or quant.source_dtype(weights)
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
            part, _ = fold.dequantize_weights(part, self.src_config, mx.float32)
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


# --- writing -----------------------------------------------------------------


def _write_weights(
    dst: Path, weights: Weights, config: dict, max_shard_gb: int
) -> List[str]:
    """safetensors shards plus model.safetensors.index.json, as mlx-lm's save_model."""
    from mlx_lm.utils import make_shards

    shards = make_shards(weights, max_shard_gb)
    name = (
        "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    )
    index = {
        "metadata": {
            "total_size": sum(v.nbytes for v in weights.values()),
            "total_parameters": _parameter_count(weights, config),
        },
        "weight_map": {},
    }
    files = []
    for i, shard in enumerate(shards):
        fname = name.format(i + 1, len(shards))
        mx.save_safetensors(str(dst / fname), shard, metadata={"format": "mlx"})
        index["weight_map"].update({k: fname for k in shard})
        files.append(fname)
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return files


def _parameter_count(weights: Weights, config: dict) -> int:
    """Parameters before packing: a b-bit weight packs 32 / b values per uint32."""
    n = 0
    for k, v in weights.items():
        module = k.rsplit(".", 1)[0]
        if f"{module}.scales" not in weights:
            n += v.size
        elif k.endswith(".weight"):
            n += v.size * 32 // fold.quant_params(config, module)["bits"]
    return n


def _has_tokenizer_files(folder: Optional[Path]) -> bool:
    return folder is not None and any(
        p.is_file() for pat in TOKENIZER_PATTERNS[:-1] for p in folder.glob(pat)
    )


def _write_tokenizer(dst: Path, source: Source, tokenizer_dir: Optional[Path]) -> None:
    """Copy a folder's tokenizer files; save a GGUF's tokenizer with transformers."""
    folder = tokenizer_dir or source.folder
    if _has_tokenizer_files(folder):
        for pattern in TOKENIZER_PATTERNS:
            for p in sorted(folder.glob(pattern)):
                if p.is_file():
                    shutil.copy2(p, dst / p.name)
    elif source.tokenizer is not None:
        source.tokenizer.save_pretrained(str(dst))
    # mlx-lm reads extra end-of-sequence ids from here.
    gen = source.folder / "generation_config.json" if source.folder else None
    if gen is not None and gen.is_file() and not (dst / gen.name).exists():
        shutil.copy2(gen, dst / gen.name)


# --- the conversion ----------------------------------------------------------


def convert(
    source: Union[Source, str, None],
    out_dir: Union[str, Path],
    quantize: Optional[Tuple[int, int]] = None,
    dtype: Optional[mx.Dtype] = None,
    quantized: str = "stored",
    compat: bool = False,
    force: bool = False,
    progress: bool = True,
    tokenizer: Optional[str] = None,
    on_layer: Optional[Callable[[int, int], None]] = None,
    max_shard_gb: int = 5,
    chunk_elements: int = CHUNK_ELEMENTS,
    q_method: str = gptq.DEFAULT_METHOD,
    calibration: gptq.Calibration = gptq.Calibration(),
) -> dict:
    """Fold (and quantize) `source` into the checkpoint folder `out_dir`.

    source: a `loading.Source`, or a MODEL string (None: the embedded default)
        that is read here; then its tensors are released layer by layer.
    tokenizer: a folder or repo id whose tokenizer files to ship (OpenELM).
    on_layer(i, n): called after layer group i of n is computed (tests inject
        failures here). max_shard_gb: 0 writes one tensor per shard.
    chunk_elements: a weight with more elements is computed in row chunks.
    q_method: "gptq" (default: fold-aware GPTQ, calibrated on `calibration`
        windows of offline text; needs a tokenizer) or "rtn" (round-to-nearest);
        recorded in config.json's "flashnorm" block.
    Refuses an existing out_dir unless force and it is a checkpoint folder
    (`check_output`); a failure leaves neither out_dir, the temporary folder
    nor a created parent behind. Returns a summary dict.
    """
    shown = Path(out_dir)
    if not str(out_dir).strip():
        raise LoadError("the output folder (-o) is empty")
    out = Path(os.path.abspath(shown.expanduser()))
    source_path = source.folder if isinstance(source, Source) else resolve(source)
    check_output(out, shown, force, source_path)
    tokenizer_dir = resolve(tokenizer) if tokenizer else None
    if not isinstance(source, Source):
        owned = read_source(source, tokenizer=tokenizer)
        weights, owned.weights = owned.weights, {}  # let each tensor go once written
        source = owned
    else:
        weights = source.weights

    recipe = Recipe(weights, source.config, quantize, dtype, quantized, compat)
    del weights
    if q_method == "gptq" and recipe.qspec:
        gptq.check_qspec(recipe.qspec)
        with progress_bar(
            progress, "[bold]calibrating GPTQ on[/] {task.description}"
        ) as bar:
            task = bar.add_task("text windows", total=calibration.num_seqs)
            recipe.calibrate(
                source.tokenizer, calibration, lambda n: bar.advance(task, n)
            )
    recipe.drop_calibration_source()  # source tensors go as modules are written
    config = recipe.config
    created = _missing_parents(out)  # removed again if the conversion fails
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
        # mkdtemp makes 0700; the checkpoint gets the umask's permissions.
        os.chmod(tmp, 0o777 & ~_umask())
    except OSError as e:
        _remove_dirs(created)
        raise LoadError(f"cannot create {shown}: {e.strerror or e}") from None
    try:
        done = _compute(recipe, progress, on_layer, chunk_elements)
        del recipe
        files = _write_weights(tmp, done, config, max_shard_gb)
        _write_config(tmp, config)
        _write_tokenizer(tmp, source, tokenizer_dir)
        summary = _summary(shown, done, config, files)
        del done
        _replace(tmp, out, shown, force)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise LoadError(f"cannot write {shown}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise
    return summary


def is_checkpoint(folder: Path) -> bool:
    """A model checkpoint folder: config.json plus safetensors weights."""
    return (
        folder.is_dir()
        and not folder.is_symlink()
        and (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


def check_output(out: Path, shown: Path, force: bool, source: Optional[Path]) -> None:
    """Refuse an output that exists (unless force and it is a checkpoint), that
    holds the source, or that holds the folder we run in: --force must never
    delete anything but an earlier checkpoint."""
    if source is not None:
        src = source.resolve()
        if out.resolve() == src or out.resolve() in src.parents:
            raise LoadError(f"{shown} holds the source model; write elsewhere")
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise LoadError(
            f"{shown} already exists (--force replaces a model checkpoint folder)"
        )
    cwd = Path.cwd().resolve()
    if out.resolve() == cwd or out.resolve() in cwd.parents:
        raise LoadError(f"{shown} holds the current folder; refusing to replace it")
    if not is_checkpoint(out):
        raise LoadError(
            f"{shown} is not a model checkpoint (config.json plus *.safetensors); "
            "--force replaces only those, so it is left as it is"
        )


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def _missing_parents(out: Path) -> List[Path]:
    """Folders above out that do not exist yet, deepest first."""
    missing, p = [], out.parent
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing


def _remove_dirs(dirs: List[Path]) -> None:
    for d in dirs:  # deepest first; only if still empty
        try:
            d.rmdir()
        except OSError:
            break


def _compute(
    recipe: Recipe,
    progress: bool,
    on_layer: Optional[Callable[[int, int], None]],
    chunk_elements: int,
) -> Weights:
    """Evaluate the checkpoint one layer, one module at a time (bounded memory)."""
    done: Weights = {}
    modules = set(recipe.modules)
    groups = layer_groups(recipe.order)
    with progress_bar(progress, "[bold]folding[/] {task.description}") as bar:
        task = bar.add_task("", total=len(groups))
        for i, (name, keys) in enumerate(groups):
            bar.update(task, description=name)
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


def _write_config(dst: Path, config: dict) -> None:
    from mlx_lm.utils import save_config

    save_config(copy.deepcopy(config), dst / "config.json")


def _replace(tmp: Path, out: Path, shown: Path, force: bool) -> None:
    """Rename tmp to out; with force, the old out goes only after that succeeded."""
    old = None
    if out.exists() or out.is_symlink():
        if not force:
            raise LoadError(f"{shown} already exists (pass --force to replace it)")
        old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
        try:
            os.replace(out, old / out.name)
        except BaseException:  # e.g. out is a mount point (EBUSY): no .old- left
            old.rmdir()
            raise
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None:
            os.replace(old / out.name, out)
            old.rmdir()
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _summary(out: Path, weights: Weights, config: dict, files: List[str]) -> dict:
    q = config.get("quantization")
    return {
        "path": str(out),
        "files": files,
        "tensors": len(weights),
        "bytes": sum(v.nbytes for v in weights.values()),
        "dtype": str(quant.source_dtype(weights)).split(".")[-1],
        "quantization": (
            {k: q.get(k, "affine") for k in ("bits", "group_size", "mode")}
            if q
            else None
        ),
        "compat": config[fold.MARKER].get("compat", False),
        "final_norm_folded": config[fold.MARKER].get("final_norm_folded", False),
        "as_stored": fold.has_norm_gains(config),
        "quantization_method": (
            config[fold.MARKER].get("quantization_method", {}).get("method")
        ),
    }
