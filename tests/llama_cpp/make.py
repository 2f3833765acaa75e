"""How the GGUF fixtures beside this file were made (never run by the tests).

Tiny random Llama and Qwen3 checkpoints (tests/tiny.py's weights, rounded to
5 significant bits so the float files compress; norm gains in [0.25, 4]),
converted by llama.cpp's own `convert_hf_to_gguf.py` to F32, quantized by its
`llama-quantize` (Q5_K_M, Q4_K_M, Q3_K_M), and dequantized back by it
(`llama-quantize --allow-requantize IN OUT F32`); llama.cpp's greedy tokens on
each F32 and dequantized file come from its `llama-simple`, patched to print
the token ids on stderr (two fprintf lines). The float files are not kept
(~0.7-1.3 MB each): of llama.cpp's dequantized copies, the sha256 of each
tensor's float32 values as read under Hugging Face names (Q/K rows in HF
order; reading an F32 file is mx.load and a row permutation) is recorded, and
the F32 files' checkpoints are `checkpoint` below, made again by the tests.
Phi-3 (`phi3_checkpoint`, the same weights fused as Phi-3 ships them) is
converted to F16, which holds the rounded weights exactly, and kept (~0.1 MB),
with a Q4_K_M made from it the same way.

    python tests/llama_cpp/make.py LLAMA_CPP_DIR CONVERTER_PYTHON OUT_DIR

LLAMA_CPP_DIR: llama.cpp's source with build/bin/llama-quantize and
llama-simple; CONVERTER_PYTHON: a Python with torch, transformers and its
gguf-py. The tokenizer (256 bytes, 3 specials) is unknown to the converter's
pre-tokenizer table: it is told "gpt-2", which reads bytes as they are.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tiny  # noqa: E402

PROMPT = "the thin"
N_PREDICT = 12
QUANTS = ("Q5_K_M", "Q4_K_M", "Q3_K_M")
# 128: q|k|v and gate|up rows 128 wide (llama-quantize swaps each K-quant for
# Q5_0/Q5_1/Q8_0/...), down 256 wide; 256: the other way round.
SHAPES = {
    128: dict(hidden_size=128, intermediate_size=256),
    256: dict(hidden_size=256, intermediate_size=128),
}
BASE = dict(
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=263,  # `tokenizer`'s
    bos_token_id=None,
    eos_token_id=262,
)
MERGES = [("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n")]  # llama.cpp needs some


def tokenizer(path: Path) -> None:
    """tiny.write_tokenizer's (256 bytes, 3 specials) with four merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tiny.write_tokenizer(path)
    vocab = {t: i for i, t in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for t in specials:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))


def coarse(x: np.ndarray) -> np.ndarray:
    m, e = np.frexp(x)
    return np.ldexp(np.round(m * 32) / 32, e).astype(np.float32)


def checkpoint(out: Path, family: str, width: int) -> Path:
    if family == "llama":
        cfg = {**tiny.LLAMA_BASE, **BASE, **SHAPES[width], "tie_word_embeddings": True}
        w = tiny.llama_weights(cfg, seed=width)
    else:
        cfg = {**tiny.qwen_config("qwen3_untied"), **BASE, **SHAPES[width]}
        w = tiny.llama_weights(cfg, seed=width + 1)
        rng = np.random.default_rng(width)
        for n in ("q_norm", "k_norm"):
            w[f"model.layers.0.self_attn.{n}.weight"] = tiny._gain(rng, 64)
    w = {k: coarse(v) for k, v in w.items() if "rotary_emb" not in k}
    if cfg["tie_word_embeddings"]:
        w.pop("lm_head.weight", None)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    cfg["architectures"] = [
        "LlamaForCausalLM" if family == "llama" else "Qwen3ForCausalLM"
    ]
    folder = tiny.write_model(out / f"hf-{family}{width}", cfg, w, tokenizer=False)
    tokenizer(folder)
    return folder


# Phi-3 (llama.cpp's `phi3`: fused attn_qkv, ffn_up holding gate|up): 3/4 of
# each 32-wide head rotated; "phi3long" adds longrope factors (written as the
# rope_factors_long/short tensors) with an original context of 8, so that
# llama.cpp takes the long factors on its 15-token context, as mlx-lm always
# does; tied, as Phi-4-mini. Converted to F16 (which holds the rounded
# weights exactly: the file is the checkpoint) and kept, with a Q4_K_M.
PHI3 = dict(
    model_type="phi3",
    hidden_size=64,
    intermediate_size=128,
    partial_rotary_factor=0.75,
    max_position_embeddings=4096,
    original_max_position_embeddings=4096,
    tie_word_embeddings=False,
)
_FACTORS = [1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0]  # 12
PHI3_LONG = dict(
    PHI3,
    original_max_position_embeddings=8,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    rope_scaling=dict(type="longrope", short_factor=[1.0] * 12, long_factor=_FACTORS),
)
PHI3_QUANTS = ("Q4_K_M",)


