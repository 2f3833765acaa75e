"""The chat page's Compare (serve/compare.py) in-process on a tiny random
Llama: a `--mode stock` server is compared with FlashNorm built on the same
folder, once, kept for the next Compare; both greedy runs give the tokens
mlx-lm's own generate_step gives on stock (the reference), the ratio is
FlashNorm's decode tok/s over stock's whichever mode serves. The page's
side, on the real model and a FlashNorm server: test_serve_page_chat."""

import time
from types import SimpleNamespace

import mlx.core as mx
import pytest
import tiny
from mlx_lm.generate import generate_step

from flashnorm_mlx.loading import build_model, read_source
from flashnorm_mlx.serve.compare import Comparer, other_mode


def test_a_stock_server_compares_with_flashnorm_built_once(tmp_path):
    path = str(tiny.make_llama(tmp_path / "m", "gqa_untied"))
    stock, _ = build_model(read_source(path, need_tokenizer=False), "stock")
    builds = []

    def build_other():
        builds.append(1)
        time.sleep(0.01)  # seconds shows 2 decimals; a warm process may take < 5 ms
        return build_model(read_source(path, need_tokenizer=False), "flashnorm")[0]

    c = Comparer(build_other, "stock")
    worker = SimpleNamespace(model=stock)  # what Worker.call hands the function
    prompt = [3, 17, 42, 9, 100, 7, 64, 5]
    first, again = c.run(worker, prompt, 6), c.run(worker, prompt, 6)
    print(first)
    assert builds == [1] and first["built_seconds"] > 0 and again["built_seconds"] == 0
    assert (
        first["modes"] == ["stock", "flashnorm"] and other_mode("flashnorm") == "stock"
    )
    res = first["results"]
    assert res["stock"]["model"].startswith("mlx_lm.models."), res
    assert res["flashnorm"]["model"].startswith("flashnorm_mlx."), res
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), stock, max_tokens=6)]
    assert res["stock"]["token_ids"] == ref, (res, ref)
    assert res["flashnorm"]["token_ids"] == ref and first["agree"] == 6, (res, ref)
    fn, st = (res[m]["decode_tokens_per_second"] for m in ("flashnorm", "stock"))
    assert first["ratio"] == pytest.approx(fn / st, abs=2e-3)
    assert first["prompt_tokens"] == 8 and first["tokens"] == 6
