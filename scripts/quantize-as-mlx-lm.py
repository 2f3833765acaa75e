"""A float checkpoint quantized by mlx-lm itself, as mlx-community's are.

    python scripts/quantize-as-mlx-lm.py SRC DST [BITS] [GROUP_SIZE]

No tokenizer needed (mlx_lm.convert insists on one). bench, chat and the rest
run the result as stored: stock and FlashNorm on the very same 4-bit weights.
"""

import shutil
import sys
from pathlib import Path

from mlx_lm.utils import load_model, quantize_model, save_config, save_model


def main(src: str, dst: str, bits: int = 4, group_size: int = 64) -> None:
    model, config = load_model(Path(src))
    model, config = quantize_model(model, config, group_size, bits)
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    for f in Path(src).glob("tokenizer*"):  # a tokenizer, if the source has one
        shutil.copy2(f, out / f.name)


if __name__ == "__main__":
    a = sys.argv[1:]
    if len(a) not in (2, 3, 4):
        sys.exit(__doc__.strip().splitlines()[2].strip())
    main(a[0], a[1], *(int(x) for x in a[2:]))
