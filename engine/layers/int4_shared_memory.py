"""The shared memory a launch of the W4A16 decode kernel (layers/int4_gemm.py) needs, and the
device's limit: a launch that needs more fails at its first call ("out of resource: shared
memory", raised when the compiled kernel is loaded, so compiling it does not show it).

The need, from Triton 3.6's sm_90 compiles of 240 launches (row tiles 1-64, column tiles
16-128, interleaves 16-128, 2-4 stages, 4 and 8 warps, 16-bit and fp32 activations, the
gate/up pair; tests/int4_sm90_launches.py checks it against every compile it makes): never
less than the compiled `metadata.shared`, at most about 19 KB more.
- Pipelined loads (tl.dot only; the multiply-and-sum path pipelines none): num_stages - 1
  copies of one K step's loads, the packed weight words [block_n, W] int32 (twice with the
  gate/up pair), the eight planes of x [block_m, W], and each group's scales and zeros
  [block_n] (seen pipelined with fp32 scales only; counted always). Wide interleaves make
  them large: a K step is 8 W codes of every row of both tiles.
- Operands staged once more: wgmma (16-bit tl.dot whose left operand has at least 64 rows:
  64-row tiles of x, or the weight on the left over 64 or more columns) reads its right
  operand from shared memory: each of the 8 x planes, transposed, with the weight on the
  left; with x on the left, its planes again and one weight plane [block_n, W]. An fp32 tl.dot
  (no tensor cores) stages one fp32 weight plane; the multiply-and-sum path its reduction.
- A few KB of layout conversions (the epilogue's; 4 KB more with 8 warps).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# The opt-in limit of a block on an H100 or H200 (227 KB): what the CPU sees, so that tests
# there choose the configs a GPU would
H100_SHARED_MEMORY = 232448
_CONVERSIONS = 4096  # the epilogue's layout conversions, at most (measured: 4 KB with 8 warps)
WGMMA_MIN_ROWS = 64  # Triton's Hopper tl.dot takes wgmma from a left operand of 64 rows


def shared_memory_limit(device: torch.device) -> int:
    """The shared memory a block may use on `device` (an H100's off CUDA)."""
    if device.type == "cuda":  # (ROCm's properties lack it: an H100's)
        return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin",
                       H100_SHARED_MEMORY)
    return H100_SHARED_MEMORY


class Operands(NamedTuple):
    """What a launch's shared memory depends on besides its tiles and stages."""

    words: int            # the weight's interleave (a K step is 8 * words codes)
    groups_per_step: int  # groups of scales a K step spans (8 / `plane_groups`)
    x_bytes: int          # bytes of an activation
    scale_bytes: int      # bytes of a scale
    paired: bool          # the gate/up pair (two weight tiles)


def shared_memory_need(ops: Operands, block_m: int, block_n: int, dot: bool, w_left: bool,
                       num_stages: int) -> int:
    """Bytes of shared memory (an upper bound, the module docstring) of the decode kernel at
    row tile `block_m`, column tile `block_n`, on tl.dot (the weight on the left or not) or
    multiply-and-sum, and `num_stages` (at least 2: one stage was not measured)."""
    assert num_stages >= 2, "the need of one stage (no pipelining) is not modelled"
    words = ops.words
    base = _CONVERSIONS + 2 * block_n
    if not dot:
        return base + block_n * words * 4
    halves = 2 if ops.paired else 1
    step = (halves * block_n * (words * 4 + ops.groups_per_step * (ops.scale_bytes + 1))
            + 8 * block_m * words * ops.x_bytes)
    need = base + (num_stages - 1) * step
    if ops.x_bytes == 4:
        return need + block_n * words * 4
    if (block_n if w_left else block_m) >= WGMMA_MIN_ROWS:
        need += 8 * block_m * words * 2 + (0 if w_left else block_n * words * 2)
    return need
