#!/usr/bin/env bash
# E30 before/after on one lease: decode stalls behind extends (prompts in extends of their own,
# the default) against prompts riding in the decode steps (--mixed-steps). 8B chain
# shape, text, 512 requests of 128 new tokens at 64 and 256 streams, both fronts. Per row
# bench/serving.py prints TTFT, TPOT, the client's inter-token p50/p99, the server's chunk gaps,
# and the engine's decode / extend step times and decode stalls (from /metrics).
# Usage (on the GPU machine, repo root; ~15 min of device time):
#   OUT=out bash bench/mixed_step.sh
# It installs (bench/device_run.sh) and runs `pytest -m gpu -k mixed tests/test_gpu_engine.py`
# (parity with each request alone, no blocking sync in mixed steps) first; SKIP_TESTS=1 skips
# both. JSON and logs: $OUT/mixed_{grpc,openai}_{separate,mixed}.{json,log}, $OUT/pytest.log.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; export OUT
export SPECSERVE_MODELS_DIR=$PWD/models
if [ -z "${SKIP_TESTS:-}" ]; then
  bash bench/device_run.sh "-m gpu -k mixed tests/test_gpu_engine.py"
fi
for api in grpc openai; do
  for mode in separate mixed; do
    flag=""; [ "$mode" = mixed ] && flag=--mixed-steps
    python bench/serving.py --launch llama-8b --text --spec chain --rates inf --num-requests 512 \
      --max-new-tokens 128 --client-procs 4 --tokenizer-workers 2 --api "$api" --concurrency 64,256 \
      $flag --label "$mode" --out "$OUT/mixed_${api}_${mode}.json" > "$OUT/mixed_${api}_${mode}.log" 2>&1
    echo "== $api $mode rc=$?"; sed -n '/^ *label  *conc/,$p' "$OUT/mixed_${api}_${mode}.log"
  done
done
