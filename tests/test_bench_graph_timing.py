"""bench/attention_kernels.py's `graph_seconds` (also the MoE and MLA kernel benches'): Triton's
`do_bench_cudagraph` runs and captures on a stream of its own that does not wait for the
current one, so the inputs made on the current stream must be complete before it starts (the
H200's illegal-address rows of the seventeenth round, docs/benchmarks.md)."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.testing  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from attention_kernels import graph_seconds  # noqa: E402


def test_graph_seconds_waits_for_the_current_stream_before_timing(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("synchronize"))

    def do_bench_cudagraph(fn, rep):
        fn()
        events.append("timed")
        return 2.5  # ms

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", do_bench_cudagraph)
    assert graph_seconds(lambda: events.append("call")) == 0.0025
    assert events == ["synchronize", "call", "timed"]
