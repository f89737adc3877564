# specserve on the NVIDIA container runtime:
#   docker build -t specserve .
#   docker run --gpus all -p 50051:50051 -v /path/to/model:/model specserve --model /model
# As a Ray node (docs/deployment.md): --entrypoint ray specserve start --head --block, or
# start --address=HEAD:6379 --block on a worker.
# Arguments after the image name go to `specserve serve` (see `specserve serve --help`). The
# port is SPECSERVE_PORT (-e SPECSERVE_PORT=6000 -p 6000:6000), not --port: the HEALTHCHECK
# probes SPECSERVE_PORT.
ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

# Build stage: a virtual environment with specserve and its dependencies. The torch wheels from
# PyPI bring their own CUDA libraries, so the runtime image only needs the driver-facing base.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS builder
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu packages follow the pinned base image (CUDA_VERSION/UBUNTU_VERSION) rather than pins.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/specserve
ENV PATH=/opt/specserve/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py ./
COPY specserve/ specserve/
COPY engine/ engine/
COPY server/ server/
COPY clients/ clients/
# Version ranges live in pyproject.toml. The `ray` extra: the image also runs as a Ray head or
# worker (`ray start ...` as the command, as KubeRay does) for --data-parallel and multi-node tp.
# hadolint ignore=DL3013
RUN pip install ".[triton,ray]"

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}
ENV DEBIAN_FRONTEND=noninteractive
# Triton builds each kernel's launcher with a C compiler and the Python headers at run time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /opt/specserve /opt/specserve
# The bundled demo checkpoints (used when no --model is given).
COPY models/ /opt/specserve/models/
ENV PATH=/opt/specserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPECSERVE_MODELS_DIR=/opt/specserve/models \
    SPECSERVE_PORT=50051 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN useradd --create-home --uid 1001 specserve
# Numeric, so that runtimes enforcing runAsNonRoot can verify it.
USER 1001
WORKDIR /home/specserve
EXPOSE 50051
# Readiness: SERVING only once the engine is loaded and warm; the start period covers weight
# loading, KV allocation and CUDA-graph capture. Through sh, so that it reads SPECSERVE_PORT when
# it runs: `specserve serve` listens on that port when no --port is given.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["sh", "-c", \
         "exec python3 -m specserve.clients.healthcheck --addr 127.0.0.1:${SPECSERVE_PORT} --service specserve.v1.GenerationService"]
ENTRYPOINT ["specserve", "serve", "--host", "0.0.0.0"]
