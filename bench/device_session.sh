#!/usr/bin/env bash
# A device session of several phases, each within one 10-minute call; each phase's log and
# JSON go straight to $OUT (kept if the call runs out of time; the device tool brings back at
# most 8 files, so run few phases a call).
#   bash bench/device_session.sh "phase phase ..."     (carry: wheels)
# Phases: tests, kernels, sweep, llama, longctx, moe, qwen3,
# profile (PROFILES="model:mode:bs[:tp[:ar]] ...", ar: any word turns on the custom all-reduce),
# dsv3, prefix, structured, serving, accuracy, dp1 (one GPU), dp4 and dp2x2 (four GPUs) (see below).
set -uo pipefail
OUT=${OUT:-out}; LOGS=$OUT; mkdir -p "$OUT"
export SPECSERVE_MODELS_DIR=$PWD/models PYTHONUNBUFFERED=1
# NVLink multicast stays off in every process on the lent machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site wheels/base/*.whl \
    > /tmp/pip.log 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation . >> /tmp/pip.log 2>&1 || { echo "install failed"; tail /tmp/pip.log; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B="python $PWD/bench/one_batch.py --steps 48"
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  (cd /tmp && timeout "${PHASE_S:-560}" "$@") > "$LOGS/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s"; tail -${TAIL:-14} "$LOGS/$name.log"
}
for phase in $1; do case $phase in
  tests)  run pytest pytest -q -p no:cacheprovider -m gpu --timeout 300 -rf \
              $(for t in ${TESTS:-test_fp8_checkpoints.py}; do echo "$PWD/tests/$t"; done) ;;
  kernels) run fp8_gemm python $PWD/bench/fp8_gemm.py --out $LOGS/fp8_gemm.json ;;
  sweep)  run sweep python $PWD/bench/fp8_gemm.py --sweep --shapes ${SHAPES:-8b.qkv,8b.o,8b.gate_up,8b.down} \
              --rows ${ROWS:-1,16} --no-moe --out $LOGS/sweep.json ;;
  llama)  run llama8b $B --models llama-8b --batch-sizes 1,16,64 --modes plain,chain --quantizations auto,fp8 \
              --out $LOGS/llama8b.json ;;
  longctx) run longctx $B --models llama-8b --batch-sizes 1 --modes plain,chain --prompt-len 32768 \
              --max-context-len 33500 --kv-cache-dtype auto,fp8_e4m3 --out $LOGS/longctx.json ;;
  moe)    run dsv2 $B --models deepseek-v2-lite --batch-sizes 1,64 --modes plain,chain --quantizations auto,fp8 \
              --draft nextn --out $LOGS/dsv2.json
          run dsv3 $B --models deepseek-v3-4l --batch-sizes 1,64 --modes plain --quantizations auto,fp8 \
              --out $LOGS/dsv3.json ;;
  qwen3)  run qwen3 $B --models qwen3-30b-a3b --batch-sizes 1,16,64 --modes plain,chain --out $LOGS/qwen3.json ;;
  profile) for m in ${PROFILES:-deepseek-v2-lite:plain:1}; do IFS=: read -r model mode bs tp ar <<< "$m"
             name=profile_${model}_${mode}_${bs}_tp${tp:-1}${ar:+_$ar}
             run $name python $PWD/bench/step_profile.py --model $model --mode $mode --batch-size $bs \
                 --tp ${tp:-1} ${ar:+--custom-all-reduce} --out $LOGS/$name.json
           done ;;
  dsv3)   run dsv3 $B --models deepseek-v3-4l --batch-sizes 1,64 --modes plain --quantizations auto,fp8 \
              --out $LOGS/dsv3.json ;;
  prefix) run prefix python $PWD/bench/prefix_cache.py --models llama-8b --modes plain,chain --prompt-len 4096 \
              --uncached-tail 32 --repeats 3 --out $LOGS/prefix_cache.json ;;
  structured) run structured python $PWD/bench/structured.py steps --out $LOGS/structured.json
          run structured_8b python $PWD/bench/structured.py steps --shape llama-8b --out $LOGS/structured_8b.json ;;
  serving) for api in grpc openai; do
             run serving_$api python $PWD/bench/serving.py --launch llama-8b --text --spec chain --api $api \
                 --rates inf --concurrency ${CONCURRENCY:-64} --num-requests ${NUM_REQUESTS:-128} \
                 --max-new-tokens 128 --client-procs 4 --tokenizer-workers ${TOKENIZER_WORKERS:-2} \
                 --server 127.0.0.1:50151 --http-port 50152 --out $LOGS/serving_$api.json
           done ;;
  accuracy) run accuracy python $PWD/bench/fp8_accuracy.py --out $LOGS/fp8_accuracy.json ;;
  # Data-parallel (E29): Ray's slim wheel and its four dependencies in wheels/ray
  # (../shared/docs/device-wheels.md). dp1: the memory GPU tests, two replicas on one GPU.
  dp1|dp4|dp2x2)
          python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
              wheels/ray/*.whl >> /tmp/pip.log 2>&1 || echo "ray wheels: install failed"
          export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
          DP="python $PWD/bench/data_parallel.py --port 50171 --metrics-port 50181"
          case $phase in
            dp1)   run graph_memory pytest -q -p no:cacheprovider -m gpu --timeout 300 -rf \
                       $PWD/tests/test_graph_memory.py
                   run dp_1gpu $DP --launch llama-1b --setups 2x1@0.5 --out $LOGS/dp_1gpu.json ;;
            dp4)   run dp_4x1 $DP --launch llama-8b --setups 4x1 --out $LOGS/dp_4x1.json ;;
            dp2x2) run dp_2x2 $DP --launch llama-8b --setups 2x2 --parts throughput \
                       --out $LOGS/dp_2x2.json ;;
          esac ;;
  *) echo "unknown phase $phase" ;;
esac; done
