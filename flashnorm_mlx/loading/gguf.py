"""Read a llama.cpp GGUF file as a Hugging Face-style checkpoint of a family whose
`ARCH.gguf` (models/arch.py) declares how: llama.cpp's architecture name, the
layer names beyond Llama's, biases, Q/K permutation; a mixture-of-experts'
names are on `ARCH.moe` (gguf_moe.py). A family whose files need more (Gemma 3,
Qwen3.5, Qwen3-Next, LFM2, Ministral 3, Gemma 4) names the module that reads
them whole (`Gguf.reader`: gguf_gemma3.py, gguf_qwen35.py, gguf_lfm2.py,
gguf_ministral3.py, gguf_gemma4.py; docs/design.md section 2n).

`mx.load(path, return_metadata=True)` gives the tensors (Q4_0/Q4_1/Q8_0 as MLX
affine group-32 triples `.weight/.scales/.biases`, F32/F16 as plain arrays)
and the metadata; a file with K-quants is read in the same form by
gguf_kquant.py (Q4_K/Q5_K repacked as triples, Q6_K/Q3_K/Q2_K in float16,
listed in config[gguf_kquant.CONFIG_KEY]). From them
we build what `source.Source` holds for a Hugging Face folder:
- a config.json dict (plus `"quantization"` keyed by module path, as mlx-lm has),
- weights under Hugging Face names, with llama.cpp's Q/K row permutation undone
  where `ARCH.gguf.permuted` (Llama: llama.cpp permutes Q/K rows for interleaved
  RoPE there, and leaves Qwen's, which use the half-split layout, as they are),
- a fast tokenizer from the GGUF vocabulary, wrapped for mlx-lm.
"""

import importlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import quant
from ..errors import LoadError
from ..models.arch import Architecture
from . import gguf_kquant, gguf_moe, gguf_names
from .checks import check_gguf
from .gguf_names import hf_name  # noqa: F401 (tests read names through here)
from .gguf_rope import llama3_scaling

GROUP_SIZE = 32  # every GGUF block quant MLX keeps quantized has 32-wide blocks

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied one after the
# other, each splitting every piece into matches and the gaps between them.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35_RE = (  # Qwen2's with marks (\p{M}) in words
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_RE = (  # Mistral's: words split at case changes
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_RES = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"]
_DIGITS_THEN_GPT2 = [r"\p{N}", _GPT2_RE]
# (tokenizer.ggml.pre names, regexes, ignore_merges, add_bos default), as llama.cpp
_PRE_GROUPS = [
    (
        (
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ),
        _DIGITS_THEN_GPT2,
        False,
        False,
    ),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais"), [_GPT2_RE], False, False),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "lfm2"), [_LLAMA3_RE], True, True),
    (("qwen2", "stablelm2", "megrez"), [_QWEN2_RE], False, False),
    (("qwen35",), [_QWEN35_RE], False, False),
    (("tekken",), [_TEKKEN_RE], True, True),
    (("default",), _DEFAULT_RES, False, False),
]
PRE_TOKENIZERS = {n: spec for names, *spec in _PRE_GROUPS for n in names}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def read_gguf(
    path: Path, load_tokenizer: bool = True
) -> Tuple[dict, Dict[str, mx.array], Optional[object]]:
    """(config, weights with Hugging Face names, TokenizerWrapper or None)."""
    path = Path(path)
    table = check_gguf(path)  # MLX's own reader segfaults on a corrupt table
    floats = {}  # GGUF name -> K-quant type read as float32
    try:
        if gguf_kquant.needs_own_reader(table):  # MLX dequantizes or fails
            raw, meta, floats = gguf_kquant.read_file(path, table)
        else:
            raw, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # MLX says "[load_gguf] ..." for corrupt or odd files
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(f"{path}: not a readable GGUF file ({msg})") from None
    arch = meta.get("general.architecture")
    families = gguf_names.families()
    if arch not in families:
        raise LoadError(
            f"{path}: GGUF architecture {arch!r} is not supported{gguf_names.why_not(arch)} "
            f"(flashnorm-mlx reads {', '.join(families)} GGUF files)"
        )
    model_type, family = families[arch]
    names = gguf_names.layer_names(family)
    rename = lambda n: gguf_names.hf_name(n, names)  # noqa: E731
    try:
        if family.gguf.reader:  # a hybrid family's own module reads it whole
            reader = importlib.import_module(f".{family.gguf.reader}", __package__)
            config, weights, rename = reader.read(meta, raw, path, arch, family)
        else:
            config = gguf_config(meta, raw, path, arch, model_type, family)
            weights = hf_weights(raw, config, path, family)
    except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError) as e:
        # Metadata of the wrong kind (a string where a count belongs, ...).
        raise LoadError(f"{path}: unusable GGUF metadata ({_first_line(e)})") from None
    qblock = quantization(weights)
    if qblock:
        config["quantization"] = qblock
    if floats:
        mods = {rename(n).rpartition(".")[0]: t for n, t in floats.items() if rename(n)}
        config[gguf_kquant.CONFIG_KEY] = mods
    if any(t.type_name in gguf_kquant.K_TYPES for t in table):  # read in float32
        config[gguf_kquant.FILE_DTYPE_KEY] = "float16"
    tokenizer = None
    if load_tokenizer:
        try:
            tokenizer = gguf_tokenizer(meta, path)
        except LoadError:
            raise
        except BaseException as e:  # the tokenizers library panics on bad vocabularies
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise LoadError(
                f"{path}: cannot build the tokenizer from its GGUF vocabulary "
                f"({_first_line(e)})"
            ) from None
    return config, weights, tokenizer


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


