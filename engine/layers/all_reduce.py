"""The tensor-parallel all-reduce of decode and verify steps, chosen by message size.

A decode step all-reduces small activations twice a layer (bs x hidden: 8 KB at bs=1 on the 8B
shape, 512 KB at bs=64; 64 calls a step at 32 layers). NCCL's ring and tree algorithms pay tens
of microseconds a call at those sizes without NVLink multicast (NVLS, which stays off on our
machines), which at tp=4 was most of the step's gap to the bandwidth limit ([E28]). Over
symmetric memory (torch.distributed._symmetric_memory: a buffer per rank that every rank maps,
CUDA IPC handles exchanged once, signal pads for the barriers) one kernel does the reduction:

* one-shot (small messages): each rank copies its input into its buffer; after a barrier every
  rank reads all the buffers and sums them. One step of latency, (n - 1) x size read per rank.
* two-shot (mid sizes): a reduce-scatter then an all-gather through the same buffers; each rank
  reads 2 (n - 1) / n x size, less than one-shot once bandwidth, not latency, dominates.
* NCCL past the buffer's size (prefill), where its bandwidth-optimal rings win.

The buffer is allocated before any capture, so all three replay inside CUDA graphs. On by
default (EngineConfig.custom_all_reduce; `--disable-custom-all-reduce` turns it off); without
it or without CUDA, NCCL (gloo on the CPU) does every call.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch
import torch.distributed as dist

from specserve.engine.layers import symmetric_memory
from specserve.engine.layers.one_shot import symmetric_one_shot

logger = logging.getLogger(__name__)


class Algorithm(Enum):
    ONE_SHOT = "one_shot"
    TWO_SHOT = "two_shot"
    NCCL = "nccl"


# The symmetric kernels move 16-byte vectors; other sizes (never a layer's activations, which
# are rows of the hidden size) go to NCCL. They sum these dtypes (float16 is not one of them).
ALIGNMENT = 16
DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AllReduceSizes:
    """Message sizes (bytes) up to which each algorithm runs; two_shot_max is the buffer's."""

    one_shot_max: int = 128 * 1024  # measured crossover (bench/allreduce.py, H100 x2 and x4)
    two_shot_max: int = 8 * 1024 * 1024

    def __post_init__(self):
        if not 0 <= self.one_shot_max <= self.two_shot_max:
            raise ValueError(f"all-reduce sizes: need 0 <= one_shot_max <= two_shot_max, got "
                             f"{self.one_shot_max} and {self.two_shot_max}")

    def algorithm(self, nbytes: int) -> Algorithm:
        if nbytes % ALIGNMENT:
            return Algorithm.NCCL
        if nbytes <= self.one_shot_max:
            return Algorithm.ONE_SHOT
        if nbytes <= self.two_shot_max:
            return Algorithm.TWO_SHOT
        return Algorithm.NCCL


class SymmetricAllReduce:
    """One- and two-shot all-reduce over a symmetric-memory buffer, NCCL past it; rows of
    activations go through our own one-shot kernel (layers/one_shot.py), which can also add
    the residual and apply the RMSNorm that follow a row-parallel layer."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device,
                 sizes: AllReduceSizes = AllReduceSizes()):
        self.group, self.sizes = group, sizes
        self.group_name = group.group_name
        self.buffer = symmetric_memory.empty(sizes.two_shot_max, device)
        self.handle = symmetric_memory.rendezvous(self.buffer, group)  # every rank, collectively
        self.rows = symmetric_one_shot(group, device)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(RMSNorm(sum + residual) * weight, sum + residual) in one kernel, or None where the
        rows do not fit it (the caller then all-reduces and normalises)."""
        rows = self._as_rows(x)
        if rows is None or residual.shape != x.shape or not residual.is_contiguous():
            return None
        out, res_out = self.rows.run(rows, residual.view(rows.shape), weight, eps)
        return out.view(x.shape), res_out.view(x.shape)

    def _as_rows(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        if not x.is_contiguous() or x.dim() == 0 or not x.is_floating_point():
            return None
        rows = x.view(-1, x.shape[-1])
        return rows if self.rows.rows_fit(rows) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._as_rows(x)
        if rows is not None:
            return self.rows.run(rows).view(x.shape)
        nbytes = x.numel() * x.element_size()
        algorithm = (self.sizes.algorithm(nbytes) if x.is_contiguous() and x.dtype in DTYPES
                     else Algorithm.NCCL)
        if algorithm is Algorithm.NCCL:
            dist.all_reduce(x, group=self.group)
            return x
        staged = self.buffer[:nbytes].view(x.dtype)
        if algorithm is Algorithm.ONE_SHOT:
            out = torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x.view(-1), "sum",
                                                              self.group_name)
            return out.view(x.shape)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        x.view(-1).copy_(staged)
        return x


def make_all_reduce(group: dist.ProcessGroup, size: int, device: torch.device,
                    enabled: bool) -> SymmetricAllReduce | None:
    """The group's SymmetricAllReduce where it can run (CUDA, every pair of GPUs peer-to-peer
    accessible, the ops in this torch build), else None: NCCL then does every call. Collective:
    every rank calls it, and all take the same branch (the checks are the same on each)."""
    if not enabled or device.type != "cuda" or size == 1:
        return None
    why_not = _unsupported_reason(size, device)
    if why_not is not None:
        logger.info("custom all-reduce off (%s): NCCL does every all-reduce", why_not)
        return None
    reducer = SymmetricAllReduce(group, device)
    logger.info("custom all-reduce: rows up to %d KiB a rank through the one-shot kernel (residual "
                "add and RMSNorm fused), torch's one-shot up to %d KiB, two-shot up to %d KiB, NCCL "
                "past it", reducer.rows.slot_bytes >> 10, reducer.sizes.one_shot_max >> 10,
                reducer.sizes.two_shot_max >> 10)
    return reducer


def _unsupported_reason(size: int, device: torch.device) -> str | None:
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return "this torch build has no symmetric-memory all-reduce"
    count = torch.cuda.device_count()
    if count < size:  # each rank sees only its own GPU (a cluster scheduler placed it)
        return f"{count} GPUs visible to a rank of {size}"
    for a in range(size):
        for b in range(size):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"no peer access from GPU {a} to GPU {b}"
    return None
