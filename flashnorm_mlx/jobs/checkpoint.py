"""Write a checkpoint that flashnorm-mlx loads in one step (loading/recipe.py computes it).

A float source is written folded (and quantized with -q); a quantized source
as stored (its tensors unchanged, config.json marked for FlashNorm to apply the
norm gains in its kernels), or folded with --dequantize / --requantize. The
files go into a temporary sibling folder that is renamed into place at the
very end: a failure leaves nothing half-written behind.
"""

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

import mlx.core as mx

from .. import fold, interrupt, models, quant
from ..errors import LoadError
from ..fold import Weights
from ..loading import gguf_kquant, wrappers
from ..loading.adapters import adapted_quantization, apply_adapter
from ..loading.recipe import CHUNK_ELEMENTS, fold_checkpoint
from ..loading.source import Source, read_source, resolve
from ..quant import gptq

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
            n += v.size * 32 // quant.quant_params(config, module)["bits"]
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
    quantized_way: str = "stored",
    compat: bool = False,
    force: bool = False,
    progress: bool = True,
    tokenizer: Optional[str] = None,
    on_layer: Optional[Callable[[int, int], None]] = None,
    max_shard_gb: int = 5,
    chunk_elements: int = CHUNK_ELEMENTS,
    q_method: str = gptq.DEFAULT_METHOD,
    calibration: gptq.Calibration = gptq.Calibration(),
    on_stage: Optional[Callable[[str], None]] = None,
    on_step: Optional[Callable[[str], None]] = None,
    on_slow: Optional[Callable[[str], None]] = None,
    adapter_path: Optional[str] = None,
) -> dict:
    """Fold (and quantize) `source` into the checkpoint folder `out_dir`.

    source: a `Source` (loading/source.py), or a MODEL string (None: the embedded default)
        that is read here; then its tensors are released layer by layer.
    tokenizer: a folder or repo id whose tokenizer files to ship (OpenELM).
    on_layer(i, n): called after layer group i of n is computed (tests inject
        failures here). max_shard_gb: 0 writes one tensor per shard.
    chunk_elements: a weight with more elements is computed in row chunks.
    q_method: "gptq" (fold-aware GPTQ, calibrated on `calibration` windows of
        offline text; needs a tokenizer), "rtn" (round-to-nearest), or "auto"
        (default: the one that takes seconds here, `gptq.resolve`); recorded in
        config.json's "flashnorm" block. on_stage hears that a quantized source
        is requantized, and that "auto" chose RTN on the CPU.
    on_stage(text) / on_step(text): told as each stage ends / where the work is
        (`recipe.fold_checkpoint`; writing too). on_slow(line): GPTQ on the
        CPU says once how long it will take (`recipe.fold_checkpoint`).
    adapter_path: an mlx-lm LoRA/DoRA adapter fused in before the fold
        (loading/adapters.py).
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
    source, weights = _read(source, tokenizer, adapter_path)
    if not models.is_covered(source.config):  # before any folder is made
        raise models.not_covered(
            source.config,
            "nothing to fold",
            "the other commands run it as stock, and mlx-lm's own convert "
            "quantizes it",
        )
    quantize, note = adapted_quantization(source, quantize, quantized_way)
    for line in (note, *_quantizing_notes(source, quantize, q_method)):
        if line and on_stage is not None:
            on_stage(line)
    q_method = gptq.resolve(q_method)
    steps = (quantize, dtype, quantized_way, compat, q_method, calibration)
    hooks = dict(on_layer=on_layer, on_stage=on_stage, on_step=on_step)
    hooks.update(on_slow=on_slow, progress=progress, chunk_elements=chunk_elements)
    paths = (out, shown, force, tokenizer_dir, max_shard_gb)
    files, summary = _fold_and_write(source, weights, steps, hooks, paths)
    if on_stage is not None:
        on_stage(f"wrote {len(files)} file(s) to {shown}")
    return summary


def _fold_and_write(source, weights, steps, hooks, paths):
    """(files, summary): `fold_checkpoint(source, weights, *steps, **hooks)`
    written into a temporary sibling of out, renamed into place at the end; a
    failure or Ctrl-C leaves neither it nor a created parent behind."""
    out, shown, force, tokenizer_dir, max_shard_gb = paths
    tmp, created = _make_tmp(out, shown)  # before any work: a bad -o is one line

    def remove_tmp():
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)

    try:
        with interrupt.cleanup(remove_tmp):  # Ctrl-C: interrupt.py ends the run
            done, config = fold_checkpoint(source, weights, *steps, **hooks)
            weights.clear()  # ours (read here) or our copy: each went as folded
            (hooks["on_step"] or (lambda text: None))(f"writing {shown}")
            dst = (tmp, out, shown, force, tokenizer_dir, max_shard_gb)
            files = _write(dst, done, config, source)
            summary = _summary(shown, done, config, files)
            del done
    except OSError as e:
        remove_tmp()
        raise LoadError(f"cannot write {shown}: {e.strerror or e}") from None
    except BaseException:
        remove_tmp()
        raise
    return files, summary


def _read(source, tokenizer, adapter_path) -> Tuple[Source, Weights]:
    """(source, the weights to fold): a MODEL string is read here and its
    tensors are ours alone (each goes once its output is computed)."""
    if not isinstance(source, Source):
        source = read_source(source, tokenizer=tokenizer, adapter_path=adapter_path)
        weights, source.weights = source.weights, {}
        return source, weights
    if adapter_path is not None:
        source = apply_adapter(source, adapter_path)
    return source, dict(source.weights)  # the caller's stay


def _quantizing_notes(source: Source, quantize, q_method: str) -> List[str]:
    """What -q does that a user would not guess: a quantized source is rounded
    a second time, and "auto" chose round-to-nearest on the CPU."""
    notes = []
    was = source.config.get("quantization")
    kquants = gguf_kquant.floats_of(source.config)
    if quantize and (was or kquants):
        words = (
            quant.describe(source.config)
            if was
            else "/".join(sorted(set(kquants.values())))
        )
        notes.append(
            f"the source is already quantized, {words}: -q dequantizes it and "
            f"requantizes to {quantize[0]}-bit group {quantize[1]}, rounding it a "
            "second time; without -q it is written as stored, exactly"
        )
    auto = gptq.auto_note(q_method, bool(quantize))
    return notes + ([auto] if auto else [])


def _write(paths, done: Weights, config: dict, source: Source) -> List[str]:
    """The files into tmp, then tmp renamed to out. A Ctrl-C waits for the
    files, then removes them, or for the rename."""
    tmp, out, shown, force, tokenizer_dir, max_shard_gb = paths
    with interrupt.committing():
        files = _write_weights(tmp, done, config, max_shard_gb)
        _write_config(tmp, config)
        _write_tokenizer(tmp, source, tokenizer_dir)
        interrupt.check()
        _replace(tmp, out, shown, force)
    return files


def _make_tmp(out: Path, shown: Path) -> Tuple[Path, List[Path]]:
    """The temporary sibling folder of `out`, and the parents made for it
    (removed again if the conversion fails)."""
    created = _missing_parents(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
        # mkdtemp makes 0700; the checkpoint gets the umask's permissions.
        os.chmod(tmp, 0o777 & ~_umask())
    except OSError as e:
        _remove_dirs(created)
        raise LoadError(f"cannot create {shown}: {e.strerror or e}") from None
    return tmp, created


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


def _write_config(dst: Path, config: dict) -> None:
    from mlx_lm.utils import save_config

    # A GGUF's record of its float-read K-quants is the source's, not the output's.
    config = {
        k: v
        for k, v in config.items()
        if k not in (gguf_kquant.CONFIG_KEY, gguf_kquant.FILE_DTYPE_KEY)
    }
    config = wrappers.as_written(config)  # Llama 4's: the wrapper's form
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
        "quantization": quant.q_settings(q) if q else None,
        "compat": config[fold.MARKER].get("compat", False),
        "final_norm_folded": config[fold.MARKER].get("final_norm_folded", False),
        "as_stored": quant.has_norm_gains(config),
        "quantization_method": (
            config[fold.MARKER].get("quantization_method", {}).get("method")
        ),
        # GGUF tensors of a type MLX cannot hold, written in float: module -> type
        "float_kquants": {
            m: t
            for m, t in (gguf_kquant.floats_of(config) or {}).items()
            if f"{m}.scales" not in weights
        },
    }
