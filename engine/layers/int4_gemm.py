"""INT4 weights with 16-bit activations (W4A16): the weight form every kernel and the reference
agree on, the decode GEMM, the large-M path and the CPU reference.

The form (`Int4Weight`, made at load by quantization/int4.py from AWQ or GPTQ tensors): a
weight W [N, K] is 4-bit codes q in [0, 15] packed eight to an int32 along K, row-major
([N, K / 8]: a weight row's codes are contiguous, so the decode kernel streams whole rows),
and per group of `group_size` input columns one scale and one zero point per output row
([N, G] each, scales in the checkpoint's float dtype, zeros uint8):
W[n, k] = (q[n, k] - zero[n, k // gs]) * scale[n, k // gs], computed in fp32 and rounded to
the activation dtype (the reference's weight, bit for bit, in every kernel).

Within a row the codes are interleaved in blocks of 8 W codes (W = `interleave` words; chosen
at load by `interleave_for`): code k = 8 W b + W j + w lies in word W b + w at bits 4 j. A
decode step loads one block of a tile of rows as [rows, W] words (wide, coalesced loads: a
row's W words are contiguous), and nibble j of every word is the plane of W consecutive
codes k = 8 W b + W j + w: each plane is a plain 2-D tile, multiplied against W contiguous
columns of x, with no reshape or gather in registers. W = 1 is the plain order (code k at
word k // 8, bits 4 (k % 8)).

- Decode (M <= 16 rows, CUDA): `_w4a16_kernel`, one program per (column tile, K slice). Per
  plane, a mask (and a shift shared by two planes) put the nibble into the mantissa of 1.0
  (t = 1 + q 2^-11, a bit pattern: no int-to-float conversion), and one fma per element
  gives the exact (q - z) s = t (2^11 s) - (2^11 + z) s (both terms per row and group, exact
  in fp32 for 16-bit scales; fp32 scales take (q - z) * s), rounded to the activation
  dtype. The product with x: tl.dot on tensor cores, rows padded to 16 (`W4Config.w_left`,
  the rule's: the weight plane on the left, Marlin's orientation, so wgmma takes it from
  registers), or multiply-and-sum on the CUDA cores into per-lane fp32 accumulators
  (`dot` off: no padding; with `round_bits` the bf16 rounding by integer ops, kept in fp32
  for the next fma). The rest is the skinny GEMM's (layers/skinny_gemm.py): split-K
  partials merged in a fixed order by the last program of a tile (its workspace and
  arrival counters; deterministic, no second kernel, capturable in a CUDA graph), the bias,
  and for the fused gate/up weight the SiLU-and-mul epilogue (a program reads a gate tile
  and its up tile).
- Mid M (17-256 rows: large decode batches, verify steps): the same kernel on tl.dot over
  row tiles (`W4Config.block_m`: 16 to 256 rows; the rule's 64, or 32 or 16 where 64 rows do
  not fit the shared memory), where dequantising the whole weight first would write and read
  it again in 16 bits. Two costs shape it, as in Marlin and Machete: each program dequantises
  its weight tile once per row tile (a row tile covering all M, 128 or 256 rows, dequantises
  each weight element once and uses it for every row), and the 8B's 4096-wide shards make
  only 64-96 column tiles for 132 SMs, each walking all of K with the dequantisation on its
  critical path. So K is split here too (`split_for` counts the programs of every row tile),
  with the decode path's partials and arrival counters (one counter per column and row
  tile; the partials are per row, so row tiles never share one): every SM has work, the
  sums are merged in split order, and the result is the same whatever the split.
- Shared memory (layers/int4_shared_memory.py): a launch must fit the device's, or it fails
  at its first call. `fit_shared_memory` lowers the stages of a rule's or tuned config (to 2),
  then the mid-M row tile; a config given by the caller (the sweep, tests) must fit as given.
- Large M (prefill): `_dequantize_kernel` writes the weight in the activation dtype, then
  cuBLAS (a GEMM at M in the hundreds is compute-bound: the extra write and read of the
  16-bit weight is a few percent of it).
- CPU: `int4_linear_reference` (torch unpacking, then F.linear).

Configs: `TUNED_W4_CONFIGS` and `TUNED_INTERLEAVE` (engine/layers/int4_tuned.py, written by
`bench/fp8_gemm.py --install-int4` from an H100 sweep), else the rules of `default_w4_config`
and `interleave_for`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from specserve.engine.sm_count import num_sms
from specserve.engine.layers.activation import silu_and_mul
from specserve.engine.layers.int4_shared_memory import (
    Operands, shared_memory_limit, shared_memory_need)
from specserve.engine.layers.int4_tuned import TUNED_INTERLEAVE, TUNED_W4_CONFIGS
from specserve.engine.layers.skinny_gemm import (
    PARTIAL_CAPACITY, SkinnyWorkspace, _scratch_values, workspace_for)
from specserve.engine.pdl import launch_options, release_dependents, wait_for_predecessor

try:
    import triton
    import triton.language as tl

    from specserve.engine.layers.skinny_gemm import (
        _add_bias, _epilogue, _merge_splits, _pair_rows)
except ImportError:  # the CPU build needs no Triton
    triton = None

PACK = 8          # 4-bit codes per int32
MAX_ROWS = 16     # decode-sized M: one row tile, K split across programs
TILED_MAX_ROWS = 256  # M up to this: row tiles (`W4Config.block_m`); above: dequantise + cuBLAS
TILE_ROWS = 64    # the rule's row tile above MAX_ROWS
ROW_TILES = (16, 32, 64, 128, 256)  # the row tiles a config may name
MIN_STAGES = 2  # fitting a config to the shared memory lowers its stages down to this
# The rule's interleave (not yet measured): a step of 256 codes, two groups of 128, so a
# thread's scale and zero work is shared by 4 planes of its rows.
DEFAULT_INTERLEAVE = 32
MIN_DOT_INTERLEAVE = 16  # tl.dot takes planes of at least 16 columns
# Whether `default_w4_config`'s decode-sized configs (up to MAX_ROWS rows: the sizes timed) on
# tl.dot dequantise two weights an instruction (`W4Config.paired_dequant`; where exact). On: on an
# H100 the paired kernel led today's on every 8B shape at M 1 and 16 by 8-13 % (bench/fp8_gemm.py
# --variants w4a16, AWQ's fp16 scales; docs/benchmarks.md, fourteenth round), though with 40 %
# fewer instructions a weight it still streams at 31-46 % of copy bandwidth: not issue-bound.
# The loop's weights come through 16-byte cp.async (LDGSTS.128, pipelined over the stages), its
# scales and zeros by 16 plain loads an iteration (LDG.E.U16 and LDG.E.U8), which the pipeliner
# leaves out (sm_90 SASS, `python tests/sm90_sass.py w4a16`). Packing each (row, group)'s scale
# and zero into one 4-byte word at load made them cp.async too, and the kernel slower: on an
# H200 (bench/fp8_gemm.py --variants w4a16, M = 1-16, AWQ's fp16 scales) qkv 13.8 -> 17.0 us,
# o 8.9 -> 11.6, gate/up + SiLU 44.4 -> 51.8, down 22.7 -> 25.4, and the 8B AWQ bs=1 step 3.64
# -> 4.17 ms (the staged words are read back from shared memory 2 bytes at a time, and the
# stages grow); not kept (docs/benchmarks.md, seventeenth round).
PAIRED_DEQUANT = True


class Int4Weight(NamedTuple):
    """A W4A16 weight [N, K] (see the module docstring)."""

    qweight: torch.Tensor   # int32 [N, K / 8], codes interleaved in blocks of 8 * interleave
    scales: torch.Tensor    # float [N, G]
    zeros: torch.Tensor     # uint8 [N, G]
    group_size: int         # input columns per group (K for one group per row)
    interleave: int = 1     # words per block (1: the plain order)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * PACK


class W4Config(NamedTuple):
    """Launch parameters of the decode kernel (its K step is the weight's block of
    8 * interleave codes)."""

    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    dot: bool = True          # tl.dot (rows padded to 16); False: multiply-and-sum
    round_bits: bool = False  # multiply-and-sum in bf16: round the weight by integer ops
    w_left: bool = False      # tl.dot with the weight plane as the left operand
    # Rows of a row tile above MAX_ROWS (one of ROW_TILES; 0: the rule's, `row_tiles`); up to
    # MAX_ROWS the kernel takes one tile of all the rows and this is unused.
    block_m: int = 0
    # tl.dot only: dequantise two weights an instruction (`_paired_planes`) where that is
    # exact (`paired_dequant_exact`), else the kernel's fma dequantisation
    paired_dequant: bool = False


def interleave_for(n: int, k: int, group_size: int) -> int:
    """The words per interleave block of a weight [n, k] (`TUNED_INTERLEAVE` where measured):
    the largest power of two up to DEFAULT_INTERLEAVE whose blocks tile K and whose planes
    lie in one group (`plane_groups`)."""
    tuned = TUNED_INTERLEAVE.get((n, k, group_size))
    if tuned is not None and plane_groups(group_size, k, tuned):
        return tuned
    words = DEFAULT_INTERLEAVE
    while words > 1 and not plane_groups(group_size, k, words):
        words //= 2
    return words


def plane_groups(group_size: int, k: int, interleave: int) -> int:
    """The planes of a block (8, each `interleave` codes wide) that share one group: 8 where a
    block lies in one group, group_size / interleave where a block spans whole groups, else 0
    (K not whole blocks, or a plane crossing a group: not served)."""
    block = PACK * interleave
    if k % block:
        return 0
    if group_size >= k or group_size % block == 0:
        return PACK
    if group_size % interleave == 0 and block % group_size == 0:
        return group_size // interleave
    return 0


def paired_dequant_exact(x_dtype: torch.dtype, scale_dtype: torch.dtype) -> bool:
    """Whether the paired dequantisation (`_paired_planes`) equals the reference bit for bit:
    16-bit activations with scales of their dtype, or bf16 activations with fp16 scales (AWQ's
    and GPTQ's, each split into two bf16 parts); not fp32 activations (the product is not
    rounded to 16 bits), fp32 scales, or bf16 scales with fp16 activations (a bf16 scale may
    lie outside fp16's range)."""
    return (x_dtype in (torch.float16, torch.bfloat16) and scale_dtype == x_dtype
            or (x_dtype, scale_dtype) == (torch.bfloat16, torch.float16))


def pack_rows(q: torch.Tensor, interleave: int = 1) -> torch.Tensor:
    """Codes [N, K] (K a multiple of 8 * interleave, values 0..15) -> int32 [N, K / 8]: code
    8 W b + W j + w at bits 4 j of word W b + w (W = interleave)."""
    n, k = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    planes = q.to(torch.int64).view(n, k // (PACK * interleave), PACK, interleave)  # [n, b, j, w]
    words = (planes << shifts[:, None]).sum(dim=2).view(n, k // PACK)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_rows(qweight: torch.Tensor, interleave: int = 1) -> torch.Tensor:
    """`pack_rows`'s inverse: int32 [N, K / 8] -> codes [N, K] (uint8)."""
    n, words = qweight.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    blocks = qweight.view(n, words // interleave, 1, interleave)
    return ((blocks >> shifts[:, None]) & 0xF).to(torch.uint8).view(n, words * PACK)


def dequantize_int4(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the codes, scales and zeros stand for, computed in fp32, cast to dtype."""
    q = unpack_rows(w.qweight, w.interleave).float()
    scales = w.scales.float().repeat_interleave(w.group_size, dim=1)[:, :q.shape[1]]
    zeros = w.zeros.float().repeat_interleave(w.group_size, dim=1)[:, :q.shape[1]]
    return ((q - zeros) * scales).to(dtype)


def int4_linear_reference(x: torch.Tensor, w: Int4Weight,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x W^T (+ bias) with W dequantised to x's dtype: the CPU path and the kernels' reference."""
    return F.linear(x, dequantize_int4(w, x.dtype), bias)


def runs_decode_kernel(x: torch.Tensor, w: Int4Weight, skinny: bool) -> bool:
    """Whether `int4_linear` takes the W4A16 kernel: CUDA, `skinny`, at most 256 rows, and a
    layout whose planes are wide enough for tl.dot and lie in one group."""
    n, k = w.shape
    return (triton is not None and x.is_cuda and skinny and 1 <= x.numel() // k <= TILED_MAX_ROWS
            and w.interleave >= MIN_DOT_INTERLEAVE and plane_groups(w.group_size, k, w.interleave) > 0)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None,
                skinny: bool = True) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) in x's dtype: the W4A16 kernel where `runs_decode_kernel`,
    the dequantise kernel and cuBLAS elsewhere on CUDA, the reference on the CPU."""
    if triton is None or not x.is_cuda:
        return int4_linear_reference(x, w, bias)
    if runs_decode_kernel(x, w, skinny):
        return w4a16_gemm(x, w, bias)
    return F.linear(x, dequantize_int4_gpu(w, x.dtype), bias)


def int4_linear_silu_and_mul(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None,
                             skinny: bool = True) -> torch.Tensor:
    """silu_and_mul(int4_linear(x, w, bias)) for a fused [2I, K] gate/up weight: one kernel
    where the W4A16 kernel runs."""
    if runs_decode_kernel(x, w, skinny):
        return w4a16_gemm(x, w, bias, silu_mul=True)
    return silu_and_mul(int4_linear(x, w, bias, skinny=False))


@functools.lru_cache(maxsize=None)
def default_w4_config(m: int, n: int, k: int, group_size: int, paired: bool = False,
                      device: torch.device = torch.device("cuda")) -> W4Config:
    """`TUNED_W4_CONFIGS` where measured (`n`: output columns, of each half with `paired`; at
    this M or the nearest measured one above, `_tuned_w4_config`), else a rule not yet timed on a device (`bench/fp8_gemm.py --sweep` times it), chosen by
    the instructions per weight element of the compiled loop (ptxas for sm_90, 8B shapes):
    tl.dot with the weight plane on the left (wgmma takes it from registers, x from shared
    memory) over tiles of 128 columns, 64 with the gate/up pair (more spill), about 5.4-5.6
    instructions an element; x on the left over 64 columns 6.2-6.3 (the padded x fragments
    are moved into place for every mma), multiply-and-sum 9-11. K split by `split_for`.
    Above MAX_ROWS (M in 17-256): row tiles of 64 on tl.dot with x on the left (the orientation
    measured; the sweep tries the other, and row tiles of 16-256), over 64-column tiles, K
    split by `split_for` while the programs of all row tiles are fewer than the SMs: at 64
    rows the 8B's qkv 2 ways, o and down 4 (64 column tiles), gate/up none (224); at 256 rows
    (4 row tiles) none."""
    tuned = _tuned_w4_config(m, n, k, group_size, paired)
    config = rule_w4_config(m, n, k, paired, device) if tuned is None else tuned
    pair_planes = PAIRED_DEQUANT and config.dot and m <= MAX_ROWS
    return config._replace(paired_dequant=config.paired_dequant or pair_planes)


def rule_w4_config(m: int, n: int, k: int, paired: bool = False,
                   device: torch.device = torch.device("cuda")) -> W4Config:
    """`default_w4_config`'s rule (its docstring), without the measured table."""
    if m > MAX_ROWS:
        return W4Config(block_n=64, split_k=split_for(m, n, k, paired, 64, device),
                        num_warps=4, num_stages=4)
    block_n = 64 if paired else 128
    return W4Config(block_n=block_n, split_k=split_for(m, n, k, paired, block_n, device),
                    num_warps=4, num_stages=4, w_left=True)


def _tuned_w4_config(m: int, n: int, k: int, group_size: int, paired: bool) -> Optional[W4Config]:
    """The measured config of this shape at M, else at the nearest measured M above it on the
    same side of MAX_ROWS (a decode-sized kernel pads its rows anyway: a config measured at 16
    rows serves fewer; a mid-M config names its row tile, whose shared memory does not depend
    on M; one measured at fewer rows may not fit more), else None."""
    swept = [rows for rows, *shape in TUNED_W4_CONFIGS if tuple(shape) == (n, k, group_size, paired)
             and m <= rows and (rows <= MAX_ROWS) == (m <= MAX_ROWS)]
    if not swept:
        return None
    return W4Config(**TUNED_W4_CONFIGS[min(swept), n, k, group_size, paired])


def split_for(m: int, n: int, k: int, paired: bool, block_n: int,
              device: torch.device = torch.device("cuda"), block_m: int = 0) -> int:
    """The rule's split-K for column tiles of `block_n` (and above MAX_ROWS row tiles of
    `block_m`, 0: TILE_ROWS): doubled while the programs (column tiles times row tiles times
    splits) are fewer than the SMs, each slice stays at least 1024 deep and the partials (one
    fp32 value per split, row and output column) fit the workspace."""
    programs = -(-n // block_n) * (1 if m <= MAX_ROWS else -(-m // (block_m or TILE_ROWS)))
    split_k = 1
    while (programs * split_k < num_sms(device) and k // (2 * split_k) >= 1024
           and _scratch_values(2 * split_k, m, n, paired) <= PARTIAL_CAPACITY):
        split_k *= 2
    return split_k


def row_tiles(m: int, dot: bool, block_m: int = 0) -> tuple[int, ...]:
    """The kernel's row tiles for M rows, preferred first: up to MAX_ROWS one tile of the rows
    (padded to 16 for tl.dot); above, a config's `block_m` alone, else TILE_ROWS, 32 or 16
    (`fit_shared_memory`)."""
    if m <= MAX_ROWS:
        rows = 1 << (m - 1).bit_length()
        return (max(16, rows) if dot else rows,)
    if block_m:
        return (block_m,)
    return TILE_ROWS, TILE_ROWS // 2, TILE_ROWS // 4


@functools.lru_cache(maxsize=None)
def fit_shared_memory(config: W4Config, m: int, ops: Operands, device: torch.device,
                      lower_stages: bool = True) -> Optional[tuple[W4Config, int]]:
    """(config, row tile) of a launch at M rows whose shared memory fits `device`'s: the first
    of `row_tiles` at which the config fits, with `lower_stages` at the most stages from its
    own down to MIN_STAGES (fewer stages cost less than a smaller row tile, which reads the
    weight once more per tile); None where none fits (or, without `lower_stages`, the config
    has fewer than MIN_STAGES: not modelled)."""
    if config.num_stages < MIN_STAGES:
        return None
    limit = shared_memory_limit(device)
    lowest = MIN_STAGES if lower_stages else config.num_stages
    for block_m in row_tiles(m, config.dot, config.block_m):
        for stages in range(config.num_stages, lowest - 1, -1):
            if shared_memory_need(ops, block_m, config.block_n, config.dot, config.w_left,
                                  stages) <= limit:
                return config._replace(num_stages=stages), block_m
    return None


def check_int4(w: Int4Weight) -> None:
    n, k = w.shape
    groups = -(-k // w.group_size)
    assert w.qweight.dtype == torch.int32 and w.qweight.is_contiguous()
    assert w.scales.shape == w.zeros.shape == (n, groups), \
        f"scales {tuple(w.scales.shape)} and zeros {tuple(w.zeros.shape)} must be [{n}, {groups}]"
    assert w.zeros.dtype == torch.uint8 and w.scales.is_contiguous() and w.zeros.is_contiguous()
    assert w.interleave >= 1 and w.interleave & (w.interleave - 1) == 0 and k % (PACK * w.interleave) == 0, \
        f"interleave {w.interleave}: a power of two whose blocks of {PACK * w.interleave} tile K = {k}"


def w4a16_gemm(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor] = None,
               silu_mul: bool = False, config: Optional[W4Config] = None,
               workspace: Optional[SkinnyWorkspace] = None) -> torch.Tensor:
    """x [..., K] (at most 256 rows) @ W^T (+ bias) in x's dtype, the W4A16 kernel (more than 16
    rows: row tiles on tl.dot, `W4Config.block_m`); with `silu_mul`, silu_and_mul of it for a
    fused [2I, K] gate/up weight (result [..., I]). Without `config`, the rule's or tuned one,
    fitted to the shared memory; a given one must fit as it stands."""
    n_rows, k = w.shape
    check_int4(w)
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    assert 1 <= m <= TILED_MAX_ROWS and x.shape[-1] == k
    if silu_mul:
        assert n_rows % 2 == 0, "silu_mul needs the fused [2I, K] gate/up weight"
    n_cols = n_rows // 2 if silu_mul else n_rows
    planes_per_group = plane_groups(w.group_size, k, w.interleave)
    assert planes_per_group, \
        f"interleave {w.interleave}: a plane of its blocks must lie in one group of {w.group_size}"
    given = config
    assert config is None or config.block_m in (0, *ROW_TILES), \
        f"block_m {config.block_m}: 0 (the rule's row tiles) or one of {ROW_TILES}"
    config = config or default_w4_config(m, n_cols, k, w.group_size, silu_mul, x.device)
    ops = Operands(w.interleave, PACK // planes_per_group, x.element_size(),
                   w.scales.element_size(), silu_mul)
    fit = fit_shared_memory(config, m, ops, x.device, lower_stages=given is None)
    if fit is None and given is None:
        # A measured config was swept at the shape's engine layout; at another interleave (more
        # words a plane) it may not fit the shared memory: the rule's config, fitted, instead.
        config = rule_w4_config(m, n_cols, k, silu_mul, x.device)
        fit = fit_shared_memory(config, m, ops, x.device)
    assert fit is not None, (
        f"{config} at {m} rows, {ops}: more shared memory than the device's "
        f"{shared_memory_limit(x.device)} bytes (layers/int4_shared_memory.py)")
    config, block_m = fit
    assert not config.dot or w.interleave >= MIN_DOT_INTERLEAVE, \
        f"tl.dot takes planes of at least {MIN_DOT_INTERLEAVE} columns (interleave {w.interleave})"
    assert config.dot or not config.paired_dequant, "paired_dequant: on tl.dot only"
    # the inline asm on CUDA; its bit-equal pure-Triton form where the interpreter runs
    paired = ("off" if not (config.paired_dequant and paired_dequant_exact(x.dtype, w.scales.dtype))
              else "asm" if x.is_cuda else "emulated")
    if bias is not None:
        assert bias.shape == (n_rows,) and bias.is_contiguous()
    y = torch.empty((m, n_cols), dtype=x.dtype, device=x.device)
    tiles, m_tiles = triton.cdiv(n_cols, config.block_n), triton.cdiv(m, block_m)
    partials = arrivals = y  # never touched without split-K
    if config.split_k > 1:
        workspace = workspace or workspace_for(x.device)
        assert _scratch_values(config.split_k, m, n_cols, silu_mul) <= workspace.partials.numel(), \
            f"split-K {config.split_k} at {m} rows: partials over the workspace's"
        assert tiles * m_tiles <= workspace.arrivals.numel()
        partials, arrivals = workspace.partials, workspace.arrivals
    assert m <= MAX_ROWS or config.dot, "more than 16 rows: row tiles on tl.dot"
    words_per_split = triton.cdiv(triton.cdiv(k // PACK, config.split_k), w.interleave) * w.interleave
    _w4a16_kernel[(tiles, config.split_k, m_tiles)](
        x2, w.qweight, w.scales, w.zeros, bias if bias is not None else y, y, partials, arrivals,
        m, n_cols, k // PACK, w.scales.shape[1], w.group_size, words_per_split, x2.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT_K=config.split_k,
        BLOCK_M=block_m, BLOCK_N=config.block_n, WORDS=w.interleave,
        PLANES_PER_GROUP=planes_per_group, DOT=config.dot, W_LEFT=config.dot and config.w_left,
        # exact fma dequantisation needs 16-bit scales (`_dequantized_plane`)
        FMA_DEQUANT=w.scales.dtype in (torch.float16, torch.bfloat16),
        ROUND_BITS=config.round_bits and not config.dot and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PAIRED=paired,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x.device))
    return y.view(*x.shape[:-1], n_cols)


def dequantize_int4_gpu(w: Int4Weight, dtype: torch.dtype, block_n: int = 64,
                        block_words: int = 16) -> torch.Tensor:
    """`dequantize_int4` by one Triton kernel (the large-M path's weight): a program unpacks
    [block_n, block_words] packed words, whatever the interleave and group size."""
    n, k = w.shape
    check_int4(w)
    out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // PACK, block_words))](
        w.qweight, w.scales, w.zeros, out, n, k, w.scales.shape[1], w.group_size,
        BLOCK_N=block_n, BLOCK_WORDS=block_words, WORDS=w.interleave,
        # planes sharing a group load its scales once; else (an odd group size) each plane
        PLANES_PER_GROUP=plane_groups(w.group_size, k, w.interleave) or 1, num_warps=4,
        **launch_options(w.qweight.device))
    return out


def _pair_asm(magic: str, one: str, fma: str, split_scale: bool) -> str:
    """`_paired_planes`' inline asm for one 16-bit type (`magic`: BIAS twice, `one`: 1.0 twice,
    `fma`: its x2 fma): $2 the shifted word, $3 -(BIAS + z) twice, $4 the scale (head) twice,
    with `split_scale` $5 the tail twice; $0, $1 the two weights."""
    scale = (f"fma.rn.{fma} u, t, $5, nz;\n    fma.rn.{fma} t, t, $4, u;" if split_scale
             else f"fma.rn.{fma} t, t, $4, nz;")
    return (f"{{\n    .reg .b32 t, {'u, ' if split_scale else ''}one, nz;\n"
            f"    lop3.b32 t, $2, 0x000F000F, {magic}, 0xEA;\n"
            f"    mov.b32 one, {one};\n    mov.b32 nz, 0x80008000;\n"
            f"    fma.rn.{fma} t, t, one, $3;\n    {scale}\n    mov.b32 {{$0, $1}}, t;\n    }}")


if triton is not None:
    _PAIR_ASM_BF16_SPLIT = tl.constexpr(_pair_asm("0x43004300", "0x3F803F80", "bf16x2", True))
    _PAIR_ASM_BF16 = tl.constexpr(_pair_asm("0x43004300", "0x3F803F80", "bf16x2", False))
    _PAIR_ASM_F16 = tl.constexpr(_pair_asm("0x64006400", "0x3C003C00", "f16x2", False))

    @triton.jit
    def _group_terms(scales, zeros, rows, group, n_groups, FMA_DEQUANT: tl.constexpr):
        """Per row of a tile, the fp32 terms of its dequantisation in `group`: for a nibble
        at bits 12-15 and one at bits 16-19 of `_dequantized_plane`'s float, (2^11 s,
        -(2^11 + z) s) and (2^7 s, -(2^7 + z) s) (all exact: the offsets are integers of at
        most 12 bits, s a 16-bit float of at most 11 significant bits); or (s, z) twice."""
        at = rows * n_groups + group
        s = tl.load(scales + at).to(tl.float32)
        z = tl.load(zeros + at).to(tl.float32)
        if FMA_DEQUANT:
            a_lo = s * 2048.0
            b_lo = tl.fma(-z, s, -a_lo)  # -(z s) - 2^11 s: exact, so one rounding-free fma
            a_hi = s * 128.0
            b_hi = tl.fma(-z, s, -a_hi)
        else:
            a_lo, b_lo, a_hi, b_hi = s, z, s, z
        return a_lo, b_lo, a_hi, b_hi

    @triton.jit
    def _dequantized_plane(packed, J: tl.constexpr, a_lo, b_lo, a_hi, b_hi,
                           FMA_DEQUANT: tl.constexpr):
        """Nibble J of the words [rows, W] dequantised in fp32: exactly (q - z) s. With
        FMA_DEQUANT the nibble is moved into the mantissa of 1.0, at bits 12-15 (t =
        1 + q 2^-11) or 16-19 (t = 1 + q 2^-7), so that the eight planes of a word take
        four shifts (<< 12, << 8, none, >> 8, >> 12 serve two nibbles each but the ends),
        one mask-and-or and no int-to-float conversion; t a + b (`_group_terms`) is one
        fma whose exact value (q - z) s is representable: no rounding."""
        if FMA_DEQUANT:
            HIGH: tl.constexpr = J == 2 or J == 4 or J == 6 or J == 7  # bits 16-19, else 12-15
            POS: tl.constexpr = 16 if HIGH else 12
            if POS > 4 * J:
                bits = packed << (POS - 4 * J)
            elif POS < 4 * J:
                bits = packed >> (4 * J - POS)
            else:
                bits = packed
            t = ((bits & (0xF << POS)) | 0x3F800000).to(tl.float32, bitcast=True)
            if HIGH:
                w = tl.fma(t, a_hi[:, None], b_hi[:, None])
            else:
                w = tl.fma(t, a_lo[:, None], b_lo[:, None])
        else:
            q = ((packed >> (4 * J)) & 0xF).to(tl.float32)
            w = (q - b_lo[:, None]) * a_lo[:, None]
        return w

    @triton.jit
    def _pair_terms(scales, zeros, rows, group_lo, group_hi, n_groups, dtype: tl.constexpr):
        """Per row of a tile, the 32-bit words `_paired_planes` takes for a pair of planes in
        groups `group_lo` and `group_hi` (the same group where the block lies in one), each two
        16-bit floats of `dtype` side by side (low half: the low plane's): the scales (head),
        for fp16 scales with bf16 x their parts past bf16's 8 significant bits (tail, else
        unused), and -(BIAS + z)."""
        at_lo = rows * n_groups + group_lo
        at_hi = rows * n_groups + group_hi
        head_lo, tail_lo = _scale_parts(tl.load(scales + at_lo), dtype)
        head_hi, tail_hi = _scale_parts(tl.load(scales + at_hi), dtype)
        z_lo = tl.load(zeros + at_lo).to(tl.int32)
        z_hi = tl.load(zeros + at_hi).to(tl.int32)
        # ^ 0x80008000 (written as an int32): both sign bits flipped
        neg_zero_word = (_pair_magic(dtype) | z_lo | (z_hi << 16)) ^ -0x7FFF8000
        return head_lo | (head_hi << 16), tail_lo | (tail_hi << 16), neg_zero_word

    @triton.jit
    def _scale_parts(s, dtype: tl.constexpr):
        """A scale s [rows] as the 16 bits (int32) of `dtype` floats head and tail: s itself and
        0 where s is of dtype; for an fp16 s and bf16 dtype head = s cut to bf16's 8
        significant bits (toward zero) and tail = s - head, at most 3 significant bits (s has
        11): both exactly bf16, head + tail = s, and tail carries s's sign (-0 for a negative
        s that head holds whole, so that a zero product keeps the sign of s)."""
        if s.dtype == dtype:
            head = s.to(tl.uint16, bitcast=True).to(tl.int32)
            tail = head & 0
        else:
            bits = s.to(tl.float32).to(tl.int32, bitcast=True)
            cut = (bits & -65536).to(tl.float32, bitcast=True)
            rest = s.to(tl.float32) - cut  # exact: the low bits of bits
            head = (bits >> 16) & 0xFFFF
            tail = ((rest.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | ((bits >> 16) & 0x8000)
        return head, tail

    @triton.jit
    def _pair_magic(dtype: tl.constexpr):
        """Two 16-bit floats BIAS side by side whose last 4 mantissa bits are zero: a nibble
        or-ed into them makes BIAS + q exactly (bf16 0x4300 = 128, ulp 1; fp16 0x6400 = 1024,
        ulp 1)."""
        if dtype == tl.bfloat16:
            magic = 0x43004300
        else:
            magic = 0x64006400
        return magic

    @triton.jit
    def _half_value(bits, dtype: tl.constexpr):
        """The 16-bit float of dtype whose bits are the low 16 of `bits` (int32), in fp32."""
        if dtype == tl.bfloat16:
            value = ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            value = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return value

    @triton.jit
    def _to_half(w, dtype: tl.constexpr):
        """fp32 w rounded once to nearest even in the 16-bit dtype, subnormals and overflow as
        the hardware rounds them (bf16 by integer ops on the bits, `_rounded`: the
        interpreter's fp32 -> bf16 cast truncates and flushes subnormals)."""
        if dtype == tl.bfloat16:
            bits = _rounded(w, dtype, True).to(tl.int32, bitcast=True)
            half = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            half = w.to(dtype)
        return half

    @triton.jit
    def _paired_planes(packed, P: tl.constexpr, head_word, tail_word, neg_zero_word,
                       dtype: tl.constexpr, SPLIT_SCALE: tl.constexpr, PAIRED: tl.constexpr):
        """Planes P and P + 4 of the words [rows, W] dequantised in `dtype` (16-bit) as one pair
        plane [rows, 2 W] whose column 2 w + h is column w of plane P + 4 h (the kernel loads
        x's columns in that order: a dot sums over K in any order). The words
        (`_pair_terms`): per row, two scales (head, and with SPLIT_SCALE tail) and -(BIAS + z).

        Nibbles P and P + 4 lie at bits 4 P and 4 P + 16 of a word: one shift, and one
        and-or with `_pair_magic`, make two 16-bit floats BIAS + q side by side. Packed
        16-bit instructions (x2: both halves at once) then give the weight:
        - (BIAS + q) - (BIAS + z) = d = q - z, exactly: both are integers of at most 11 bits
          (fp16: 1024 + 15) or 8 (bf16: 128 + 15), d in -15..15, all representable, so the
          sum is exact (and +0 where q = z, as the reference's q - z);
        - d s rounded once to the 16-bit dtype: d has at most 4 significant bits, s at most
          11 (fp16) or 8 (bf16), so the exact product has at most 15 and is what the reference
          computes in fp32 exactly (fp32 keeps 24 bits, and its range holds every product of a
          16-bit float and 15, subnormals included: a bf16 subnormal s times an integer is a
          multiple of 2^-133, an fp32 subnormal's grid is 2^-149); both round that exact
          value once, to nearest even, to a subnormal where it is one, past the largest
          finite value to infinity (the reference's cast does too), and a zero product keeps
          the sign of s in both.
        SPLIT_SCALE (fp16 scales, bf16 x: s is not a bf16): s = head + tail (`_scale_parts`),
        d tail is exact in bf16 (4 + 3 significant bits of 8), and one fma d head + d tail
        rounds the exact d s once; no overflow or subnormal (|d s| in 2^-24..15 * 65504).
        So the pair is the reference's weight bit for bit. Not exact (so not taken,
        `paired_dequant_exact`): fp32 activations or scales, bf16 scales with fp16 x.

        PAIRED "asm": the steps as fma.rn.{bf16x2,f16x2} (t 1 + (-(BIAS + z)); d s + (-0),
        whose -0 addend leaves the product's value and sign), which sm_80 has for bf16 (its
        sub/mul.bf16x2 need sm_90; ptxas emits HADD2/HMUL2 for them either way).
        "emulated": the same values in fp32, rounded once (the interpreter runs no asm)."""
        if P > 0:
            shifted = packed >> (4 * P)  # (arithmetic: the high bits are masked off)
        else:
            shifted = packed
        heads = head_word[:, None]
        tails = tail_word[:, None]
        neg_zeros = neg_zero_word[:, None]
        if PAIRED == "asm":
            if SPLIT_SCALE:
                lo, hi = tl.inline_asm_elementwise(
                    _PAIR_ASM_BF16_SPLIT, "=h,=h,r,r,r,r", [shifted, neg_zeros, heads, tails],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
            elif dtype == tl.bfloat16:
                lo, hi = tl.inline_asm_elementwise(
                    _PAIR_ASM_BF16, "=h,=h,r,r,r", [shifted, neg_zeros, heads],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
            else:
                lo, hi = tl.inline_asm_elementwise(
                    _PAIR_ASM_F16, "=h,=h,r,r,r", [shifted, neg_zeros, heads],
                    dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            t = (shifted & 0x000F000F) | _pair_magic(dtype)
            zeros = neg_zeros ^ -0x7FFF8000
            lo = _emulated_weight(t, zeros, heads, tails, dtype, SPLIT_SCALE)
            hi = _emulated_weight(t >> 16, zeros >> 16, heads >> 16, tails >> 16, dtype,
                                  SPLIT_SCALE)
        return _joined(lo, hi)

    @triton.jit
    def _emulated_weight(t, zeros, heads, tails, dtype: tl.constexpr, SPLIT_SCALE: tl.constexpr):
        """`_paired_planes`' weight from the low halves of its words, in fp32 (every step exact
        as in the asm) rounded once to dtype."""
        d = _half_value(t, dtype) - _half_value(zeros, dtype)
        w = d * _half_value(heads, dtype)
        if SPLIT_SCALE:
            w += d * _half_value(tails, dtype)  # the exact d s: at most 15 bits
        return _to_half(w, dtype)

    @triton.jit
    def _joined(a, b):
        """[R, C] and [R, C] -> [R, 2 C] whose column 2 c + h is column c of a (h = 0) or b."""
        return tl.reshape(tl.join(a, b), [a.shape[0], 2 * a.shape[1]])

    @triton.jit
    def _rounded(w, dtype: tl.constexpr, ROUND_BITS: tl.constexpr):
        """w rounded to `dtype` as the reference rounds it. ROUND_BITS (bf16): round to nearest
        even by integer ops on the fp32 bits, the result kept in fp32 (finite w)."""
        if ROUND_BITS:
            bits = w.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            rounded = bits.to(tl.float32, bitcast=True)
        else:
            rounded = w.to(dtype)
        return rounded

    @triton.jit
    def _plane_product(acc, x_plane, w_plane, DOT: tl.constexpr, W_LEFT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
        """acc plus x_plane [BLOCK_M, W] times w_plane [BLOCK_N, W]^T: tl.dot into [BLOCK_M,
        BLOCK_N] (W_LEFT: into its transpose [BLOCK_N, BLOCK_M]), or products summed per lane
        into [BLOCK_M, BLOCK_N, W] (reduced over W once after the loop)."""
        if DOT:
            if W_LEFT:
                acc = tl.dot(w_plane, tl.trans(x_plane), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(x_plane, tl.trans(w_plane), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.fma(x_plane.to(tl.float32)[:, None, :], w_plane.to(tl.float32)[None, :, :], acc)
        return acc

    @triton.jit
    def _w4a16_kernel(x, qweight, scales, zeros, bias, y, partials, arrivals, M, n_cols,
                      words_per_row, n_groups, group_size, words_per_split, stride_xm, stride_ym,
                      HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
                      PLANES_PER_GROUP: tl.constexpr, DOT: tl.constexpr, W_LEFT: tl.constexpr,
                      FMA_DEQUANT: tl.constexpr, ROUND_BITS: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, PAIRED: tl.constexpr):
        # n_cols: output columns (I with SILU_MUL, whose weight has 2 * I rows). A K step is
        # one interleave block (WORDS words, 8 * WORDS codes; K a whole number of them): its 8
        # planes. Offsets count words (K / 8 a row), which keeps the compiler's knowledge of
        # their alignment: the weight loads are 16-byte vectors.
        wait_for_predecessor(PDL)
        tile, split = tl.program_id(0), tl.program_id(1)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if SILU_MUL:
            rows, partner_rows = _pair_rows(offs_n, n_cols, n_cols)
        else:  # columns past the end read row 0: never stored
            rows = tl.where(offs_n < n_cols, offs_n, 0).to(tl.int64)
            partner_rows = rows
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_w = tl.arange(0, WORDS)
        m_mask = offs_m < M
        dtype = x.dtype.element_ty
        split_scale: tl.constexpr = scales.dtype.element_ty != dtype  # PAIRED: fp16 s, bf16 x
        if DOT:
            if W_LEFT:
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, WORDS], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N, WORDS], tl.float32)
        w_ptrs = qweight + rows[:, None] * words_per_row + offs_w[None, :]
        up_ptrs = qweight + partner_rows[:, None] * words_per_row + offs_w[None, :]
        x_ptrs = x + offs_m[:, None] * stride_xm + offs_w[None, :]
        w_begin = split * words_per_split
        w_end = tl.minimum(w_begin + words_per_split, words_per_row)
        for word in range(w_begin, w_end, WORDS):
            packed = tl.load(w_ptrs + word)
            if SILU_MUL:
                packed_up = tl.load(up_ptrs + word)
            k = word * 8
            if PAIRED != "off":
                for p in tl.static_range(4):  # planes p and p + 4
                    if p % PLANES_PER_GROUP == 0:  # a pair of groups not yet loaded
                        lo = (k + p * WORDS) // group_size
                        hi = (k + (p + 4) * WORDS) // group_size
                        pair_terms = _pair_terms(scales, zeros, rows, lo, hi, n_groups, dtype)
                        if SILU_MUL:
                            up_pair_terms = _pair_terms(scales, zeros, partner_rows, lo, hi,
                                                        n_groups, dtype)
                    # x's planes p and p + 4 in the pair plane's column order
                    x_pair = _joined(tl.load(x_ptrs + k + p * WORDS, mask=m_mask[:, None], other=0.0),
                                     tl.load(x_ptrs + k + (p + 4) * WORDS, mask=m_mask[:, None],
                                             other=0.0))
                    w_pair = _paired_planes(packed, p, *pair_terms, dtype, split_scale, PAIRED)
                    acc = _plane_product(acc, x_pair, w_pair, DOT, W_LEFT, DOT_PRECISION)
                    if SILU_MUL:
                        up_pair = _paired_planes(packed_up, p, *up_pair_terms, dtype, split_scale,
                                                 PAIRED)
                        acc_up = _plane_product(acc_up, x_pair, up_pair, DOT, W_LEFT,
                                                DOT_PRECISION)
            else:
                for g in tl.static_range(8 // PLANES_PER_GROUP):  # the groups the block spans
                    group = (k + g * PLANES_PER_GROUP * WORDS) // group_size
                    terms = _group_terms(scales, zeros, rows, group, n_groups, FMA_DEQUANT)
                    if SILU_MUL:
                        up_terms = _group_terms(scales, zeros, partner_rows, group, n_groups,
                                                FMA_DEQUANT)
                    # j must stay a constexpr (`_dequantized_plane` branches on it): a plain
                    # assignment makes it a tensor on triton 3.6, a loop variable stays one
                    for j in tl.static_range(g * PLANES_PER_GROUP, (g + 1) * PLANES_PER_GROUP):
                        x_plane = tl.load(x_ptrs + k + j * WORDS, mask=m_mask[:, None], other=0.0)
                        w_plane = _rounded(_dequantized_plane(packed, j, *terms, FMA_DEQUANT), dtype,
                                           ROUND_BITS)
                        acc = _plane_product(acc, x_plane, w_plane, DOT, W_LEFT, DOT_PRECISION)
                        if SILU_MUL:
                            up_plane = _rounded(
                                _dequantized_plane(packed_up, j, *up_terms, FMA_DEQUANT), dtype,
                                ROUND_BITS)
                            acc_up = _plane_product(acc_up, x_plane, up_plane, DOT, W_LEFT,
                                                    DOT_PRECISION)
        if DOT:
            if W_LEFT:
                acc = tl.trans(acc)
                acc_up = tl.trans(acc_up)
        else:
            acc = tl.sum(acc, axis=2)
            acc_up = tl.sum(acc_up, axis=2)
        release_dependents(PDL)
        out_mask = m_mask[:, None] & (offs_n < n_cols)[None, :]
        last = True
        if SPLIT_K > 1:
            # one arrival counter per (column tile, row tile); the partials are per row
            counter = tile + tl.program_id(2) * tl.num_programs(0)
            last, acc, acc_up = _merge_splits(acc, acc_up, partials, arrivals, counter, split, M,
                                              n_cols, offs_m, offs_n, out_mask, SILU_MUL,
                                              SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            if HAS_BIAS:
                acc, acc_up = _add_bias(acc, acc_up, bias, rows, partner_rows, SILU_MUL)
            _epilogue(acc, acc_up, y, offs_m, offs_n, out_mask, stride_ym, SILU_MUL)

    @triton.jit
    def _dequantize_kernel(qweight, scales, zeros, out, N, K, n_groups, group_size,
                           BLOCK_N: tl.constexpr, BLOCK_WORDS: tl.constexpr, WORDS: tl.constexpr,
                           PLANES_PER_GROUP: tl.constexpr, PDL: tl.constexpr):
        # Word i of a row holds codes 8 WORDS (i // WORDS) + WORDS j + i % WORDS, j = 0..7;
        # the scale and zero of a word's code are loaded once for PLANES_PER_GROUP planes.
        wait_for_predecessor(PDL)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        mask = (offs_n < N)[:, None] & (words < K // 8)[None, :]
        packed = tl.load(qweight + rows[:, None] * (K // 8) + words[None, :], mask=mask, other=0)
        first = (words // WORDS) * (8 * WORDS) + words % WORDS
        for g in tl.static_range(8 // PLANES_PER_GROUP):
            group = tl.minimum(first + g * PLANES_PER_GROUP * WORDS, K - 1) // group_size
            at = rows[:, None] * n_groups + group[None, :]
            scale = tl.load(scales + at).to(tl.float32)
            zero = tl.load(zeros + at).to(tl.float32)
            for j in tl.static_range(g * PLANES_PER_GROUP, (g + 1) * PLANES_PER_GROUP):
                q = ((packed >> (4 * j)) & 0xF).to(tl.float32)
                tl.store(out + rows[:, None] * K + (first + j * WORDS)[None, :],
                         ((q - zero) * scale).to(out.dtype.element_ty), mask=mask)
