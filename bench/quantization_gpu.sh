#!/usr/bin/env bash
# One GPU run for the quantized-weights work (issue E31), on an H100 or H200, in this order:
#  1. the GPU tests of the INT4 and FP8 kernels and checkpoints (W4A16 decode kernel and the
#     dequantise + cuBLAS path at Llama-8B shapes, CUDA graphs = eager, spec = plain, bf16
#     logits near the dequantised model; the FP8 kernels incl. the wide-step option);
#  2. the GEMMs at the 8B shapes, bf16 vs FP8 (narrow and wide K steps) vs INT4, M = 1 and 16
#     (bench/fp8_gemm.py: microseconds and % of copy bandwidth per variant);
#  3. Llama-8B bs=1, plain and chain, bf16 vs FP8 vs INT4 (AWQ layout, group 128), random
#     weights (bench/one_batch.py: tok/s and % of the step limit).
# Usage: bash bench/quantization_gpu.sh [out-dir]   (about 10-15 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
OUT=${1:-${OUT:-bench_quantization}}
mkdir -p "$OUT"
$PY -m pytest -q -m gpu tests/test_int4_kernels.py tests/test_int4_checkpoints.py \
    tests/test_fp8_kernels.py tests/test_fp8_checkpoints.py 2>&1 | tee "$OUT/gpu_tests.txt" \
    || echo "GPU TESTS FAILED: see $OUT/gpu_tests.txt (the benchmarks still run)"
$PY bench/fp8_gemm.py --shapes 8b.qkv,8b.o,8b.gate_up,8b.down --rows 1,16,64,512 --no-moe \
    --out "$OUT/fp8_int4_gemm.json" 2>&1 | tee "$OUT/gemm.txt"
$PY bench/one_batch.py --models llama-8b --batch-sizes 1 --modes plain,chain --steps 48 \
    --quantizations auto,fp8,awq --out "$OUT/one_batch.json" 2>&1 | tee "$OUT/one_batch.txt"
