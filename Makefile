# specserve developer entry points. `make test` and `make demo` work on a fresh CPU machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The CPU build of torch is installed first so that nothing pulls a multi-gigabyte CUDA build.
TORCH_CPU ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: venv test test-gpu demo serve bench proto demo-model clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_CPU) || \
		$(PIP) install -q $(TORCH_CPU) --index-url $(TORCH_INDEX)
	$(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

# Two workers, a test file each (its module fixtures shared): the suite's servers, Ray
# clusters and compiles mostly wait or use one core, so two run in about half the time.
TEST_WORKERS ?= 2
test: venv
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile

# On a GPU machine: the decode benchmark, the Hugging Face peers, and the plots in docs/bench/.
BENCH_ARGS ?= --models llama-8b,llama-1b,demo --batch-sizes 1,4,16,64 --modes plain,chain,tree
bench: venv
	mkdir -p docs/bench
	$(PY) bench/one_batch.py $(BENCH_ARGS) --out docs/bench/one_batch.json
	$(PY) bench/peers_hf.py --models llama-8b,llama-1b --out docs/bench/peers_hf.json
	$(PIP) install -q matplotlib
	$(PY) bench/plot.py docs/bench/one_batch.json docs/bench/peers_hf.json --out docs/bench

test-gpu: venv
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info

# --- gRPC server ------------------------------------------------------------------------------
HOST ?= 127.0.0.1
PORT ?= 50051
SERVE_ARGS ?=
DEMO_PORT ?= 50061
DEMO_LOG ?= build/demo-server.log
# specserve/proto/ is generated with this grpcio-tools, whose code runs on every protobuf runtime
# from 5.27.2 on (tests/test_server_proto.py checks the guard). It is installed apart from the
# venv (which keeps the newest grpcio-tools for the staleness test), without dependencies: only
# its bundled protoc and code generators run.
PROTO_GRPC_TOOLS ?= grpcio-tools==1.66.2
PROTO_TOOLS_DIR := build/$(subst ==,-,$(PROTO_GRPC_TOOLS))

serve: venv
	$(PY) -m specserve.cli serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# The server on the bundled demo model in the background; wait for SERVING, stream one
# generation through the SDK, stop the server.
demo: venv
	@mkdir -p $(dir $(DEMO_LOG)); \
	$(PY) -m specserve.cli serve --host 127.0.0.1 --port $(DEMO_PORT) > $(DEMO_LOG) 2>&1 & \
	server=$$!; \
	trap 'kill -TERM $$server 2>/dev/null; wait $$server' EXIT; \
	echo "starting the server on the demo model (log: $(DEMO_LOG))"; \
	until $(PY) -m specserve.clients.healthcheck --addr 127.0.0.1:$(DEMO_PORT) \
			--service specserve.v1.GenerationService > /dev/null; do \
		kill -0 $$server 2>/dev/null || { echo "the server exited:"; cat $(DEMO_LOG); exit 1; }; \
		sleep 1; \
	done; \
	$(PY) -m specserve.clients.demo --server 127.0.0.1:$(DEMO_PORT)

proto: venv
	test -d $(PROTO_TOOLS_DIR) || $(PIP) install -q --no-deps --target $(PROTO_TOOLS_DIR) $(PROTO_GRPC_TOOLS)
	PYTHONPATH=$(PROTO_TOOLS_DIR) $(PY) tools/gen_protos.py

# Train the bundled demo pair (Llama target + EAGLE-3 head) into models/; see models/README.md.
# About 7 minutes on one H100/H200 with DEMO_ARGS=--compile; the CPU works but takes hours.
demo-model: venv
	$(PY) tools/train_demo.py --out models $(DEMO_ARGS)
