"""Perplexity of stock vs FlashNorm 4-bit, per quantization method (issue 13's table).

Embedded SmolLM2-135M-Instruct, offline text (texts.default_text, ~4.3k tokens
scored), float32 compute. Rows: the Q4_1 file as stored (the default: both
models on the same 4-bit weights), the float model (dequantized Q4_1), stock
mlx-lm's round-to-nearest (RTN), FlashNorm RTN, FlashNorm GPTQ (the default of
`convert -q` and `perplexity -q`), at group 32 (the source's own settings,
requantized) and group 64. On a 2-core CPU each row takes 10-25 minutes.
Usage: python scripts/quant-table.py [OUT.json] [ROW ...]  (rows: stored,
float32, g64-gptq, g32-gptq, g64-rtn, g32-rtn; default all, in that order)
"""

import json
import sys
import time

import mlx.core as mx

from flashnorm_mlx.jobs.likelihood import perplexity
from flashnorm_mlx.loading import read_source

EVAL = dict(seq_len=256, num_seqs=17, dtype=mx.float32)


G64 = dict(quantize=(4, 64))  # from the dequantized float weights
G32 = dict(quantized_way="requantize")  # the source's own settings
# Row -> perplexity() keywords (tests/test_perplexity.py checks they are its own).
PLAN = {
    "stored": dict(quantized_way="stored"),
    "float32": dict(quantized_way="dequantize"),
    # stock mlx-lm RTN vs FlashNorm GPTQ, one run so the interval is paired
    "g64-gptq": dict(q_method="gptq", **G64),
    "g32-gptq": dict(q_method="gptq", **G32),
    "g64-rtn": dict(q_method="rtn", modes=["flashnorm"], **G64),
    "g32-rtn": dict(q_method="rtn", modes=["flashnorm"], **G32),
}


def main():
    source = read_source(None)
    rows = {}

    def run(label, **kw):
        t = time.time()
        r = perplexity(source, **EVAL, **kw)
        r["seconds"] = time.time() - t
        rows[label] = r
        print(label, json.dumps(r), flush=True)
        return r

    for label in sys.argv[2:] or PLAN:
        run(label, **PLAN[label])
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
