"""Shared fixtures: tiny checkpoints (built once per session) and engines checked for KV leaks."""
from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_no_leaks, make_tiny_checkpoint

os.environ.setdefault("SPECSERVE_DEBUG_FUTURE_MAP", "1")
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on the CPU (before anything imports triton).
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer random Llama with a tokenizer."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="module")
def client(server):
    """A client of the test module's `server` fixture (a ServerProcess)."""
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    """An OpenAI SDK client of the test module's `server` fixture's HTTP front."""
    with server.openai_client() as oai:
        yield oai


@pytest.fixture
def make_engine():
    """Build engines; after the test each must have every KV slot and row free again."""
    from specserve.engine import Engine, EngineConfig

    engines = []

    def build(model: str, **overrides):
        kwargs = dict(model=model, device="cpu", dtype="float32", spec=None)
        kwargs.update(overrides)
        if kwargs["device"] != "cpu" and "max_total_tokens" not in kwargs:
            # A test holds several engines at once (a reference beside the one under test):
            # each takes a fifth of the GPU, not the default share meant for one per device.
            kwargs.setdefault("gpu_memory_utilization", 0.2)
        if (kwargs.get("attention_backend") == "triton" and kwargs["device"] == "cpu"
                and torch.cuda.is_available()):
            # Triton runs on the CPU only in its interpreter, which a CUDA machine does not use
            # (see above); the gpu-marked tests run the same kernels there.
            pytest.skip("Triton on CPU tensors needs the interpreter (machines without CUDA)")
        engine = Engine(EngineConfig(**kwargs))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        try:
            assert_no_leaks(engine)
        finally:
            engine.shutdown()
