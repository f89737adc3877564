"""Skinny GEMM: y[M, N] = x[M, K] @ W[N, K]^T for decode-sized M (1..16) in one Triton kernel.

At bs=1..16 a linear layer is a read of its weight: the time is the weight's bytes over the
memory bandwidth. cuBLAS reaches that on the large 8B matrices but runs the small ones (1B's
qkv and o_proj) at 45-65 % of it, and reduces its split-K partials in a second kernel. Here:

- The grid is (N tiles) x (SPLIT_K slices of K). With SPLIT_K > 1 every program stores its
  fp32 partial tile in a scratch buffer and counts its arrival on its N tile's counter; the
  last to arrive sums the SPLIT_K partials in the fixed order s = 0..SPLIT_K-1 (the result does
  not depend on which program came last), applies the epilogue, stores y and sets the counter
  back to zero for the next launch or CUDA-graph replay. No second kernel, no host sync.
- Epilogues: a bias add, and SiLU-and-mul for the fused gate/up weight [2I, K] (gate rows
  0..I-1, up rows I..2I-1): a program reads a gate tile and the matching up tile and writes
  silu(gate) * up [M, I], so the activation kernel disappears. The roundings are the unfused
  path's: the GEMM's output (bias added in fp32, as cuBLAS's epilogue does) rounded to the
  activation dtype, then `silu_and_mul`'s.
- `skinny_qkv_rope`: the q/k/v projection with RoPE and the KV store (`rope_and_store_kv`'s
  work, engine/layers/fused.py) in the epilogue. Its columns are paired like gate and up: a
  program holds the same dims of both halves of one head, rotates q and k heads, and writes q
  to its output and k and v to their KV slots, so the RoPE kernel disappears from decode.
  With Qwen3's per-head q/k RMSNorm a tile is exactly half a head, so a program holds whole
  heads and normalises them before RoPE: the two norm kernels disappear as well.
- FP8 weights (`scale=`, a `WeightScale`): W8A16, the weight tile dequantised in fp32 and
  rounded to the activation dtype before the product (the reference's weight, so the results
  are the 16-bit kernel's on the dequantised weight; on sm_90 the e4m3 values are widened by
  byte moves, `SkinnyConfig.fp8_convert`); or with `SkinnyConfig.fp8_f16` on fp16 tensor
  cores, the weight widened to fp16 exactly and x scaled into fp16 by a power of two a row,
  the scales applied after each step's dot (under half the dequantising loop's instructions
  with `w_left`); or with `SkinnyConfig.fp8_activations` W8A8 on FP8 tensor cores; the shared
  main loop serves all three kernels (docs/architecture.md, "FP8 weight kernels").
- The rows are padded to 16 for `tl.dot` (tensor cores), or, with `SkinnyConfig.dot` off, the
  tile is reduced with multiply-and-sum on the CUDA cores (rows padded to a power of two). The
  H100 sweep found tl.dot faster at every M, so the rule always picks it; the interpreter tests
  use the other path to check 16-bit roundings.

Workspace: the partials and the arrival counters of one device are shared by every call site
(`workspace_for`), sized once, never reallocated (CUDA graphs keep its addresses). Two skinny
GEMMs must therefore not run at the same time on one device: the engine runs every forward on
its one forward stream, which orders them. A caller with concurrent streams passes each
stream its own `SkinnyWorkspace`.

The Triton interpreter's `tl.dot` is wrong for bfloat16 operands, and it truncates fp32 to
bf16 where a GPU rounds to nearest even: test the dot path in fp32 there and the roundings in
fp16 (the multiply-and-sum path is right in every dtype).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from specserve.engine.sm_count import num_sms
from specserve.engine.kvcache.fp8 import is_fp8
from specserve.engine.layers.activation import silu_and_mul
from specserve.engine.pdl import (
    EARLY_READS, launch_options, prefetch_l2, release_dependents, wait_after_early_reads,
    wait_for_predecessor, wait_unless_early_reads)
from specserve.engine.layers.fp8_weight import FP8_DTYPE, WeightScale
from specserve.engine.layers.fp8_convert import (WEIGHT_FP8_CONVERT, check_fp8_convert,
                                                  has_sm90_conversions)
from specserve.engine.layers.fp8_gemm import (
    ACT_GROUP, check_weight, fp8_matmul, fp8_supported, k_uniform, quantize_activations)

try:
    import triton
    import triton.language as tl

    from specserve.engine.layers.fused import store_kv  # the KV pool's store, FP8 included
except ImportError:  # the CPU build needs no Triton
    triton = None

MAX_ROWS = 16                          # M above this goes to cuBLAS
PARTIAL_CAPACITY = 4 * 1024 * 1024     # fp32 partial values in a device's workspace (16 MiB)
COUNTER_CAPACITY = 8192                # arrival counters (N tiles of one split-K launch)


class SkinnyConfig(NamedTuple):
    """Launch parameters of one skinny GEMM."""

    block_n: int      # output columns per program (per half with SiLU-and-mul)
    block_k: int      # reduction step
    split_k: int      # programs sharing one N tile's reduction
    num_warps: int
    num_stages: int
    dot: bool = True  # tl.dot on rows padded to 16; False: multiply-and-sum (small M)
    # With an FP8 weight: W8A8 (x quantised per token per 128-column group, FP8 products,
    # needs dot) instead of W8A16 (the weight dequantised into x's dtype). To be chosen per
    # shape from bench/fp8_gemm.py's measurements.
    fp8_activations: bool = False
    # With an FP8 weight (W8A16): K steps twice the 16-bit config's, so a row's step is the
    # same bytes as the 16-bit kernel's (`fp8_weight_config`), the scales of the k-blocks a
    # step spans loaded per row and broadcast in registers. Off by default until measured
    # (`bench/fp8_gemm.py`'s w8a16_skinny_wide rows; `FP8_WIDE_STEPS`).
    fp8_wide: bool = False
    # With an FP8 weight (W8A16): how its e4m3 values become fp32 (engine/layers/fp8_convert.py:
    # "cast" or "bits", the same values; "bits" on sm_90 and newer only); None:
    # `WEIGHT_FP8_CONVERT`.
    fp8_convert: Optional[str] = None
    # With an FP8 weight (W8A16): the product on fp16 tensor cores (`_rows_to_f16`): the e4m3
    # values widened to fp16 (one conversion a pair, exact), x's rows scaled into fp16 by a
    # power of two each step (exact), each step's fp32 product times the weight rows' and x
    # rows' scales. Not the reference's rounding of the dequantised weight to bf16: the
    # exact product of the FP8 weight, rounded once a step. 16-bit activations only (fp32 ones
    # take the dequantising path), K steps within one k-block of the grid (`fp8_weight_config`
    # drops it where they cannot be; it takes precedence over `fp8_wide`).
    fp8_f16: bool = False
    # tl.dot with the weight tile on the left, W x^T ([block_n, rows]; Marlin's orientation):
    # from 64 columns wgmma takes the dequantised weight from registers and x from shared
    # memory, where with x on the left every warp loads the padded x tile into registers.
    w_left: bool = False


class SkinnyWorkspace:
    """fp32 split-K partials and int32 arrival counters (zero between launches)."""

    def __init__(self, device: torch.device, partial_capacity: int = PARTIAL_CAPACITY,
                 counter_capacity: int = COUNTER_CAPACITY):
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny GEMM workspace: create it (run one skinny GEMM) before "
                               "capturing a CUDA graph")
        self.partials = torch.empty(partial_capacity, dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(counter_capacity, dtype=torch.int32, device=device)


_WORKSPACES: dict[torch.device, SkinnyWorkspace] = {}


def workspace_for(device: torch.device) -> SkinnyWorkspace:
    """The device's shared workspace, made on first use."""
    if device not in _WORKSPACES:
        _WORKSPACES[device] = SkinnyWorkspace(device)
    return _WORKSPACES[device]