def phi3_checkpoint(out: Path, name: str) -> Path:
    """A tiny Phi-3 in Hugging Face's layout: q|k|v and gate|up fused, as it ships."""
    cfg = {**tiny.LLAMA_BASE, **BASE, **(PHI3_LONG if "long" in name else PHI3)}
    cfg.pop("head_dim")  # Phi-3's is hidden / heads
    w = tiny.llama_weights(cfg, seed=7 if "long" in name else 5)
    p = "model.layers.0"
    w[f"{p}.self_attn.qkv_proj.weight"] = np.concatenate(
        [w.pop(f"{p}.self_attn.{n}_proj.weight") for n in "qkv"]
    )
    w[f"{p}.mlp.gate_up_proj.weight"] = np.concatenate(
        [w.pop(f"{p}.mlp.{n}_proj.weight") for n in ("gate", "up")]
    )
    w = {k: coarse(v) for k, v in w.items() if "rotary_emb" not in k}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    cfg["architectures"] = ["Phi3ForCausalLM"]
    # Not "phi3" in the folder (the file's general.name): llama.cpp then
    # marks Phi-3's "</s>", which this byte vocabulary lacks (llama-vocab.cpp).
    folder = out / f"hf-{name.replace('phi3', 'p3')}"
    folder = tiny.write_model(folder, cfg, w, tokenizer=False)
    tokenizer(folder)
    # The converter reads a Phi-3 vocabulary from tokenizer.model unless GPT-2's.
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|im_end|>"})
    )
    return folder


CONVERT = (
    "import sys; sys.path.insert(0, sys.argv[1]); import convert_hf_to_gguf as c; from conversion import base; "
    "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; "
    "sys.argv = ['convert', sys.argv[2], '--outtype', (sys.argv[4:] or ['f32'])[0], '--outfile', sys.argv[3]]; "
    "c.main()"
)


def greedy(bin_dir: Path, gguf: Path) -> dict:
    r = subprocess.run(
        [str(bin_dir / "llama-simple"), "-m", str(gguf), "-n", str(N_PREDICT), PROMPT],
        capture_output=True,
        check=True,
    )
    err = r.stderr.decode("utf-8", "replace")
    ids = lambda tag: [
        int(l.split()[1]) for l in err.splitlines() if l.startswith(tag)
    ]  # noqa
    return {"prompt": ids("PROMPT_ID"), "tokens": ids("TOKEN_ID")}


def main(llama_cpp: Path, python: str, out: Path) -> None:
    bin_dir = llama_cpp / "build" / "bin"
    out.mkdir(parents=True, exist_ok=True)
    record = {}
    for family in ("llama", "qwen3"):
        for width in SHAPES:
            name = f"{family}{width}"
            hf = checkpoint(out / "work", family, width)
            f32 = out / "work" / f"{name}-F32.gguf"
            subprocess.run(
                [python, "-c", CONVERT, str(llama_cpp), str(hf), str(f32)], check=True
            )
            record[f"{name}-F32"] = greedy(bin_dir, f32)
            for q in QUANTS:
                record[f"{name}-{q}-F32"] = quantized(
                    bin_dir, f32, out, f"{name}-{q}", q
                )
    for name in ("phi3", "phi3long"):  # F16 files kept: they are the checkpoints
        hf = phi3_checkpoint(out / "work", name)
        f16 = out / f"{name}-F16.gguf"
        subprocess.run(
            [python, "-c", CONVERT, str(llama_cpp), str(hf), str(f16), "f16"],
            check=True,
        )
        record[f"{name}-F16"] = greedy(bin_dir, f16)
        for q in PHI3_QUANTS:
            record[f"{name}-{q}-F32"] = quantized(bin_dir, f16, out, f"{name}-{q}", q)
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items()]
    (out / "llama_cpp.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")


def quantized(bin_dir: Path, src: Path, out: Path, name: str, q: str) -> dict:
    """llama-quantize `src` to out/NAME.gguf, dequantize that back to F32: its
    llama-simple tokens and the sha256 of its tensors."""
    quantize = str(bin_dir / "llama-quantize")
    qf, back = out / f"{name}.gguf", out / "work" / f"{name}-F32.gguf"
    subprocess.run([quantize, str(src), str(qf), q], check=True, capture_output=True)
    subprocess.run(
        [quantize, "--allow-requantize", str(qf), str(back), "F32"],
        check=True,
        capture_output=True,
    )
    return {**greedy(bin_dir, back), "sha256": hashes(back)}


def hashes(gguf: Path) -> dict:
    from flashnorm_mlx.loading.gguf import read_gguf

    _, weights, _ = read_gguf(gguf, load_tokenizer=False)
    return {k: digest(np.array(v, np.float32)) for k, v in sorted(weights.items())}


def digest(x: np.ndarray) -> str:
    """sha256 of float32 values, -0.0 as 0.0 (llama.cpp's d*(q-8) and MLX's
    s*q + b give zeros of either sign)."""
    return hashlib.sha256((x.astype(np.float32) + np.float32(0)).tobytes()).hexdigest()[
        :16
    ]


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
