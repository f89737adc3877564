"""Constant index ranges made once per (length, device) instead of once per step.

A speculative step indexes its batch, its nodes and its draft branches with small aranges;
each `torch.arange` is a kernel of its own in the step's CUDA graph. The few lengths a step
uses (batch sizes up to the largest bucket, the tree's node count) are cached here.
Callers must treat the result as read-only.
"""
from __future__ import annotations

import torch

_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def arange(n: int, device) -> torch.Tensor:
    """torch.arange(n) as int64 on `device` (shared: never write to it)."""
    device = torch.device(device)
    key = (n, device)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached
    out = torch.arange(n, dtype=torch.int64, device=device)
    # A tensor made while a CUDA graph captures lives in the graph's private pool, which a
    # later capture may reuse: only tensors made outside a capture (the warm-up) are kept.
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _CACHE[key] = out
    return out