# The default for `SkinnyConfig.fp8_wide` in the rule's configs. On an H100
# (`bench/fp8_gemm.py --variants w8a16 --rows 1,4,16`, 8B shapes at M = 1) the wide steps
# lead: qkv 14.4 against 16.7 us, gate_up 48.9 against 51.8, down 33.1 against 33.8, o even
# (13.0); M = 4 and 16 alike.
FP8_WIDE_STEPS = True

# The rule's FP8 configs (W8A16) take `fp8_f16_config` (fp16 products, the weight on the left)
# when True: flip where bench/fp8_gemm.py's w8a16_f16 rows lead w8a16_skinny on the device.
FP8_F16_PRODUCTS = False

# Measured best configs, (m, n, k, paired) -> config, as `bench/skinny_gemm.py --sweep`
# prints them; shapes not listed take the rule of `default_config`.
TUNED_CONFIGS: dict[tuple[int, int, int, bool], SkinnyConfig] = {
    # One rank's o_proj of the 8B shape at tp=4 and tp=2 (H100 sweep, 2026-11-27: 5.3 and
    # 7.9 us against the rule's 6.2 and 9.2; the other tp shards are within 2 % of the rule).
    (1, 4096, 1024, False): SkinnyConfig(block_n=64, block_k=256, split_k=1, num_warps=2, num_stages=4),
    (1, 4096, 2048, False): SkinnyConfig(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=6),
}

# The same for FP8 weights (W8A16; the config before `fp8_weight_config`), as
# `bench/fp8_gemm.py --sweep --variants w8a16` prints them; shapes not listed: as 16-bit ones.
FP8_TUNED_CONFIGS: dict[tuple[int, int, int, bool], SkinnyConfig] = {}

# (N, K) of a weight -> the largest M the skinny kernel runs it for (cuBLAS above), from
# `bench/skinny_gemm.py`; weights not listed: MAX_ROWS.
SKINNY_MAX_ROWS: dict[tuple[int, int], int] = {}


@functools.lru_cache(maxsize=None)  # one entry per (shape, M, device): no host work per call
def default_config(m: int, n: int, k: int, paired: bool = False,
                   device: torch.device = torch.device("cuda"), fp8: bool = False) -> SkinnyConfig:
    """Launch parameters for y[m, n] = x[m, k] W^T: n output columns, each reading one weight
    row, or two when `paired` (SiLU-and-mul's gate and up, RoPE's two halves of a head).
    With `fp8` (an FP8 weight) `FP8_TUNED_CONFIGS` first.

    `TUNED_CONFIGS` where measured, else the rule the H100 sweep of the Llama 8B shapes
    (`bench/skinny_gemm.py --sweep`, docs/benchmarks.md) points to for every M up to 16:
    32-column tiles on tl.dot, K split in two until there is about a program an SM (each
    still streaming at least 512 of K), 256-wide K steps in three stages when K is not split,
    128-wide in four when it is. Wider tiles or more splits than that measured slower: at
    M <= 16 every program is a stream of weight rows, and the fewer programs share an SM, the
    fewer of their loads wait behind one another.
    """
    if fp8 and (m, n, k, paired) in FP8_TUNED_CONFIGS:
        return FP8_TUNED_CONFIGS[m, n, k, paired]
    if fp8 and FP8_F16_PRODUCTS:
        return fp8_f16_config(m, n, k, paired, device)
    if (m, n, k, paired) in TUNED_CONFIGS:
        return TUNED_CONFIGS[m, n, k, paired]
    return rule_config(m, n, k, paired, device, block_n=32)


def rule_config(m: int, n: int, k: int, paired: bool, device: torch.device,
                block_n: int) -> SkinnyConfig:
    """`default_config`'s rule for column tiles of `block_n` (a caller whose epilogue needs
    wider tiles than 32 splits K by the same rule over its fewer tiles)."""
    tiles = triton.cdiv(n, block_n)
    split_k = 1
    while (tiles * split_k < num_sms(device) and k // (2 * split_k) >= 512
           and _scratch_values(split_k * 2, m, n, paired) <= PARTIAL_CAPACITY):
        split_k *= 2
    if split_k == 1:
        return SkinnyConfig(block_n=block_n, block_k=256, split_k=1, num_warps=4, num_stages=3,
                            fp8_wide=FP8_WIDE_STEPS)
    return SkinnyConfig(block_n=block_n, block_k=128, split_k=split_k, num_warps=4, num_stages=4,
                        fp8_wide=FP8_WIDE_STEPS)


def fp8_f16_config(m: int, n: int, k: int, paired: bool, device: torch.device,
                   block_n: int = 0) -> SkinnyConfig:
    """The rule for FP8 weights on fp16 products (`SkinnyConfig.fp8_f16`): the weight tile on
    the left of tl.dot over 128 weight rows a program (64 columns of each half of a pair, or
    `block_n`), so that Hopper's wgmma takes the tile from registers and x from shared memory;
    128-wide K steps (a 128-column k-block's) in four stages, K split by `rule_config`'s rule
    over these tiles. Chosen by the compiled loop's instructions per weight (sm_90, Llama 8B
    o_proj at M = 1: 0.10 warp instructions a weight against 0.22 for the dequantising
    kernel), not yet timed: bench/fp8_gemm.py's w8a16_f16 rows."""
    block_n = block_n or (64 if paired else 128)
    split_k = rule_config(m, n, k, paired, device, block_n).split_k
    return SkinnyConfig(block_n=block_n, block_k=128, split_k=split_k, num_warps=4, num_stages=4,
                        fp8_f16=True, w_left=True)


def prefers_skinny(m: int, n: int, k: int) -> bool:
    """The per-shape choice between this kernel and cuBLAS (F.linear) for a weight [n, k] and
    1 <= m rows: every decode-sized M unless `SKINNY_MAX_ROWS` says otherwise."""
    return m <= SKINNY_MAX_ROWS.get((n, k), MAX_ROWS)


