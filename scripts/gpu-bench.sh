#!/usr/bin/env bash
# The GPU measurements, on an NVIDIA machine with MLX's CUDA build set up as
# ../shared/device/README.md says (run from the project root, after
# `bash .devkit/device-setup.sh && source ~/kit/env.sh`). Random-weight checkpoints
# at real shapes (decode speed depends on shapes, not values), then
# `bench -p 128 -g 128 -n 7 --engine compiled --verbose` (mlx-lm as users run
# it, then stock, stock_fused, nonorm and flashnorm on the one compiled engine,
# so flashnorm_vs_stock is what FlashNorm alone buys) in each
# model's dtype and on a 4-bit group 64 copy quantized by mlx-lm itself, which
# every variant runs as stored: the same 4-bit weights for stock and FlashNorm.
# A 4-bit model's first prefill spends minutes in MLX's JIT of its quantized
# kernels (cached on disk afterwards): bench's untimed warm-up takes that hit.
# Results: one JSON per run and bench's tables in $OUT (default ./gpu-bench).
set -euo pipefail
out=${OUT:-gpu-bench}
tools=${TOOLS:-.devkit/tools}
models=${MODELS:-smollm2-135m openelm-270m llama-3.2-1b qwen3-0.6b}
mkdir -p "$out"
python3 -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, "cuda", mx.cuda.is_available())' | tee "$out/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$out/versions.txt" || true
python3 "$tools/mkshapes.py" "$out/models" $models
for m in $models; do
  python3 scripts/quantize-as-mlx-lm.py "$out/models/$m" "$out/models/$m-4bit" 4 64
  for q in "" -4bit; do
    PYTHONPATH=. python3 -m flashnorm_mlx bench "$out/models/$m$q" -p 128 -g 128 -n 7 \
      --engine compiled --verbose --json "$out/$m$q.json" | tee -a "$out/tables.txt"
  done
done
