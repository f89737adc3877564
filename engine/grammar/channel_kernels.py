"""The CUDA side of the grammar channel (channel.py): two one-program Triton kernels that read
their sequence numbers from device memory, so a captured graph publishes and waits for new
phases at every replay. The header's layout is channel.py's: its callers pass the word
positions, so this module depends on nothing of it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _signal_kernel(src, n, seq_ptr, ring, header, slot, DEVICE_FLAG_AT: tl.constexpr, BLOCK: tl.constexpr):
    seq = tl.load(seq_ptr) + 1
    base = ring + (seq % 2) * slot
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keep = offs < n
        tl.store(base + offs, tl.load(src + offs, mask=keep), mask=keep)
    tl.debug_barrier()
    # The counter's update is a system-scope release (a MEMBAR.SYS before it): every data store
    # reaches the host before the flag's (the counter itself lives in device memory).
    tl.atomic_xchg(seq_ptr, seq, sem="release", scope="sys")
    tl.store(header + DEVICE_FLAG_AT, seq)


@triton.jit
def _wait_kernel(header, seq_ptr, max_spins, HOST_FLAG_AT: tl.constexpr, TIMED_OUT_AT: tl.constexpr):
    target = tl.load(seq_ptr)
    seen = tl.load(header + HOST_FLAG_AT, volatile=True)
    # An earlier wait gave up: the process is silent, so this one does not spin again (the
    # masks it passes are all allowed: channel.py) until a restart clears the word.
    spins = tl.where(tl.load(header + TIMED_OUT_AT, volatile=True) != 0, max_spins, 0)
    while (seen < target) & (spins < max_spins):
        seen = tl.load(header + HOST_FLAG_AT, volatile=True)
        spins += 1
    # Given up: said in the mapped header, where the engine's host side reads it (GrammarService.dead).
    tl.store(header + TIMED_OUT_AT, (seen < target).to(tl.int64), mask=seen < target)


def signal(flat: torch.Tensor, n: int, seq: torch.Tensor, ring: torch.Tensor, header: torch.Tensor,
           slot: int, device_flag_at: int) -> None:
    """Publish the next phase: `flat[:n]` into ring slot (seq + 1) % 2, then seq + 1 into the
    counter and into header[device_flag_at]."""
    _signal_kernel[(1,)](flat, n, seq, ring, header, slot, DEVICE_FLAG_AT=device_flag_at, BLOCK=BLOCK)


def wait(header: torch.Tensor, seq: torch.Tensor, max_spins: int, host_flag_at: int,
         timed_out_at: int) -> None:
    """Spin until header[host_flag_at] reaches the counter, or give up after `max_spins` reads
    and set header[timed_out_at]; once that is set, return at once."""
    _wait_kernel[(1,)](header, seq, max_spins, HOST_FLAG_AT=host_flag_at, TIMED_OUT_AT=timed_out_at)