def _scratch_values(split_k: int, m: int, n: int, paired: bool) -> int:
    return split_k * m * n * (2 if paired else 1)


@functools.lru_cache(maxsize=None)
def fp8_weight_config(config: SkinnyConfig, scale_block_k: int, k: int) -> SkinnyConfig:
    """`config` for an FP8 weight whose scale grid's k-blocks are `scale_block_k` wide: K steps
    cut to the widest power of two (16 at least) that divides a k-block, so that each step
    reads one scale per row (`k_uniform`) instead of gathering one per element; with
    `fp8_activations` also to at most one activation group, and column tiles of 64 at least.
    Where steps are cut, stages are added (up to 8) to keep the config's K elements in
    flight per row: a decode GEMM is a stream of weight rows, and the rule measured for 16-bit
    weights wanted 768 in flight (half the bytes in FP8). Not yet measured for FP8:
    `bench/fp8_gemm.py --sweep`.

    With `fp8_wide` (W8A16): K steps of twice the config's (the 16-bit step's bytes a row, at
    the 16-bit stages), where they lie in one k-block or span whole power-of-two k-blocks
    (`scale_columns`): a row's step is then one wide load and a few scales, not one narrow
    step a block."""
    if config.fp8_wide and not config.fp8_activations and not config.fp8_f16:
        wide = 2 * config.block_k
        if scale_columns(scale_block_k, k, wide):
            return config._replace(block_k=wide)
    block_k, block_n = config.block_k, config.block_n
    if config.fp8_activations:  # FP8 tensor cores take 64 weight rows (see `_sum_tiles`)
        block_k, block_n = min(block_k, ACT_GROUP), max(block_n, 64)
    if not (scale_block_k >= k or scale_block_k % block_k == 0):
        step = scale_block_k & -scale_block_k  # the largest power of two dividing it
        block_k = step if step >= 16 else block_k
    stages = min(8, max(config.num_stages, config.num_stages * config.block_k // block_k))
    # fp16 products scale a step's sum by one scale per row: per-element scales cannot; FP8
    # activations are products of their own
    fp8_f16 = config.fp8_f16 and not config.fp8_activations and k_uniform(scale_block_k, k, block_k)
    return config._replace(block_k=block_k, block_n=block_n, num_stages=stages, fp8_f16=fp8_f16)


def scale_columns(scale_block_k: int, k: int, block_k: int) -> int:
    """The scale-grid columns a K step of `block_k` reads per weight row: 1 where the step lies
    in one k-block (`k_uniform`), block_k / scale_block_k where it spans whole k-blocks (a
    power of two at least 16 wide, so a block is a reshape of the tile), else 0 (a scale per
    element)."""
    if k_uniform(scale_block_k, k, block_k):
        return 1
    bk = scale_block_k
    if bk >= 16 and bk & (bk - 1) == 0 and block_k % bk == 0:
        return block_k // bk
    return 0


def can_use(x: torch.Tensor, weight: torch.Tensor, scale: Optional[WeightScale] = None) -> bool:
    """Whether `skinny_gemm(x, weight, scale=scale)` runs here and the per-shape rule picks it
    (with `scale`, weight is FP8: CUDA with FP8 conversions)."""
    if triton is None or not x.is_cuda or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if weight.dtype != (x.dtype if scale is None else FP8_DTYPE):
        return False
    if scale is not None and not fp8_supported(x.device):
        return False
    n, k = weight.shape
    m = x.numel() // k if k else 0
    return 1 <= m and prefers_skinny(m, n, k)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           skinny: bool = True, scale: Optional[WeightScale] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), by the skinny GEMM where `can_use` picks it and `skinny`
    allows it (the layers' A/B switch). With `scale`, `weight` is FP8 (layers/fp8_weight.py):
    the skinny GEMM reads it as it is, else `fp8_matmul`."""
    if skinny and can_use(x, weight, scale):
        return skinny_gemm(x, weight, bias, scale=scale)
    if scale is not None:
        return fp8_matmul(x, weight, scale, bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                        skinny: bool = True, scale: Optional[WeightScale] = None) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight, bias)) for a fused [2I, K] gate/up weight: one kernel
    where the skinny GEMM runs, else the GEMM and then the activation kernel."""
    if skinny and can_use(x, weight, scale):
        return skinny_gemm(x, weight, bias, silu_mul=True, scale=scale)
    return silu_and_mul(linear(x, weight, bias, False, scale))


if triton is not None:
    from specserve.engine.layers.fp8_gemm import (
        activation_scales, dequantize_tile, round_weight, scaled_dot, weight_scales)
    from specserve.engine.layers.fp8_convert import e4m3_to_f32

    @triton.jit
    def _accumulate(acc, x_tile, w_tile, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    W_LEFT: tl.constexpr):
        if DOT and W_LEFT:  # acc [BLOCK_N, BLOCK_M]
            acc = tl.dot(w_tile, tl.trans(x_tile), acc, input_precision=DOT_PRECISION)
        elif DOT:  # acc [BLOCK_M, BLOCK_N]
            acc = tl.dot(x_tile, tl.trans(w_tile), acc, input_precision=DOT_PRECISION)
        else:
            # acc [BLOCK_M, BLOCK_N, BLOCK_K]: products summed per lane, reduced over K once
            # after the loop (no cross-thread reduction per step).
            acc += x_tile.to(tl.float32)[:, None, :] * w_tile.to(tl.float32)[None, :, :]
        return acc

    @triton.jit
    def _accumulate_step(acc, x_tile, x_inv, w_tile, fp8, scale_rows, offs_m, m_mask, k, offs_k,
                         K, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         FP8_WEIGHT: tl.constexpr, SCALE_COLS: tl.constexpr,
                         FP8_ACT: tl.constexpr, FP8_CONVERT: tl.constexpr, FP8_F16: tl.constexpr,
                         W_LEFT: tl.constexpr):
        """One K step (from k) of the weight rows whose scale-grid rows are at `scale_rows`
        (FP8_F16: x_tile in fp16 as `_rows_to_f16` made it, x_inv its rows' inverse powers)."""
        if FP8_ACT:  # acc [BLOCK_N, BLOCK_M]: W x^T (see _sum_tiles)
            acc = scaled_dot(acc, w_tile, x_tile,
                             weight_scales(fp8.w_scale, scale_rows, k, offs_k, K, fp8.block_k, True),
                             activation_scales(fp8.x_scale, offs_m, m_mask, fp8.stride_xsm, k))
        elif FP8_F16:
            w_scales = weight_scales(fp8.w_scale, scale_rows, k, offs_k, K, fp8.block_k, True)
            if W_LEFT:  # acc [BLOCK_N, BLOCK_M]
                acc = scaled_dot(acc, w_tile.to(tl.float16), x_tile, w_scales, x_inv)
            else:
                acc = scaled_dot(acc, x_tile, w_tile.to(tl.float16), x_inv, w_scales)
        else:
            if FP8_WEIGHT:
                if SCALE_COLS > 1:
                    w_tile = _dequantize_grouped(w_tile, fp8.w_scale, scale_rows, k, K, fp8.block_k,
                                                 SCALE_COLS, x_tile.dtype, FP8_CONVERT, DOT)
                else:
                    w_tile = dequantize_tile(
                        w_tile, weight_scales(fp8.w_scale, scale_rows[:, None], k, offs_k[None, :], K,
                                              fp8.block_k, SCALE_COLS == 1), x_tile.dtype,
                        FP8_CONVERT, DOT)
            acc = _accumulate(acc, x_tile, w_tile, DOT, DOT_PRECISION, W_LEFT)
        return acc

    @triton.jit
    def _rows_to_f16(x_tile):
        """x_tile [BLOCK_M, BLOCK_K] (16-bit) in fp16, each row times the power of two
        that puts its largest magnitude in [2^14, 2^15), and the inverse powers [BLOCK_M]: a
        bf16 value (8 significant bits) is exact in fp16 (11) down to 2^-32 of its row's
        largest (fp16's subnormals round the smaller ones, which weigh less than 2^-32 in the
        row's products). The powers are made from the exponent field of the row's maximum:
        2^(14 - E) for a maximum in [2^E, 2^(E+1)), clamped to fp32's normal range (an
        all-zero row takes the largest power: zeros either way)."""
        x = x_tile.to(tl.float32)
        exponent = (tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
        up = tl.minimum(tl.maximum(268 - exponent, 1), 253)  # the biased exponent of 2^(14 - E)
        x16 = (x * (up << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        return x16, ((254 - up) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _dequantize_grouped(w_tile, w_scale, scale_rows, k, K, scale_block_k,
                            GROUPS: tl.constexpr, dtype: tl.constexpr,
                            FP8_CONVERT: tl.constexpr, DOT: tl.constexpr):
        """W8A16 for a K step spanning GROUPS whole k-blocks of the grid (`fp8_weight_config`'s
        wide steps): the rows' GROUPS scales loaded once ([BLOCK_N, GROUPS]) and broadcast over
        their blocks in registers; the same fp32 products and rounding as `dequantize_tile`.
        Blocks past K read the grid's last column (their weights are zeros)."""
        block_n: tl.constexpr = w_tile.shape[0]
        block_k: tl.constexpr = w_tile.shape[1]
        cols = tl.minimum(k // scale_block_k + tl.arange(0, GROUPS), tl.cdiv(K, scale_block_k) - 1)
        scales = tl.load(w_scale + scale_rows[:, None] + cols[None, :])
        w = tl.reshape(e4m3_to_f32(w_tile, FP8_CONVERT), (block_n, GROUPS, block_k // GROUPS))
        return round_weight(tl.reshape(w * scales[:, :, None], (block_n, block_k)), dtype,
                            FP8_CONVERT, DOT)

    @triton.jit
    def _pair_rows(cols, n_cols, half):
        """Weight rows of output columns `cols` and of their partners: with pairs (SiLU-and-mul
        with half = I: gate row c, up row I + c; RoPE with half = head_dim / 2: the two halves
        of a head), column c is row (c // half) * 2 half + c % half and its partner half rows
        further. Columns past the end read row 0: never stored, and the loads stay unmasked."""
        cols = tl.where(cols < n_cols, cols, 0)
        first = (cols // half) * (2 * half) + cols % half
        return first.to(tl.int64), (first + half).to(tl.int64)

    @triton.jit
    def _sum_tiles(x, w, M, K, k_begin, k_end, offs_m, rows, partner_rows, stride_xm, stride_wn,
                   fp8, PAIRED: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                   EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_WEIGHT: tl.constexpr,
                   SCALE_COLS: tl.constexpr, FP8_ACT: tl.constexpr, FP8_CONVERT: tl.constexpr,
                   FP8_F16: tl.constexpr, W_LEFT: tl.constexpr):
        """x[:, k_begin:k_end] against the weight rows `rows` (and `partner_rows` when PAIRED):
        the fp32 tiles [BLOCK_M, BLOCK_N] (the partner's zero unless PAIRED).

        FP8_WEIGHT: w is float8_e4m3fn with the scale grid `fp8` describes. W8A16 (x 16/32-bit):
        each weight tile is dequantised into x's dtype before the product (`dequantize_tile`;
        SCALE_COLS (`scale_columns`): 1, one scale per row a step; G > 1, a step spans G whole
        k-blocks, G scales per row (`_dequantize_grouped`); 0, one per element; FP8_CONVERT,
        how the e4m3 values become fp32, `SkinnyConfig.fp8_convert`). FP8_ACT (W8A8,
        DOT and SCALE_COLS 1 only, BLOCK_K dividing ACT_GROUP): x is FP8 too, with per-row group scales,
        and each step's FP8 product is scaled in fp32 (`scaled_dot`). The product is taken
        transposed, W x^T ([BLOCK_N, BLOCK_M], transposed once after the loop): FP8 tensor
        cores (wgmma) want 64 rows or more on the left, and x has 16 at most, the weight
        tile BLOCK_N (64 in `fp8_weight_config`). With x on the left Triton would convert
        both operands to fp16 for 16-row mma instead. FP8_F16 (W8A16 on fp16 tensor cores, DOT
        and SCALE_COLS 1 only): x converted once a step for both tiles of a pair
        (`_rows_to_f16`), the weight tile widened to fp16, the step's product scaled in fp32.
        W_LEFT (DOT): W x^T as well, for wgmma's register operand."""
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        x_ptrs = x + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w + rows[:, None] * stride_wn + offs_k[None, :]
        partner_ptrs = w + partner_rows[:, None] * stride_wn + offs_k[None, :]
        # Offsets of the rows' scale-grid rows (unused for a 16-bit weight).
        scale_rows = (rows // fp8.block_n) * fp8.stride_wsn
        partner_scale_rows = (partner_rows // fp8.block_n) * fp8.stride_wsn
        if FP8_ACT or (DOT and W_LEFT):
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        elif DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        for k in range(k_begin, k_end, BLOCK_K):
            if EVEN_K:
                x_tile = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
                w_tile = tl.load(w_ptrs + k)
            else:
                k_mask = (k + offs_k) < K
                x_tile = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                w_tile = tl.load(w_ptrs + k, mask=k_mask[None, :], other=0.0)
            x_inv = offs_m  # a placeholder: only FP8_F16 reads it
            if FP8_F16:
                x_tile, x_inv = _rows_to_f16(x_tile)
            acc = _accumulate_step(acc, x_tile, x_inv, w_tile, fp8, scale_rows, offs_m, m_mask, k,
                                   offs_k, K, DOT, DOT_PRECISION, FP8_WEIGHT, SCALE_COLS, FP8_ACT,
                                   FP8_CONVERT, FP8_F16, W_LEFT)
            if PAIRED:
                if EVEN_K:
                    up_tile = tl.load(partner_ptrs + k)
                else:
                    up_tile = tl.load(partner_ptrs + k, mask=k_mask[None, :], other=0.0)
                acc_up = _accumulate_step(acc_up, x_tile, x_inv, up_tile, fp8, partner_scale_rows,
                                          offs_m, m_mask, k, offs_k, K, DOT, DOT_PRECISION,
                                          FP8_WEIGHT, SCALE_COLS, FP8_ACT, FP8_CONVERT, FP8_F16,
                                          W_LEFT)
        if FP8_ACT or (DOT and W_LEFT):
            acc = tl.trans(acc)
            acc_up = tl.trans(acc_up)
        elif not DOT:
            acc = tl.sum(acc, axis=2)
            acc_up = tl.sum(acc_up, axis=2)
        return acc, acc_up

    @triton.jit
    def _merge_splits(acc, acc_up, partials, arrivals, tile, split, M, n_cols, offs_m, offs_n,
                      out_mask, PAIRED: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Split-K: every program stores its partial tiles and counts its arrival on its N
        tile's counter; the last to arrive sums all partials in split order (deterministic),
        zeroes the counter and returns (True, the sums). The others return False."""
        # partials[s, m, c]: c < n_cols the (first) sums, n_cols + c the partners'.
        width = n_cols * (2 if PAIRED else 1)
        p_ptrs = partials + offs_m[:, None] * width + offs_n[None, :]
        split_stride = M * width
        tl.store(p_ptrs + split * split_stride, acc, mask=out_mask)
        if PAIRED:
            tl.store(p_ptrs + split * split_stride + n_cols, acc_up, mask=out_mask)
        # Every thread's partial stores come before the arrival (a CTA barrier, then the
        # atomic's release); the last program reads the others' after its acquire, from L2.
        tl.debug_barrier()
        counter = arrivals + tile
        last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT_K):  # a fixed order: deterministic sums
                acc += tl.load(p_ptrs + s * split_stride, mask=out_mask, other=0.0,
                               cache_modifier=".cg")
                if PAIRED:
                    acc_up += tl.load(p_ptrs + s * split_stride + n_cols, mask=out_mask,
                                      other=0.0, cache_modifier=".cg")
            tl.store(counter, 0)  # ready for the next launch (and the next graph replay)
        return last, acc, acc_up

    @triton.jit
    def _add_bias(acc, acc_up, bias, rows, partner_rows, PAIRED: tl.constexpr):
        # In fp32, before the rounding to the activation dtype, as cuBLAS's epilogue does.
        acc += tl.load(bias + rows).to(tl.float32)[None, :]
        if PAIRED:
            acc_up += tl.load(bias + partner_rows).to(tl.float32)[None, :]
        return acc, acc_up

    @triton.jit
    def _epilogue(acc, acc_up, y, offs_m, offs_n, mask, stride_ym, SILU_MUL: tl.constexpr):
        dtype = y.dtype.element_ty
        if SILU_MUL:
            # The unfused path: the GEMM rounds gate and up to the activation dtype, then
            # silu_and_mul rounds silu(gate) and the product.
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            acc = act * up
        ptrs = y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(ptrs, acc.to(dtype), mask=mask)

    @triton.jit
    def _skinny_gemm_kernel(
        x, w, bias, y, partials, arrivals, M, n_cols, K, k_per_split,
        stride_xm, stride_wn, stride_ym, fp8,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
        DOT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        FP8_WEIGHT: tl.constexpr, SCALE_COLS: tl.constexpr, FP8_ACT: tl.constexpr,
        FP8_CONVERT: tl.constexpr, FP8_F16: tl.constexpr, W_LEFT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # n_cols: output columns (I with SILU_MUL, whose weight has 2 * I rows).
        wait_for_predecessor(PDL)
        tile = tl.program_id(0)
        split = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if SILU_MUL:
            rows, partner_rows = _pair_rows(offs_n, n_cols, n_cols)
        else:
            rows = tl.where(offs_n < n_cols, offs_n, 0).to(tl.int64)
            partner_rows = rows
        k_begin = split * k_per_split
        acc, acc_up = _sum_tiles(x, w, M, K, k_begin, tl.minimum(k_begin + k_per_split, K),
                                 offs_m, rows, partner_rows, stride_xm, stride_wn, fp8, SILU_MUL,
                                 BLOCK_M, BLOCK_N, BLOCK_K, DOT, EVEN_K, DOT_PRECISION,
                                 FP8_WEIGHT, SCALE_COLS, FP8_ACT, FP8_CONVERT, FP8_F16, W_LEFT)
        release_dependents(PDL)
        out_mask = (offs_m < M)[:, None] & (offs_n < n_cols)[None, :]
        last = True
        if SPLIT_K > 1:
            last, acc, acc_up = _merge_splits(acc, acc_up, partials, arrivals, tile, split, M,
                                              n_cols, offs_m, offs_n, out_mask, SILU_MUL,
                                              SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            if HAS_BIAS:
                acc, acc_up = _add_bias(acc, acc_up, bias, rows, partner_rows, SILU_MUL)
            _epilogue(acc, acc_up, y, offs_m, offs_n, out_mask, stride_ym, SILU_MUL)

    @triton.jit
    def _head_rmsnorm(x1, x2, norm_w, d, eps, dtype: tl.constexpr, HALF: tl.constexpr):
        """RMSNorm (engine/layers/norm.py's roundings) of the heads whose halves are x1 and x2
        [BLOCK_M, HALF] (fp32 holding activation-dtype values), weight `norm_w` [2 HALF]."""
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        inv = tl.math.rsqrt(var + eps)[:, None]
        w1 = tl.load(norm_w + d).to(tl.float32)
        w2 = tl.load(norm_w + HALF + d).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        return x1, x2

    @triton.jit
    def _skinny_qkv_rope_kernel(
        x, w, bias, q_out, k_cache, v_cache, loc, positions, cos, sin, q_norm_w, k_norm_w,
        partials, arrivals, M, K, k_per_split, stride_xm, stride_wn, fp8, k_scale_inv,
        v_scale_inv, norm_eps,
        NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
        KV_FP8: tl.constexpr, QK_NORM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr, FP8_WEIGHT: tl.constexpr, SCALE_COLS: tl.constexpr,
        FP8_ACT: tl.constexpr, FP8_CONVERT: tl.constexpr, FP8_F16: tl.constexpr,
        W_LEFT: tl.constexpr, PDL: tl.constexpr,
        PREFETCH_LINES: tl.constexpr = 0, LINE_ELEMENTS: tl.constexpr = 64,
    ):
        # The fused q/k/v projection [(Hq + 2 Hk) * 2 HALF, K], then `_rope_kernel`'s work in
        # the epilogue: a program's BLOCK_N columns are the same dims of both halves of one
        # head (HALF % BLOCK_N == 0); q heads are rotated into q_out [M, Hq, 2 HALF], k heads
        # rotated into k_cache[loc[m]], v heads copied into v_cache[loc[m]] (quantised with
        # KV_FP8, as `rope_and_store_kv` stores them). QK_NORM (Qwen3): a tile is half a head
        # (BLOCK_N == HALF), so a program holds whole heads and RMS-normalises each q and k
        # head with `q_norm_w` / `k_norm_w` before RoPE.
        tile = tl.program_id(0)
        split = tl.program_id(1)
        n_cols = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HALF
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        out_mask = m_mask[:, None] & (offs_n < n_cols)[None, :]
        head = (tile * BLOCK_N) // HALF
        d = (offs_n % HALF)[None, :]
        rows, partner_rows = _pair_rows(offs_n, n_cols, HALF)
        k_begin = split * k_per_split
        # Before the wait (engine/pdl.py's early reads), while the RMSNorm before this kernel
        # runs: the L2 gets the first PREFETCH_LINES lines of the program's weight rows (no
        # kernel writes weights), so the main loop starts on L2 hits instead of DRAM reads.
        wait_unless_early_reads(PDL)
        if PREFETCH_LINES > 0:
            if EARLY_READS:
                cols = k_begin + tl.arange(0, PREFETCH_LINES)[None, :] * LINE_ELEMENTS
                cols = tl.where(cols < tl.minimum(k_begin + k_per_split, K), cols, 0)
                prefetch_l2(w + rows[:, None] * stride_wn + cols)
                prefetch_l2(w + partner_rows[:, None] * stride_wn + cols)
        wait_after_early_reads(PDL)
        # The epilogue's inputs, read before the main loop, which hides their latency: read
        # after it they were a chain of two dependent DRAM reads (the positions, then the
        # tables) in the tail of the one program per tile that merges the split-K partials.
        pos = tl.load(positions + offs_m, mask=m_mask, other=0).to(tl.int64)[:, None]
        slot = tl.load(loc + offs_m, mask=m_mask, other=0).to(tl.int64)[:, None]
        # torch casts the fp32 cos/sin table to the activation dtype, then rounds each product
        # and the sum (`_rope_kernel` in engine/layers/fused.py).
        dtype = q_out.dtype.element_ty
        table = pos * (2 * HALF) + d
        cos1 = tl.load(cos + table, mask=out_mask, other=0.0).to(dtype)
        cos2 = tl.load(cos + table + HALF, mask=out_mask, other=0.0).to(dtype)
        sin1 = tl.load(sin + table, mask=out_mask, other=0.0).to(dtype)
        sin2 = tl.load(sin + table + HALF, mask=out_mask, other=0.0).to(dtype)
        acc, acc_up = _sum_tiles(x, w, M, K, k_begin, tl.minimum(k_begin + k_per_split, K),
                                 offs_m, rows, partner_rows, stride_xm, stride_wn, fp8, True,
                                 BLOCK_M, BLOCK_N, BLOCK_K, DOT, EVEN_K, DOT_PRECISION,
                                 FP8_WEIGHT, SCALE_COLS, FP8_ACT, FP8_CONVERT, FP8_F16, W_LEFT)
        # No early release here (engine/pdl.py): the decode attention after this kernel, let in
        # during the split-K merge, cost a long-context step what its splits' bandwidth gains
        # (H200, 8B FP8 at 32k: 5.95 ms a step with the FP8 pool, 5.28 without the release).
        last = True
        if SPLIT_K > 1:
            last, acc, acc_up = _merge_splits(acc, acc_up, partials, arrivals, tile, split, M,
                                              n_cols, offs_m, offs_n, out_mask, True, SPLIT_K,
                                              BLOCK_M, BLOCK_N)
        if last:
            if HAS_BIAS:
                acc, acc_up = _add_bias(acc, acc_up, bias, rows, partner_rows, True)
            # The unfused path rounds the projection to the activation dtype first.
            x1 = acc.to(dtype).to(tl.float32)
            x2 = acc_up.to(dtype).to(tl.float32)
            m64 = offs_m.to(tl.int64)[:, None]
            if head < NUM_Q_HEADS + NUM_KV_HEADS:
                if QK_NORM:
                    if head < NUM_Q_HEADS:
                        norm_w = q_norm_w
                    else:
                        norm_w = k_norm_w
                    x1, x2 = _head_rmsnorm(x1, x2, norm_w, d, norm_eps, dtype, HALF)
                o1 = ((x1 * cos1.to(tl.float32)).to(dtype).to(tl.float32)
                      + (-x2 * sin1.to(tl.float32)).to(dtype).to(tl.float32))
                o2 = ((x2 * cos2.to(tl.float32)).to(dtype).to(tl.float32)
                      + (x1 * sin2.to(tl.float32)).to(dtype).to(tl.float32))
                # Each branch stores through its own pointer: an FP8 cache's pointer type
                # differs from q_out's, and a variable both branches assign must not.
                if head < NUM_Q_HEADS:
                    q_dst = q_out + m64 * (NUM_Q_HEADS * 2 * HALF) + head * (2 * HALF) + d
                    tl.store(q_dst, o1.to(dtype), mask=out_mask)
                    tl.store(q_dst + HALF, o2.to(dtype), mask=out_mask)
                else:
                    k_dst = (k_cache + slot * (NUM_KV_HEADS * 2 * HALF)
                             + (head - NUM_Q_HEADS) * (2 * HALF) + d)
                    store_kv(k_dst, o1.to(dtype), out_mask, k_scale_inv, KV_FP8)
                    store_kv(k_dst + HALF, o2.to(dtype), out_mask, k_scale_inv, KV_FP8)
            else:
                v_dst = (v_cache + slot * (NUM_KV_HEADS * 2 * HALF)
                         + (head - NUM_Q_HEADS - NUM_KV_HEADS) * (2 * HALF) + d)
                store_kv(v_dst, x1.to(dtype), out_mask, v_scale_inv, KV_FP8)
                store_kv(v_dst + HALF, x2.to(dtype), out_mask, v_scale_inv, KV_FP8)


class _Fp8Args(NamedTuple):
    """The kernels' `fp8` argument: an FP8 weight's scale grid and, with FP8 activations, x's
    group scales (any tensor and 1s for what a launch does not use: never read)."""

    x_scale: torch.Tensor  # fp32 [M, ceil(K / ACT_GROUP)]
    w_scale: torch.Tensor  # fp32 [ceil(N / block_n), ceil(K / block_k)]
    stride_xsm: int
    stride_wsn: int
    block_n: int
    block_k: int


class _Launch(NamedTuple):
    """What both kernels' launches share: the grid, K per split, the split-K scratch (any
    tensor without split-K: the kernel never touches it), x as the kernel reads it (quantised
    with FP8 activations), the FP8 arguments and the common meta-parameters."""

    grid: tuple[int, int]
    k_per_split: int
    partials: torch.Tensor
    arrivals: torch.Tensor
    x: torch.Tensor
    fp8: _Fp8Args
    meta: dict


def _rows_of(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    """x [..., K] as [M, K] with a contiguous last dimension; M checked against MAX_ROWS."""
    x2 = x.reshape(-1, k)
    assert 1 <= x2.shape[0] <= MAX_ROWS, f"{what}: {x2.shape[0]} rows (1..{MAX_ROWS})"
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_operands(x: torch.Tensor, weight: torch.Tensor, scale: Optional[WeightScale]) -> None:
    assert weight.is_contiguous() and x.shape[-1] == weight.shape[1]
    if scale is None:
        assert x.dtype == weight.dtype, "a 16-bit weight is in x's dtype"
    else:
        check_weight(weight, scale)


def _config_for(config: SkinnyConfig, scale: Optional[WeightScale], k: int) -> SkinnyConfig:
    return config if scale is None else fp8_weight_config(config, scale.block_k, k)


def _fp8_convert(config: SkinnyConfig, device: torch.device) -> str:
    """`config.fp8_convert`, or `WEIGHT_FP8_CONVERT` where None; "bits" only where the device
    has it."""
    convert = check_fp8_convert(WEIGHT_FP8_CONVERT if config.fp8_convert is None else config.fp8_convert)
    if convert == "bits" and not has_sm90_conversions(device):
        raise ValueError(f"fp8_convert: 'bits' needs compiled kernels on sm_90 or newer, not {device}")
    return convert


def _plan(x2: torch.Tensor, n_cols: int, paired: bool, has_bias: bool, config: SkinnyConfig,
          workspace: Optional[SkinnyWorkspace], scale: Optional[WeightScale],
          unused: torch.Tensor) -> _Launch:
    m, k = x2.shape
    x_in, fp8 = x2, _Fp8Args(unused, unused, 1, 1, 1, 1)
    if scale is not None:
        assert config.dot or not config.fp8_activations, "FP8 activations need tl.dot"
        assert config.dot or not config.fp8_f16, "fp16 products need tl.dot"
        assert not config.fp8_f16 or k_uniform(scale.block_k, k, config.block_k), \
            "with fp8_f16 a K step lies in one k-block"
        x_scale, stride_xsm = unused, 1
        if config.fp8_activations:
            assert ACT_GROUP % config.block_k == 0 and k_uniform(scale.block_k, k, config.block_k), \
                "with FP8 activations a K step lies in one activation group and one k-block"
            x_in, x_scale = quantize_activations(x2)
            stride_xsm = x_scale.stride(0)
        fp8 = _Fp8Args(x_scale, scale.values, stride_xsm, scale.values.stride(0), scale.block_n,
                       scale.block_k)
    tiles = triton.cdiv(n_cols, config.block_n)
    partials = arrivals = unused
    if config.split_k > 1:
        workspace = workspace or workspace_for(x2.device)
        assert _scratch_values(config.split_k, m, n_cols, paired) <= workspace.partials.numel()
        assert tiles <= workspace.arrivals.numel()
        partials, arrivals = workspace.partials, workspace.arrivals
    meta = dict(
        BLOCK_M=max(16, triton.next_power_of_2(m)) if config.dot else triton.next_power_of_2(m),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        HAS_BIAS=has_bias, DOT=config.dot, EVEN_K=k % config.block_k == 0,
        # fp32 operands would silently run as TF32 on tensor cores; keep them exact.
        DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        FP8_WEIGHT=scale is not None,
        SCALE_COLS=0 if scale is None else scale_columns(scale.block_k, k, config.block_k),
        FP8_ACT=scale is not None and config.fp8_activations,
        FP8_CONVERT="cast" if scale is None else _fp8_convert(config, x2.device),
        # fp16 holds 16-bit activations exactly (`_rows_to_f16`), not fp32 ones
        FP8_F16=scale is not None and config.fp8_f16 and x2.dtype != torch.float32,
        W_LEFT=config.w_left,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x2.device))
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    return _Launch((tiles, config.split_k), k_per_split, partials, arrivals, x_in, fp8, meta)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                silu_mul: bool = False, config: Optional[SkinnyConfig] = None,
                workspace: Optional[SkinnyWorkspace] = None,
                scale: Optional[WeightScale] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] with at most `MAX_ROWS` rows, or with
    `silu_mul` `silu_and_mul(F.linear(x, weight, bias))` (weight [2I, K]: gate rows, then up
    rows; the result [..., I]). `weight` contiguous, x's last dimension contiguous, one dtype;
    or with `scale` an FP8 weight (`config` then passes through `fp8_weight_config`)."""
    n_rows, k = weight.shape
    _check_operands(x, weight, scale)
    x2 = _rows_of(x, k, "skinny_gemm")
    m = x2.shape[0]
    if silu_mul:
        assert n_rows % 2 == 0, "silu_mul needs the fused [2I, K] gate/up weight"
    n_cols = n_rows // 2 if silu_mul else n_rows
    if bias is not None:
        assert bias.shape == (n_rows,) and bias.is_contiguous()
    config = _config_for(config or default_config(m, n_cols, k, silu_mul, x.device, scale is not None),
                         scale, k)
    y = torch.empty((m, n_cols), dtype=x.dtype, device=x.device)
    launch = _plan(x2, n_cols, silu_mul, bias is not None, config, workspace, scale, unused=y)
    _skinny_gemm_kernel[launch.grid](
        launch.x, weight, bias if bias is not None else weight, y, launch.partials,
        launch.arrivals, m, n_cols, k, launch.k_per_split, launch.x.stride(0), weight.stride(0),
        y.stride(0), launch.fp8, SILU_MUL=silu_mul, **launch.meta)
    return y.view(*x.shape[:-1], n_cols)


SHARED_MEMORY = 227 * 1024  # bytes a program may take on an H100 or H200
L2_LINE_BYTES = 128          # what one `prefetch_l2` address brings in
# Bytes at the start of each weight row a q/k/v program prefetches into the L2 before its wait
# (`skinny_qkv_rope`), while the RMSNorm before it runs. Off until timed: 1024 (8 lines, what
# the main loop's first stages ask for) is 12 MiB for the 8B shape's 192 programs of 64 rows,
# and an earlier pre-wait prefetch of the skinny GEMMs' weight slices made the 8B bs=1 step
# slower (docs/benchmarks.md: the prefetch competed with the predecessor's loads; here the
# predecessor is the RMSNorm, a few KiB). `bench/skinny_gemm.py --qkv-rope` times the kernel
# with it; read at each launch, so a bench may set it before it builds an engine.
QKV_ROPE_WEIGHT_PREFETCH_BYTES = 0


@functools.lru_cache(maxsize=None)  # asked twice a layer per forward: can_fuse, then the launch
def _qkv_rope_config(m: int, n_rows: int, k: int, head_dim: int, device: torch.device,
                     qk_norm: bool = False, itemsize: int = 2,
                     fp8: bool = False) -> Optional[SkinnyConfig]:
    """The rule's config (with `fp8` an FP8 weight's, `FP8_F16_PRODUCTS` included) for the
    paired columns of a q/k/v projection, its column tiles cut to half a head where that is
    narrower; None where half a head is no whole number of tiles
    of at least 16 columns (tl.dot's least). With `qk_norm` a tile is exactly half a head (a
    program normalises whole heads; a power of two, for tl.arange), K split by the rule over
    those tiles, and K steps halved while the pipeline's tiles of x and of both weight halves
    (`itemsize` bytes an element; Triton keeps num_stages - 1 steps of them in shared memory)
    would not fit: the rule's 256-wide steps over 64-wide pairs take 144 KiB in 16-bit and
    twice that in fp32."""
    half = head_dim // 2
    if qk_norm:
        if head_dim % 2 or half < 16 or half & (half - 1):
            return None
        if fp8 and FP8_F16_PRODUCTS:
            config = fp8_f16_config(m, n_rows // 2, k, True, device, block_n=half)
        else:
            config = rule_config(m, n_rows // 2, k, True, device, block_n=half)
        rows = max(16, triton.next_power_of_2(m)) + 2 * half
        while (config.block_k > 16
               and (config.num_stages - 1) * rows * config.block_k * itemsize > SHARED_MEMORY):
            config = config._replace(block_k=config.block_k // 2)
        return config
    config = default_config(m, n_rows // 2, k, True, device, fp8)
    block_n = min(config.block_n, half)
    if head_dim % 2 or block_n < 16 or half % block_n:
        return None
    return config._replace(block_n=block_n)


def can_fuse_qkv_rope(x: torch.Tensor, weight: torch.Tensor, head_dim: int,
                      scale: Optional[WeightScale] = None, qk_norm: bool = False) -> bool:
    """Whether `skinny_qkv_rope` runs for this projection (with `qk_norm`, normalising the q
    and k heads): `can_use`, and a config whose column tiles lie within half a head (are half
    a head with `qk_norm`)."""
    if not can_use(x, weight, scale):
        return False
    n_rows, k = weight.shape
    config = _qkv_rope_config(x.numel() // k, n_rows, k, head_dim, x.device, qk_norm,
                              x.element_size(), scale is not None)
    return config is not None and (
        not qk_norm or _config_for(config, scale, k).block_n == head_dim // 2)


def skinny_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, loc: torch.Tensor,
                    config: Optional[SkinnyConfig] = None,
                    workspace: Optional[SkinnyWorkspace] = None,
                    scale: Optional[WeightScale] = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
                    weight_prefetch_bytes: Optional[int] = None
                    ) -> torch.Tensor:
    """The q/k/v projection with `rope_and_store_kv` (engine/layers/fused.py) in its epilogue:
    x [M, K] against the fused weight [(Hq + 2 Hk) * D, K] (q heads, k heads, v heads), RoPE
    (neox) of q and k at `positions` from the fp32 `cos`/`sin` tables [positions, D], k and v
    written to `k_cache[loc]` and `v_cache[loc]` ([slots, Hk, D] each; an FP8 cache stores
    them quantised with `k_scale` and `v_scale`). Returns q [M, Hq, D].
    One kernel instead of the GEMM and the RoPE kernel, with the same roundings. With `scale`
    the weight is FP8, as in `skinny_gemm`. With `qk_norm` (q_norm weight [D], k_norm weight
    [D], eps: Qwen3's per-head RMSNorm) each q and k head is normalised before RoPE (the two
    RMSNorm kernels gone too); its column tiles are then half a head.
    `weight_prefetch_bytes` (None: `QKV_ROPE_WEIGHT_PREFETCH_BYTES`; 0 or 128 times a power
    of two; CUDA only): the bytes at the start of each of its weight rows a program asks the
    L2 for before waiting for the kernel before it (engine/pdl.py's early reads)."""
    n_rows, k = weight.shape
    _check_operands(x, weight, scale)
    head_dim = n_rows // (num_q_heads + 2 * num_kv_heads)
    assert head_dim * (num_q_heads + 2 * num_kv_heads) == n_rows and head_dim % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[1:] == v_cache.shape[1:] == (num_kv_heads, head_dim)
    x2 = _rows_of(x, k, "skinny_qkv_rope")
    m = x2.shape[0]
    if bias is not None:
        assert bias.shape == (n_rows,) and bias.is_contiguous()
    config = config or _qkv_rope_config(m, n_rows, k, head_dim, x.device, qk_norm is not None,
                                        x.element_size(), scale is not None)
    assert config is not None, "a column tile must lie within half a head"
    config = _config_for(config, scale, k)  # (FP8 activations widen the tiles to 64)
    assert (head_dim // 2) % config.block_n == 0, "a column tile must lie within half a head"
    if qk_norm is not None:
        assert config.block_n == head_dim // 2, "with qk_norm a column tile is half a head"
        q_norm_w, k_norm_w, norm_eps = qk_norm
        assert q_norm_w.shape == k_norm_w.shape == (head_dim,)
    else:
        q_norm_w = k_norm_w = weight  # never read
        norm_eps = 0.0
    if weight_prefetch_bytes is None:
        weight_prefetch_bytes = QKV_ROPE_WEIGHT_PREFETCH_BYTES
    prefetch_lines = weight_prefetch_bytes // L2_LINE_BYTES
    assert weight_prefetch_bytes % L2_LINE_BYTES == 0 and prefetch_lines & (prefetch_lines - 1) == 0
    q = torch.empty((m, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    launch = _plan(x2, n_rows // 2, True, bias is not None, config, workspace, scale, unused=q)
    _skinny_qkv_rope_kernel[launch.grid](
        launch.x, weight, bias if bias is not None else weight, q, k_cache, v_cache, loc,
        positions, cos, sin, q_norm_w, k_norm_w, launch.partials, launch.arrivals, m, k,
        launch.k_per_split, launch.x.stride(0), weight.stride(0), launch.fp8, 1.0 / k_scale,
        1.0 / v_scale, norm_eps, NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2, KV_FP8=is_fp8(k_cache.dtype), QK_NORM=qk_norm is not None,
        PREFETCH_LINES=prefetch_lines if x.is_cuda else 0,  # (inline PTX: not the interpreter)
        LINE_ELEMENTS=L2_LINE_BYTES // weight.element_size(),
        **launch.meta)
    return q
