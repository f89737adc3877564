"""The benches' timing helpers, on the CPU.

- bench/attention_kernels.py's `graph_seconds` (also the MoE and MLA kernel benches'): Triton's
  `do_bench_cudagraph` runs and captures on a stream of its own that does not wait for the
  current one, so the inputs made on the current stream must be complete before it starts (the
  H200's illegal-address rows of the seventeenth round, docs/benchmarks.md).
- bench/one_batch.py's `DecodeWindow`: a batch whose prompts prefill in several chunks is timed
  from the step that carries its last first token (its bs=16, 32k rows had counted the other
  requests' prefill as decode steps)."""
from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.testing  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from attention_kernels import graph_seconds  # noqa: E402
from one_batch import DecodeWindow  # noqa: E402


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


def test_decode_window_opens_when_every_request_has_its_first_token():
    def out(rid: str, n: int):
        return SimpleNamespace(rid=rid, new_token_ids=[1] * n)

    window = DecodeWindow(2)
    assert not window.add([out("a", 1)], 1.0)   # a's first token; b still prefilling
    assert not window.add([out("a", 1)], 2.0)   # a decodes while b prefills: not in the window
    assert window.add([out("a", 1), out("b", 1)], 3.0)  # b's first token opens it
    assert not window.add([out("a", 2), out("b", 3)], 4.0)
    assert not window.add([], 5.0)              # a step without tokens does not move the end
    assert (window.first, window.last, window.tokens, window.all_tokens) == (3.0, 4.0, 5, 9)
