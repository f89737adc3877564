#!/usr/bin/env bash
# E30 before/after on one lease: decode stalls behind extends (prompts in extends of their own,
# --disable-mixed-steps) against prompts riding in the decode steps (the mixed step). 8B chain
# shape, text, 512 requests of 128 new tokens at 64 and 256 streams, both fronts. Per row
# bench/serving.py prints TTFT, TPOT, the client's inter-token p50/p99, the server's chunk gaps,
# and the engine's decode / extend step times and decode stalls (from /metrics).
# Usage (on the GPU machine, repo root, after bench/device_run.sh's install):
#   OUT=out bash bench/mixed_step.sh            # JSON and logs in $OUT/mixed_{grpc,openai}_{separate,mixed}.*
#   GPU_TESTS=1 OUT=out bash bench/mixed_step.sh  # first: pytest -m gpu -k mixed (parity, no sync)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export SPECSERVE_MODELS_DIR=$PWD/models
if [ -n "${GPU_TESTS:-}" ]; then
  pytest -q -p no:cacheprovider -m gpu -k mixed tests/test_gpu_engine.py > "$OUT/mixed_pytest.log" 2>&1
  echo "gpu tests rc=$?"; tail -15 "$OUT/mixed_pytest.log"
fi
for api in grpc openai; do
  for mode in separate mixed; do
    flag=""; [ "$mode" = separate ] && flag=--disable-mixed-steps
    python bench/serving.py --launch llama-8b --text --spec chain --rates inf --num-requests 512 \
      --max-new-tokens 128 --client-procs 4 --tokenizer-workers 2 --api "$api" --concurrency 64,256 \
      $flag --label "$mode" --out "$OUT/mixed_${api}_${mode}.json" > "$OUT/mixed_${api}_${mode}.log" 2>&1
    echo "== $api $mode rc=$?"; sed -n '/^ *label  *conc/,$p' "$OUT/mixed_${api}_${mode}.log"
  done
done