# --- config ------------------------------------------------------------------


def meta_value(meta: dict, key: str, default=None):
    """A metadata value as a Python scalar (MLX hands numbers back as 0-d arrays)."""
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def meta_f32(v) -> float:
    """A float32 metadata number as its shortest decimal (1e-05, not 9.99e-06)."""
    return float(str(np.float32(v)))


def meta_required(meta: dict, key: str, path: Path):
    v = meta_value(meta, key)
    if v is None:
        raise LoadError(f"{path}: GGUF metadata has no {key}")
    return v


def gguf_config(
    meta: dict,
    tensors: Dict[str, mx.array],
    path: Path,
    arch: str,
    model_type: str,
    family: Architecture,
) -> dict:
    """A Hugging Face config.json dict from `<arch>.*` metadata."""
    a = arch
    n_heads = int(meta_required(meta, f"{a}.attention.head_count", path))
    n_kv = int(meta_value(meta, f"{a}.attention.head_count_kv", n_heads))
    hidden = int(meta_required(meta, f"{a}.embedding_length", path))
    head_dim = int(
        meta_value(meta, f"{a}.attention.key_length", 0) or hidden // n_heads
    )
    v_dim = int(meta_value(meta, f"{a}.attention.value_length", head_dim))
    rope_dim = int(meta_value(meta, f"{a}.rope.dimension_count", head_dim))
    if v_dim != head_dim or rope_dim != head_dim:
        raise LoadError(
            f"{path}: key/value/rope widths {head_dim}/{v_dim}/{rope_dim} differ; "
            "only full-width RoPE with equal key and value heads is supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = (
        len(tokens) if isinstance(tokens, list) else meta_value(meta, f"{a}.vocab_size")
    )
    if "token_embd.weight" in tensors:  # the embedding rows are what the model needs
        vocab = tensors["token_embd.weight"].shape[0]
    config = {
        "model_type": model_type,
        "architectures": [family.gguf.hf],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta_required(meta, f"{a}.block_count", path)),
        "intermediate_size": int(meta_required(meta, f"{a}.feed_forward_length", path)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": meta_f32(
            meta_required(meta, f"{a}.attention.layer_norm_rms_epsilon", path)
        ),
        "rope_theta": meta_f32(meta_value(meta, f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta_value(meta, f"{a}.context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        tid = meta_value(meta, f"tokenizer.ggml.{name}_token_id")
        if tid is not None:
            config[key] = int(tid)
    scaling = _rope_scaling(meta, tensors, config, path, a)
    if scaling:
        config["rope_scaling"] = scaling
    config.update(gguf_moe.moe_config(meta, a, path, family))  # {}: no experts
    return config


def _rope_scaling(
    meta: dict, tensors: dict, config: dict, path: Path, a: str = "llama"
) -> Optional[dict]:
    kind = meta_value(meta, f"{a}.rope.scaling.type", "none")
    factor = float(meta_value(meta, f"{a}.rope.scaling.factor", 0.0) or 0.0)
    original = meta_value(meta, f"{a}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in tensors:
        return llama3_scaling(tensors["rope_freqs.weight"], config, path)
    if kind in ("none", None) or factor in (0.0, 1.0):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"type": "yarn", "factor": factor}
        if original:
            out["original_max_position_embeddings"] = int(original)
        return out
    raise LoadError(f"{path}: RoPE scaling {kind!r} is not supported")


# --- weights -----------------------------------------------------------------


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (rows only: exact on packed weights,
    scales and biases alike). llama.cpp stores, per head of width h, row
    2*i + j of HF row j*h/2 + i (interleaved RoPE pairs); w: (n_heads*h, ...)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even width")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(
    raw: Dict[str, mx.array], config: dict, path: Path, family: Architecture
) -> Dict[str, mx.array]:
    """GGUF tensors -> Hugging Face names, Q/K unpermuted, types checked."""
    out, names = {}, gguf_names.layer_names(family)
    permuted = family.gguf.permuted  # interleaved-RoPE rows
    for name, value in raw.items():
        if name == "rope_freqs.weight":  # folded into config["rope_scaling"]
            continue
        hf = gguf_names.hf_name(name, names)
        if hf is None:
            raise LoadError(
                f"{path}: unexpected tensor {name!r} for a {config['model_type']} GGUF"
            )
        check_type(name, value, raw, path)
        if permuted and ".self_attn.q_proj." in hf:
            value = unpermute_rows(value, config["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in hf:
            value = unpermute_rows(value, config["num_key_value_heads"])
        out[hf] = value
    missing = [k for k in gguf_names.expected(config, family) if k not in out]
    if missing:
        raise LoadError(
            f"{path}: {len(missing)} tensors missing or of a type MLX cannot read "
            f"(first: {missing[0]})"
        )
    return out


def check_type(name: str, value: mx.array, raw: dict, path: Path) -> None:
    if mx.issubdtype(value.dtype, mx.floating):
        return
    stem = name.rpartition(".")[0]
    if (
        name.endswith(".weight")
        and value.dtype == mx.uint32
        and f"{stem}.scales" in raw
        and f"{stem}.biases" in raw
        and _bits(value, raw[f"{stem}.scales"]) in (4, 5, 8)
    ):
        return
    raise LoadError(
        f"{path}: tensor {name} has an unsupported type ({value.dtype}); "
        "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and K-quants"
    )


def _bits(packed: mx.array, scales: mx.array) -> int:
    # packed: (out, in*bits/32) uint32; scales: (out, in/32)
    return packed.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)


def quantization(weights: Dict[str, mx.array]) -> Optional[dict]:
    """mlx-lm's `quantization` config: the most common bits, per-module overrides."""
    per = {
        k[: -len(".scales")]: _bits(weights[k[: -len(".scales")] + ".weight"], v)
        for k, v in weights.items()
        if k.endswith(".scales")
    }
    if not per:
        return None
    return quant.quantization_block(
        {m: quant.affine_spec(b, GROUP_SIZE) for m, b in per.items()}
    )


# --- tokenizer ---------------------------------------------------------------


def gguf_tokenizer(meta: dict, path: Path):
    """mlx-lm TokenizerWrapper around a fast byte-level BPE tokenizer from metadata."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    tok = build_fast_tokenizer(meta, path)
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        tid = meta_value(meta, f"tokenizer.ggml.{key}_token_id")
        return (
            tokens[int(tid)]
            if tid is not None and 0 <= int(tid) < len(tokens)
            else None
        )

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    # End-of-turn tokens also end a reply (llama.cpp's eot/eom).
    eos = {
        int(meta_value(meta, f"tokenizer.ggml.{k}_token_id"))
        for k in ("eos", "eot", "eom")
        if meta_value(meta, f"tokenizer.ggml.{k}_token_id") is not None
    }
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=sorted(eos))


def build_fast_tokenizer(meta: dict, path: Path):
    """A `tokenizers.Tokenizer` equal to llama.cpp's for a "gpt2" (byte-level BPE)
    GGUF vocabulary: BPE over tokens and merges, llama.cpp's pre-tokenizer regexes,
    control tokens (token_type 3) as special tokens, BOS/EOS added as the file says."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    regexes, ignore_merges, add_bos_default = _pre_tokenizer(meta, path)
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise LoadError(f"{path}: GGUF metadata has no tokenizer tokens or merges")
    # A duplicate token keeps its last id, as in llama.cpp.
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(
        vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, tokens, meta_value(meta, "tokenizer.ggml.token_type"))
    _add_bos_eos(tok, tokens, meta, add_bos_default)
    return tok


def _pre_tokenizer(meta: dict, path: Path):
    """(regexes, ignore_merges, add_bos default) of the file's pre-tokenizer."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise LoadError(
            f"{path}: GGUF tokenizer model {model!r} is not supported "
            "(flashnorm-mlx builds byte-level BPE 'gpt2' tokenizers; give the "
            "model's Hugging Face tokenizer with --tokenizer)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise LoadError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
            f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return PRE_TOKENIZERS[pre]


def _add_special_tokens(tok, tokens: List[str], types: Optional[List[int]]) -> None:
    """Control tokens as special tokens, user-defined ones as added tokens."""
    from tokenizers import AddedToken

    types = types or [1] * len(tokens)
    special = [tokens[i] for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    user = [tokens[i] for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special]
    )
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _add_bos_eos(tok, tokens: List[str], meta: dict, add_bos_default: bool) -> None:
    """BOS/EOS around every encoding where the file (or its pre-tokenizer) says."""
    from tokenizers import processors

    bos_id = meta_value(meta, "tokenizer.ggml.bos_token_id")
    eos_id = meta_value(meta, "tokenizer.ggml.eos_token_id")
    add_bos = bool(meta_value(meta, "tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta_value(meta, "tokenizer.ggml.add_eos_token", False))
    single, marks = "$A", []
    if add_bos and bos_id is not None:
        single = f"{tokens[bos_id]} {single}"
        marks.append((tokens[bos_id], int(bos_id)))
    if add_eos and eos_id is not None:
        single = f"{single} {tokens[eos_id]}"
        marks.append((tokens[eos_id], int(eos_id)))
    if marks:
        tok.post_processor = processors.TemplateProcessing(
            single=single,
            pair=f"{single} $B:1",
            special_tokens=list(dict.fromkeys(marks)),
        )
