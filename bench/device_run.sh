#!/usr/bin/env bash
# One device session: install, GPU tests, benchmarks. Logs and JSON go to $OUT.
# Usage (on the GPU machine, repo root):
#   bash bench/device_run.sh "<pytest args>" "<one_batch.py args>" "<peers_hf.py args>"
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export SPECSERVE_MODELS_DIR=$PWD/models  # the demo pair, from the checkout (not site-packages)
# The machine has torch, triton, transformers, grpcio and pytest; the rest comes as wheels.
# grpcio-health-checking/reflection pinned to the machine's grpcio (1.84.0): newer ones refuse it.
python -m pip install -q --no-deps --no-index --find-links wheels/base pytest-timeout pyzmq prometheus-client \
    grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 protobuf > "$OUT/pip.log" 2>&1
# FlashInfer (optional): flashinfer-python 0.5.3 and apache-tvm-ffi wheels in wheels/fi; its
# kernels are JIT-compiled with the machine's nvcc on first use.
if ls wheels/fi/*.whl > /dev/null 2>&1; then
  python -m pip install -q --no-deps --no-index wheels/fi/*.whl >> "$OUT/pip.log" 2>&1 || echo "flashinfer install failed"
fi
# A regular (not editable) install: the folders map onto specserve.* through setup.py.
python -m pip install -q --no-deps --no-build-isolation . >> "$OUT/pip.log" 2>&1 || echo "install failed"
(cd /tmp && python -c "import specserve.engine") || tail "$OUT/pip.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
if [ -n "${1:-}" ]; then
  # `pytest`, not `python -m pytest`: the latter puts the repo root on sys.path, where the
  # specserve/ folder (the namespace root alone) would shadow the installed package.
  pytest -q -p no:cacheprovider $1 > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"; tail -25 "$OUT/pytest.log"
fi
if [ -n "${2:-}" ]; then
  python bench/one_batch.py $2 --out "$OUT/one_batch.json" > "$OUT/one_batch.log" 2>&1
  echo "bench rc=$?"; tail -40 "$OUT/one_batch.log"
fi
if [ -n "${3:-}" ]; then
  python bench/peers_hf.py $3 --out "$OUT/peers_hf.json" > "$OUT/peers_hf.log" 2>&1
  echo "peers rc=$?"; tail -8 "$OUT/peers_hf.log"
fi
if [ -n "${SERVE_DEMO:-}" ]; then  # the gRPC server on the GPU: one streamed generation
  (cd /tmp && specserve serve --device cuda --port 50071 > "$OUT/serve.log" 2>&1) & server=$!
  for _ in $(seq 120); do
    (cd /tmp && python -m specserve.clients.healthcheck --addr 127.0.0.1:50071 \
        --service specserve.v1.GenerationService > /dev/null 2>&1) && break; sleep 1; done
  (cd /tmp && python -m specserve.clients.demo --server 127.0.0.1:50071) > "$OUT/serve_demo.log" 2>&1
  echo "serve demo rc=$?"; tail -12 "$OUT/serve_demo.log"; kill -TERM $server; wait $server
fi
