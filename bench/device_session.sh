#!/usr/bin/env bash
# A device session of several phases, each within one 10-minute call; logs and JSON go to
# /tmp/logs and are packed into $OUT/logs.tar.gz at the end (the device tool brings back at
# most 8 files).
#   bash bench/device_session.sh "phase phase ..."          (carry: wheels)
#   bash bench/device_session.sh "phase ... | phase ... | ..."
# The second form runs lanes side by side, lane i alone on GPU i (CUDA_VISIBLE_DEVICES; a lane
# written "0,1= phase ..." gets GPUs 0 and 1), each within LANE_S seconds, with its own ports:
# one lease of a 4-GPU machine does four GPUs' work.
# Phases: tests, kernels, sweep, llama, longctx, moe, qwen3,
# profile (PROFILES="model:mode:bs[:tp[:ar[:quant]]] ...", ar: any word: NCCL for every
# all-reduce; quant: fp8 for random block-FP8 weights, e.g. llama-70b:plain:1:2::fp8),
# dsv3, prefix, structured, serving, mixed (E30's before/after; HOWS="separate mixed mixed-fixed";
# STEP_LOG=1: each server's step log to $LOGS/steps_API_HOW.jsonl), quant (E31's GEMMs and rows),
# drafters (E32), gptfast (the peer; its model.py in wheels/gptfast), tp (8B at tp 1/2/4, then
# tp70), tp70 (70B at tp 4), tp70fp8 (70B FP8 at tp 2), tpdsv2 (DeepSeek-V2-Lite at tp
# 1/2/4), accuracy, dp1 (one GPU), dp4 and dp2x2 (four GPUs) (see below).
set -uo pipefail
OUT=${OUT:-out}; LOGS=${LOGS:-/tmp/logs}; mkdir -p "$OUT" "$LOGS"
export SPECSERVE_MODELS_DIR=$PWD/models PYTHONUNBUFFERED=1
# NVLink multicast stays off in every process on the lent machines (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the wheels (also for a later call that skips the install); SITE_FIRST: a directory searched
# before them (another checkout installed with --target, run beside this one; or
# $PWD/bench/stack_sampler with STACK_SAMPLER=PATH: every process samples its stacks)
export PYTHONPATH=${SITE_FIRST:+$SITE_FIRST:}/tmp/site
if [ -z "${SESSION_INSTALLED:-}" ]; then
  python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site wheels/base/*.whl \
      > /tmp/pip.log 2>&1 || echo "wheel install failed"
  python -m pip install -q --no-deps --no-build-isolation . >> /tmp/pip.log 2>&1 || { echo "install failed"; tail /tmp/pip.log; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  export SESSION_INSTALLED=1
fi
if [[ "$1" == *"|"* ]]; then
  IFS='|' read -ra lanes <<< "$1"
  for i in "${!lanes[@]}"; do
    gpus=$i phases=${lanes[$i]}
    if [[ $phases =~ ^[[:space:]]*([0-9,]+)=(.*)$ ]]; then gpus=${BASH_REMATCH[1]} phases=${BASH_REMATCH[2]}; fi
    CUDA_VISIBLE_DEVICES=$gpus LANE=$i PACK= timeout "${LANE_S:-540}" bash "$0" "$phases" > "$LOGS/lane$i.txt" 2>&1 &
  done
  wait
  for i in "${!lanes[@]}"; do echo "######## lane $i: ${lanes[$i]}"; cat "$LOGS/lane$i.txt"; done
  tar -czf "$OUT/logs.tar.gz" -C /tmp logs
  exit 0
fi
PORT=$((50100 + ${LANE:-0} * 100))  # each lane's servers on ports of their own
B="python $PWD/bench/one_batch.py --steps 48"
run() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  (cd /tmp && timeout "${PHASE_S:-560}" "$@") > "$LOGS/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0))s"; tail -${TAIL:-14} "$LOGS/$name.log"
}
ntests=0
for phase in $1; do case $phase in
  tests|tests:*)  # tests:FILE,FILE::NAME,...[@WORD+WORD] names its test files (else $TESTS)
          files=${TESTS:-test_fp8_checkpoints.py}; [ "$phase" != tests ] && files=${phase#tests:}
          select=()  # @a+b: only tests whose ids hold a or b (pytest -k "a or b")
          [[ $files == *@* ]] && { words=${files#*@}; select=(-k "${words//+/ or }"); files=${files%%@*}; }
          run pytest_${LANE:-main}_$$_$((++ntests)) pytest -q -p no:cacheprovider -m gpu --timeout 300 -rf \
              -o faulthandler_timeout=280 "${select[@]}" $(for t in ${files//,/ }; do echo "$PWD/tests/$t"; done) ;;
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
  profile) for m in ${PROFILES:-deepseek-v2-lite:plain:1}; do IFS=: read -r model mode bs tp ar quant <<< "$m"
             name=profile_${model}_${mode}_${bs}_tp${tp:-1}${ar:+_$ar}${quant:+_$quant}
             run $name python $PWD/bench/step_profile.py --model $model --mode $mode --batch-size $bs \
                 --tp ${tp:-1} ${ar:+--nccl-all-reduce} --quantization ${quant:-auto} --out $LOGS/$name.json
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
                 --server 127.0.0.1:$PORT --http-port $((PORT + 1)) --metrics-port $((PORT + 2)) --out $LOGS/serving_$api.json
           done ;;
  mixed)  for api in ${APIS:-grpc openai}; do for how in ${HOWS:-separate mixed}; do
             # mixed: the adaptive prompt budget; mixed-fixed: no cost model (up to the cap)
             flag=""; [ $how != separate ] && flag=--mixed-steps
             [ $how = mixed-fixed ] && flag="$flag --mixed-step-time-ratio 0"
             run mixed_${api}_$how python $PWD/bench/serving.py --launch llama-8b --text --spec chain \
                 --rates inf --num-requests ${NUM_REQUESTS:-512} --max-new-tokens 128 --client-procs 4 \
                 --tokenizer-workers 2 --api $api --concurrency ${CONCURRENCY:-64,256} $flag --label $how \
                 --server 127.0.0.1:$PORT --http-port $((PORT + 1)) --metrics-port $((PORT + 2)) \
                 ${STEP_LOG:+--step-log $LOGS/steps_${api}_$how.jsonl} --out $LOGS/mixed_${api}_$how.json
           done; done ;;
  quant)  run quant_gemm python $PWD/bench/fp8_gemm.py --shapes 8b.qkv,8b.o,8b.gate_up,8b.down --rows 1,16,64 \
              --no-moe --out $LOGS/quant_gemm.json
          run quant_8b $B --models llama-8b --batch-sizes 1,64 --modes plain,chain --quantizations auto,fp8,awq \
              --out $LOGS/quant_8b.json ;;
  drafters|drafters:*)  # drafters:1,4 names its accept lengths (else $ACCEPTS); the demo rows once
          # NO_DEMO=1: no demo rows (a call that leaves the demo pair behind)
          accepts=${ACCEPTS:-3 1}; [ "$phase" != drafters ] && accepts=${phase#drafters:}; demo=${NO_DEMO:+--no-demo}
          for a in ${accepts//,/ }; do
             run drafters_a$a python $PWD/bench/drafters.py --accept-len $a --batch-sizes ${BATCH_SIZES:-1,16,64,256} \
                 ${DRAFTER_MODES:+--modes $DRAFTER_MODES} $demo --out $LOGS/drafters_a$a.json; demo=--no-demo; done ;;
  w4sweep) # W4_PAIRED=1: the paired dequantisation's configs (the engine's up to 16 rows)
          run w4sweep python $PWD/bench/fp8_gemm.py --sweep --variants w4a16 --shapes 8b.qkv,8b.o,8b.gate_up,8b.down \
              --rows ${W4_ROWS:-1,16} --no-moe ${W4_PAIRED:+--sweep-paired-dequant} \
              --int4-tuned $LOGS/int4_tuned.json --out $LOGS/int4_sweep.json
          # The 8B INT4 rows with the sweep's table, from an install of their own (the lanes
          # beside this one keep importing the session's).
          python $PWD/bench/fp8_gemm.py --install-int4 $LOGS/int4_tuned.json > $LOGS/w4install.log 2>&1 &&
            python -m pip install -q --no-deps --no-build-isolation --target /tmp/site_w4 . >> $LOGS/w4install.log 2>&1
          # W4_BEFORE=1: the installed table's rows first, in the same lane
          [ -n "${W4_BEFORE:-}" ] && run quant_8b_w4before $B --models llama-8b --batch-sizes ${W4_BS:-1,64} \
              --modes ${W4_MODES:-plain,chain} --quantizations auto,awq --out $LOGS/quant_8b_w4before.json
          PYTHONPATH=/tmp/site_w4:/tmp/site run quant_8b_w4tuned $B --models llama-8b --batch-sizes ${W4_BS:-1,64} \
              --modes ${W4_MODES:-plain,chain} --quantizations auto,awq --out $LOGS/quant_8b_w4tuned.json ;;
  gptfast) run gptfast python $PWD/bench/peers_gptfast.py --gpt-fast-path $PWD/wheels/gptfast --models llama-8b \
              --out $LOGS/gptfast.json
          run gptfast_ours $B --models llama-8b --batch-sizes 1 --modes plain --out $LOGS/gptfast_ours.json ;;
  tp)     run tp $B --models llama-8b --batch-sizes 1,64 --modes plain --tp-sizes 1,2,4 --variants ${TP_VARIANTS:-default,nccl} \
              --out $LOGS/tp_8b.json ;&
  tp70)   run tp70 $B --models llama-70b --batch-sizes 1 --modes plain,chain --tp-sizes 4 --out $LOGS/tp_70b.json ;;
  tp70fp8) run tp70fp8 $B --models llama-70b --batch-sizes 1 --modes plain --quantizations fp8 --tp-sizes 2 \
              --out $LOGS/tp_70b_fp8.json ;;
  tpdsv2|tpdsv2:*)  # tpdsv2:1,2 names its tp sizes
          sizes=1,2,4; [ "$phase" != tpdsv2 ] && sizes=${phase#tpdsv2:}
          run tpdsv2_${sizes//,/} $B --models deepseek-v2-lite --batch-sizes 1 --modes plain --tp-sizes $sizes \
              --out $LOGS/tp_dsv2_${sizes//,/}.json ;;
  accuracy) run accuracy python $PWD/bench/fp8_accuracy.py --out $LOGS/fp8_accuracy.json ;;
  # Data-parallel (E29): Ray's slim wheel and its four dependencies in wheels/ray
  # (../shared/docs/device-wheels.md). dp1: the memory GPU tests, two replicas on one GPU.
  dp1|dp4|dp2x2)
          python -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
              wheels/ray/*.whl >> /tmp/pip.log 2>&1 || echo "ray wheels: install failed"
          export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
          # DP_ARGS: more bench/data_parallel.py flags (e.g. --stream-interval 6)
          DP="python $PWD/bench/data_parallel.py --port $((PORT + 71)) --metrics-port $((PORT + 81)) ${DP_ARGS:-}"
          case $phase in
            dp1)   run graph_memory pytest -q -p no:cacheprovider -m gpu --timeout 300 -rf \
                       $PWD/tests/test_graph_memory.py
                   run dp_1gpu $DP --launch llama-1b --setups 2x1@0.5 --out $LOGS/dp_1gpu.json ;;
            # The replicas also at 4 (2) x 256 streams: each sees what the one engine saw.
            dp4)   run dp_4x1 $DP --launch llama-8b --setups 4x1 --concurrency 64,256,1024 \
                       --baseline-concurrency 64,256 --out $LOGS/dp_4x1.json ;;
            dp2x2) run dp_2x2 $DP --launch llama-8b --setups 2x2 --parts throughput \
                       --concurrency 64,256,512 --baseline-concurrency 64,256 --out $LOGS/dp_2x2.json ;;
          esac ;;
  *) echo "unknown phase $phase (GPUs ${CUDA_VISIBLE_DEVICES-})" ;;
esac; done
# Pack the logs for the trip back (the lanes leave it to the session that started them).
[ -z "${PACK-x}" ] || tar -czf "$OUT/logs.tar.gz" -C /tmp logs
