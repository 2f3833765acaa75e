"""Perplexity of stock vs FlashNorm 4-bit, per quantization method (issue 13's table).

Embedded SmolLM2-135M-Instruct, offline text (texts.default_text, ~4.3k tokens
scored), float32 compute. Rows: the float model (dequantized Q4_1), stock
mlx-lm's round-to-nearest (RTN), FlashNorm RTN, FlashNorm GPTQ (the default of
`convert -q` and `perplexity -q`), at group 32 (the source's own settings,
requantized) and group 64. Usage: python scripts/quant-table.py [OUT.json]
"""

import json
import sys
import time

import mlx.core as mx

from flashnorm_mlx.loading import read_source
from flashnorm_mlx.perplexity import perplexity

EVAL = dict(seq_len=256, num_seqs=17, dtype=mx.float32)


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

    run("float32", dequantize=True, modes=["stock", "flashnorm"])
    for group, q in ((64, dict(dequantize=True, quantize=(4, 64))), (32, {})):
        run(f"g{group} stock-rtn vs flashnorm-gptq", q_method="gptq", **q)
        run(f"g{group} flashnorm-rtn", q_method="rtn", modes=["flashnorm"], **q)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
