"""Programmatic dependent launch (PDL) for the Triton kernels of a forward.

Replayed from a CUDA graph, a bs=1 decode step is a chain of a few hundred short kernels, and
each boundary still costs the drain of one kernel plus the launch and ramp-up of the next
(about 0.3 ms of an 8B step's 6.4 ms on an H100, `bench/step_profile.py`). With PDL (Hopper
and newer) a kernel launched with the attribute is scheduled while its predecessor runs, and
waits (`griddepcontrol.wait`) for the predecessor to complete and its writes to be visible.

The contract every kernel launched with `launch_options` keeps: each of its programs calls
`wait_for_predecessor` before it reads or writes any memory that a kernel before it reads or
writes. Then a kernel only starts its real work once its predecessor has completed, and that
predecessor completed only after waiting for its own, so every earlier kernel is complete too
(the same order as without PDL); what overlaps is the launch, the scheduling and the index
arithmetic before the wait. Right after waiting, a program lets the next kernel launch: that
kernel's programs can be scheduled once every program of this one has started, so they never
take an SM from a program of this kernel that is still to run.

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
        """Wait until the kernel before this one has completed, then let the next one launch
        (both no-ops without PDL)."""
        if PDL:  # only ever True where the import above found both
            gdc_wait()
            gdc_launch_dependents()
