"""CUDA graphs of decode steps, one per batch-size bucket.

A step is a chain of functions, each captured as one graph: the first reads the static
input buffers, each later one reads the previous one's outputs. Every graph of an engine (all
batch sizes, largest first, and every step kind) is captured into one memory pool on one
stream (GraphPool), so the pool holds about the largest step's transients plus the outputs.
Between two parts the caller may run host glue such as recording an event, which is why a
speculative iteration is two graphs: verify (then `publish_ready` is recorded) and
draft-extend. A constrained step (structured outputs) is captured the same way: its signal and
wait kernels talk to the grammar process through mapped memory (grammar/channel.py), so no
host glue runs inside it. Replay copies the live inputs into the static buffers; padded rows
get `pad` values (pool row 0, KV slot 0), which write nowhere that matters.
"""
from __future__ import annotations

import gc
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from specserve.engine.progress import progress

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class GraphPool:
    """One memory pool that graphs share, and the one stream every capture into it (and its
    warm-up) runs on. PyTorch's allocator hands a freed block only to an allocation on the
    stream that freed it, so captures on different streams (a new one per capture) could not
    reuse each other's transients although they shared the pool: each bucket kept a
    largest-batch's worth of its own."""

    def __init__(self, device: torch.device):
        self.handle = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)


class _Captured(NamedTuple):
    graphs: list          # one torch.cuda.CUDAGraph per part
    inputs: Any           # the static inputs (a NamedTuple whose tensors are the buffers)
    outputs: list         # every part's outputs (the last part's are the step's)


class GraphedStep:
    """`parts[0](inputs)` -> out0, `parts[1](out0)` -> out1, ... captured per bucket.

    `make_inputs(bs)` builds a NamedTuple of static inputs; `load` refills its tensors.
    Without `max_batch_size`, `buckets` are keys of any kind, smallest first (captured
    extends: runtime/captured_extend.py), and the caller picks one and fills its inputs."""

    def __init__(self, parts: Sequence[Callable], make_inputs: Callable[[Any], NamedTuple],
                 pad: dict, max_batch_size: Optional[int], device: torch.device,
                 buckets: Sequence = DEFAULT_BUCKETS, pool=None):
        self.parts = parts
        self.make_inputs = make_inputs
        self.pad = pad
        self.device = device
        self.buckets = list(buckets) if max_batch_size is None else \
            [b for b in buckets if b < max_batch_size] + [max_batch_size]
        # Given another GraphedStep's pool, the two share memory: each keeps its parts' outputs
        # alive, so a capture reuses only the other's transients, and one step replays at a time.
        self.pool: Optional[GraphPool] = pool
        self.captured: dict[int, _Captured] = {}

    def bucket_for(self, bs: int):
        return next((b for b in self.buckets if b >= bs), None)

    def capture_all(self, what: str) -> None:
        """Capture every bucket; `what` names the step in the progress shown."""
        # A garbage collection during capture could destroy another engine's graphs, which
        # CUDA forbids while a stream captures: collect first, then keep the collector off.
        # (Off CUDA only the tests' eager stand-in captures: nothing to protect.)
        on_cuda = torch.device(self.device).type == "cuda"
        if on_cuda:
            if self.pool is None:
                self.pool = GraphPool(self.device)
            gc.collect()
            gc.disable()
        try:
            with torch.inference_mode():
                # Largest first: smaller ones reuse its memory.
                for bs in progress(self.buckets[::-1], len(self.buckets),
                                   f"capturing CUDA graphs ({what})", "graphs"):
                    self._capture(bs)
        finally:
            if on_cuda:
                gc.enable()

    def release(self) -> None:
        self.captured.clear()
        self.pool = None

    def _capture(self, bs: int) -> None:
        inputs = self.make_inputs(bs)
        stream = self.pool.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up (Triton compiles, allocator settles)
            x = inputs
            for part in self.parts:
                x = part(x)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graphs, outputs, x = [], [], inputs
        for part in self.parts:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool.handle, stream=stream):
                x = part(x)
            graphs.append(graph)
            outputs.append(x)
        self.captured[bs] = _Captured(graphs, inputs, outputs)

    def load(self, **live: torch.Tensor) -> _Captured:
        """Copy the live inputs (batch size = their length) into a bucket's static buffers."""
        bs = next(iter(live.values())).shape[0]
        captured = self.captured[self.bucket_for(bs)]
        for name, value in live.items():
            static = getattr(captured.inputs, name)
            static[:bs].copy_(value, non_blocking=True)
            static[bs:].fill_(self.pad.get(name, 0))
        return captured

    @staticmethod
    def replay(captured: _Captured, part: int):
        captured.graphs[part].replay()
        return captured.outputs[part]
