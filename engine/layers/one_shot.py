"""A one-shot all-reduce of activation rows over peer memory, with the residual add and the
RMSNorm that follow a row-parallel layer in the same kernel.

A decode step's all-reduces are a few rows of the hidden size (8 KB a row on the 8B shape),
and each one sits between a row-parallel GEMM and an add + RMSNorm. The profile of an 8B step
at tp=4 on H100s (docs/benchmarks.md, [E28]) spent 645 us of 3.0 ms in 65 NCCL all-reduces and
130 us more in the 65 norms after them; torch's symmetric-memory one-shot kernel was slower
still inside the CUDA graph (860 us). Here one program per row:

1. pushes its row into slot [parity][its rank][row] of every rank's buffer (NVLink stores,
   which do not wait for a reply as remote loads do), then, after a CTA barrier, raises its
   flag in every rank's flag table: flag[row][its rank] = epoch, a release at system scope;
2. waits until flag[row][r] >= epoch in its own table for every rank r (acquire, system scope;
   not ==: a faster rank that finished this call may already have raised its next epoch);
3. sums the ranks' rows from its own buffer in rank order 0..n-1 in fp32 (every rank the same
   order, so every rank gets the same bits), rounds to the activation dtype (the all-reduce's
   output), and with a residual adds it and normalises it as `add_rmsnorm` does.

Epochs count each row program's calls in device memory (`epochs[row]`, read and written by that
program alone), so CUDA-graph replays need no host-side state; every rank runs the same
sequence of calls with the same row counts, so the counters agree across ranks. Two slots per
rank (the epoch's parity) make a second barrier unnecessary: a rank at epoch e + 2 overwrites
the slot a slower rank read at epoch e only after that rank raised its epoch e + 1 flag, which
it does after finishing epoch e (stream order).

The phases are compile-time switches so that the CPU tests can run them one rank at a time in
Triton's interpreter (every rank's push, then every rank's reduce); on GPUs one launch runs both.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from specserve.engine.layers import symmetric_memory
from specserve.engine.pdl import launch_options, release_dependents, wait_for_predecessor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None

SLOT_BYTES = 512 * 1024   # one rank's rows per parity: 64 rows of the 8B shape (bs=64 decode)
MAX_COLS = 16384          # a program holds one row in registers


if triton is not None:
    @triton.jit
    def _one_shot_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buffers_ptr, flags_ptr, epochs_ptr,
                         rank, n_cols, slot_rows, eps,
                         WORLD: tl.constexpr, BLOCK: tl.constexpr, ADD_NORM: tl.constexpr,
                         PUSH: tl.constexpr, REDUCE: tl.constexpr, PDL: tl.constexpr):
        wait_for_predecessor(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = out_ptr.dtype.element_ty
        epoch = tl.load(epochs_ptr + row) + 1
        parity = epoch % 2
        if PUSH:
            x = tl.load(x_ptr + row.to(tl.int64) * n_cols + cols, mask=mask, other=0.0)
            slot = ((parity * WORLD + rank) * slot_rows + row).to(tl.int64) * n_cols
            for r in tl.static_range(WORLD):
                peer = tl.load(buffers_ptr + r).to(tl.pointer_type(dtype))
                tl.store(peer + slot + cols, x, mask=mask)
            tl.debug_barrier()  # every thread's stores are before the flags (cumulative release)
            # One system-scope fence (the first flag's release) orders the data before every
            # flag: the later relaxed stores follow it in program order (PTX's release pattern).
            for r in tl.static_range(WORLD):
                flags = tl.load(flags_ptr + r).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(flags + row * WORLD + rank, epoch, sem="release" if r == 0 else "relaxed",
                               scope="sys")
        if REDUCE:
            own_flags = tl.load(flags_ptr + rank).to(tl.pointer_type(tl.int32))
            for r in tl.static_range(WORLD):
                # At least the epoch: a fast rank may already have raised its next one.
                while tl.atomic_add(own_flags + row * WORLD + r, 0, sem="relaxed", scope="sys") < epoch:
                    pass
            # ... and one acquire after every flag was seen orders the reads after all of them.
            tl.atomic_add(own_flags + row * WORLD + rank, 0, sem="acquire", scope="sys")
            release_dependents(PDL)
            own = tl.load(buffers_ptr + rank).to(tl.pointer_type(dtype))
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                slot = ((parity * WORLD + r) * slot_rows + row).to(tl.int64) * n_cols
                acc += tl.load(own + slot + cols, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
            x = acc.to(dtype)
            out = out_ptr + row.to(tl.int64) * n_cols + cols
            if ADD_NORM:  # as layers/fused.py's add_rmsnorm: the add rounded, the norm in fp32
                x = (x.to(tl.float32) + tl.load(res_ptr + row.to(tl.int64) * n_cols + cols, mask=mask,
                                                other=0.0).to(tl.float32)).to(dtype)
                tl.store(res_out_ptr + row.to(tl.int64) * n_cols + cols, x, mask=mask)
                h = x.to(tl.float32)
                normed = (h * tl.math.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)).to(dtype)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(out, (w * normed.to(tl.float32)).to(dtype), mask=mask)
            else:
                tl.store(out, x, mask=mask)
            tl.store(epochs_ptr + row, epoch)


class OneShotBuffers:
    """One rank's view of the group's buffers: device tensors of every rank's data and flag
    base addresses, and this rank's per-row epoch counters. `data` and `flags` are this rank's
    own (peer-mapped) regions; `buffer_ptrs`/`flag_ptrs` hold every rank's in this process's
    address space."""

    def __init__(self, world: int, rank: int, data: torch.Tensor, flags: torch.Tensor,
                 buffer_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, slot_bytes: int = SLOT_BYTES):
        self.world, self.rank, self.slot_bytes = world, rank, slot_bytes
        self.data, self.flags = data, flags
        self.buffer_ptrs, self.flag_ptrs = buffer_ptrs, flag_ptrs
        self.max_rows = flags.numel() // world
        self.epochs = torch.zeros(self.max_rows, dtype=torch.int32, device=data.device)

    @staticmethod
    def sizes(world: int, slot_bytes: int = SLOT_BYTES, min_row_bytes: int = 2 * 1024) -> tuple[int, int]:
        """(data bytes, flag count) of one rank's region: two parities of every rank's slot, and
        a flag per (row, rank) for the most rows a slot holds (rows of at least min_row_bytes)."""
        return 2 * world * slot_bytes, (slot_bytes // min_row_bytes) * world

    def rows_fit(self, x: torch.Tensor) -> bool:
        rows, cols = x.shape
        return (0 < rows <= min(self.max_rows, self.slot_bytes // (cols * x.element_size()))
                and cols <= MAX_COLS)

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
            eps: float = 0.0, push: bool = True, reduce: bool = True):
        """The sum of x over the ranks (x: [rows, cols], contiguous, `rows_fit`); with a
        residual, (RMSNorm(sum + residual) * weight, sum + residual). `push`/`reduce` split the
        phases for the interpreter's one-rank-at-a-time tests; a GPU runs both at once."""
        rows, cols = x.shape
        out = torch.empty_like(x)
        res_out = torch.empty_like(x) if residual is not None else out
        _one_shot_kernel[(rows,)](
            x, residual if residual is not None else x, weight if weight is not None else x, out, res_out,
            self.buffer_ptrs, self.flag_ptrs, self.epochs, self.rank, cols,
            self.slot_bytes // (cols * x.element_size()), eps,
            WORLD=self.world, BLOCK=triton.next_power_of_2(cols), ADD_NORM=residual is not None,
            PUSH=push, REDUCE=reduce, num_warps=4 if cols <= 2048 else 8, **launch_options(x.device))
        return out if residual is None else (out, res_out)


def symmetric_one_shot(group: dist.ProcessGroup, device: torch.device) -> OneShotBuffers:
    """The group's OneShotBuffers over torch symmetric memory (collective: every rank calls
    it). The flags start at zero on every rank before any rank may raise one."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    data_bytes, num_flags = OneShotBuffers.sizes(world)
    region = symmetric_memory.empty(data_bytes + 4 * num_flags, device)
    handle = symmetric_memory.rendezvous(region, group)
    region.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    ptrs = [int(p) for p in handle.buffer_ptrs]
    return OneShotBuffers(world, rank, region[:data_bytes], region[data_bytes:].view(torch.int32),
                          torch.tensor(ptrs, dtype=torch.int64, device=device),
                          torch.tensor([p + data_bytes for p in ptrs], dtype=torch.int64, device=device))
