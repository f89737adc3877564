"""Programmatic dependent launch (PDL) for the Triton kernels of a forward.

Replayed from a CUDA graph, a bs=1 decode step is a chain of a few hundred short kernels, and
each boundary still costs the drain of one kernel plus the launch and ramp-up of the next
(about 0.3 ms of an 8B step's 6.4 ms on an H100, `bench/step_profile.py`). With PDL (Hopper
and newer) a kernel launched with the attribute may start before its predecessor has
finished, as early as the predecessor allows, and waits (`griddepcontrol.wait`) for the
predecessor to complete and its writes to be visible.

The contract every kernel launched with `launch_options` keeps: each of its programs calls
`wait_for_predecessor` before it reads or writes any memory that a kernel before it reads or
writes (the reads below excepted). Then a kernel only starts its real work once its
predecessor has completed, and that predecessor completed only after waiting for its own, so
every earlier kernel is complete too (the same order as without PDL).

Where a kernel signals its dependents early (`release_dependents`, `griddepcontrol.
launch_dependents`) the next kernel's programs are launched once every program of this one has
signalled, and sit resident in their wait until it completes: the launch and the programs'
start-up overlap its tail. Signalling right after the wait in every kernel made every step
slower (H100, 8B bs=1 6.36 ms against 6.05 ms: the early dependents held SM resources through
the whole of the bandwidth-bound GEMMs), so kernels signal where their long part is behind
them: the latency-bound ones (RMSNorm, the MLA query and value products, the router, the decode
attention) after their wait, the streaming ones (skinny GEMMs, the decode MoE experts) after
their main loop, before the split-K merge or combine. Measured on an H100 (`bench/one_batch.py`,
one lease, against no early signals): DeepSeek-V2-Lite bs=1 plain 2.76 against 2.85 ms, NextN
6.10 against 6.24 ms; Qwen3-30B-A3B chain 4.75 against 4.95 ms; Llama 8B bs=1 6.00 against
6.05 ms; bs=16 rows unchanged. `SPECSERVE_PDL_EARLY=0` turns the early signals off. One
streaming kernel does not signal: the fused q/k/v+RoPE GEMM, whose dependent is the decode
attention. Let in during the GEMM's split-K merge, a long context's split-KV programs made the
8B FP8 step at 32k 0.3 ms slower with the bf16 pool and 0.7 ms with the FP8 pool (H200,
one lease, that release removed and nothing else: 5.60 -> 5.30 and 5.95 -> 5.28 ms), and at 128
tokens the release gained nothing (bs 1 and 64, plain and chain, bf16 and FP8: within 1-2 %).

Reads before the wait. A kernel's programs start once every program of its predecessor has
signalled, and every kernel here signals only after its own wait; a predecessor that does not
signal (any other kernel) lets them start once it has completed. Either way, every kernel
launched before the predecessor has completed. So a kernel may read before its wait memory
that no kernel writes (weights, RoPE tables), and memory that its predecessor does not write
where its callers guarantee that (the decode attention's KV indices, which the backend fills
before the model's first layer). It never writes before its wait. An L2 prefetch
(`prefetch_l2`) is a hint and may name any line of a buffer: the L2 is the GPU's point of
coherence, so a prefetched line that the predecessor then writes is not read stale. These
early reads (`EARLY_READS`: the RMSNorm weight, the q/k/v kernel's prefetch of its first
weight columns where asked for, the decode attention's KV indices and prefetch of a short
sequence's K/V) overlap the predecessor's tail instead of following it.
`SPECSERVE_PDL_EARLY_READS=0` moves them after the wait (an A/B of `bench/one_batch.py`).

`SPECSERVE_PDL=0` in the environment turns it off (an A/B in `bench/one_batch.py`, or a
driver that refuses the launch attribute).
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None
try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _TRITON_HAS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # no Triton, or one without PDL
    _TRITON_HAS_PDL = False


@functools.lru_cache(maxsize=None)
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability 9.0 or newer, a
    Triton that has the launch option, and not switched off."""
    if not _TRITON_HAS_PDL or device.type != "cuda" or os.environ.get("SPECSERVE_PDL") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on `device`: its `PDL` constexpr, and the launch
    attribute where PDL is on. A kernel taking them calls `wait_for_predecessor(PDL)` first."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:
    @triton.jit
    def wait_for_predecessor(PDL: tl.constexpr):
        """Wait until the kernel before this one has completed (a no-op without PDL)."""
        if PDL:  # only ever True where the import above found it
            gdc_wait()

    _EARLY = tl.constexpr(os.environ.get("SPECSERVE_PDL_EARLY") != "0")
    # Whether the reads the module docstring allows before the wait come before it.
    EARLY_READS = tl.constexpr(os.environ.get("SPECSERVE_PDL_EARLY_READS") != "0")

    @triton.jit
    def wait_unless_early_reads(PDL: tl.constexpr):
        """The wait, placed before a kernel's early reads: taken here only where early reads
        are switched off (`wait_after_early_reads` takes it otherwise, after them)."""
        if PDL:
            if not EARLY_READS:
                gdc_wait()

    @triton.jit
    def wait_after_early_reads(PDL: tl.constexpr):
        """The wait, placed after a kernel's early reads (see `wait_unless_early_reads`)."""
        if PDL:
            if EARLY_READS:
                gdc_wait()

    @triton.jit
    def prefetch_l2(ptrs):
        """A hint: fetch the 128-byte lines holding `ptrs` (a tensor of valid addresses) into
        the L2, holding no registers and waiting for nothing. The L2 is the GPU's point of
        coherence, so a line that a running kernel writes later is never read stale: the hint
        is only ever early or useless. CUDA only (inline PTX; not the interpreter)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def release_dependents(PDL: tl.constexpr):
        """Let the next kernel's programs launch before this one completes (they still wait
        for its completion before touching memory): called where this kernel's programs are
        past their long part, so the next launch overlaps their tail (a no-op without PDL)."""
        if PDL:
            if _EARLY:
                gdc_launch_dependents()
