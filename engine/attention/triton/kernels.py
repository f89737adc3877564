"""Triton kernels for paged attention over the KV pool (page size 1).

Four launchers, each a thin host wrapper around one `@triton.jit` kernel:

- `fill_kv_indices`: gathers every request's prefix slots out of `req_to_token` into one flat
  `kv_indices` list with offsets `kv_indptr` (CSR). Lengths stay on the device: the host only
  supplies an upper bound for the size of `kv_indices`.
- `decode_attention`: one query token per request; split-KV (each program covers one slice of
  the sequence and writes a partial output and its log-sum-exp; the last slice to finish
  merges them), one pass when the sequence is a single slice.
- `extend_attention`: several new tokens per request (prefill, verify, draft-extend). The
  cached prefix is gathered through `kv_indices`; the new tokens come from their own slots
  (`new_token_slots`, i.e. `out_cache_loc`) under a causal or a custom (tree) mask.
- `short_extend_attention`: the same for a few new tokens per request (verify and
  draft-extend), split over the prefix like decode: every new token and every query head of a
  KV group share one tile, and the prefix is cut into splits that run in parallel and are
  merged as decode's are. A 4-token verify over 32k keys otherwise runs one
  program per KV head over the whole prefix.

Conventions shared by all kernels:
- No launcher reads device data on the host; grids are sized from host-known bounds and the
  kernels mask what lies past the real lengths.
- The attention kernels are GQA-grouped: one program handles every query head that shares a
  KV head, so each K/V tile is loaded once per group instead of once per query head. A group
  too large for one tile (MLA: one KV head for up to 128 query heads) is cut into slices of
  heads, one program each.
- Keys may be wider than values (MLA in its absorbed form: a key of kv_lora_rank latent dims
  plus qk_rope_head_dim rope dims, the value being the latent). The key is tiled as a main
  block (the value's dims) plus a rope block, so 512 + 64 is not padded to 1024; a value
  buffer that is a view of the key buffer's leading dims is loaded once for both.
- Scores live in base 2 (`sm_scale * log2(e)` folded into the scale) so softmax uses `exp2`.
- The K/V buffers may be an FP8 pool (float8_e4m3fn, `engine/kvcache/fp8.py`: stored value =
  x / scale). Tiles are loaded as stored and converted to the query's dtype (exact: every e4m3
  value is a bf16/fp16 value; the split kernels convert for bf16 queries by bit moves on
  sm_90, `DecodeConfig.fp8_convert`, and an FP8 pool has decode launch parameters of its own,
  `default_decode_config`); the launchers fold `k_scale` into the softmax scale (a score is
  linear in its key) and the kernels multiply their output by `v_scale` (an output is a convex
  combination of values; split partials are merged before it). Both are 1.0 for other pools,
  which leaves every result bit-identical.
- The last dimension of q, out and the K/V buffers must be contiguous.

The Triton interpreter (TRITON_INTERPRET=1) runs these kernels on the CPU, but its `tl.dot`
is wrong for bfloat16 operands (it multiplies the raw uint16 storage); test them there in fp32.
"""
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from specserve.engine.kvcache.fp8 import is_fp8
from specserve.engine.sm_count import num_sms
from specserve.engine.layers.fp8_convert import (
    check_fp8_convert, fp8_tile, has_sm90_conversions)
from specserve.engine.pdl import (
    EARLY_READS, launch_options, prefetch_l2, release_dependents, wait_for_predecessor)

LOG2_E = math.log2(math.e)
L2_LINE_BYTES = 128  # what one `prefetch_l2` address brings in


class DecodeConfig(NamedTuple):
    """Launch parameters of the split-KV decode kernels."""

    block_n: int            # KV tokens per loop iteration
    min_kv_split_len: int   # a sequence gets one more split per this many tokens, up to the max
    num_warps: int
    num_stages: int
    # Query rows (heads, or new tokens x heads in a split extend) per program: a KV head's
    # group larger than this (MLA's one KV head for every query head) is split into slices.
    block_h: int = 64
    # The most splits a long sequence is cut into (the backend sizes its split scratch by it;
    # the kernels take it from the scratch's shape).
    max_kv_splits: int = 16
    # How an FP8 pool's tiles become bf16 for the dots (other pools and queries ignore it):
    # "cast", Triton's conversion (e4m3x2 -> f16x2, then one f16 -> bf16 conversion a value,
    # both on the GPU's slow conversion pipe); "bits" (engine/layers/fp8_convert.py's
    # `fp8_tile`: byte moves and masks, then one bf16x2 multiply a pair; sm_90 and newer,
    # not the interpreter), which Triton moves into the dots' operand loads like "cast" (V,
    # the second dot's transposed operand, is then read from shared memory a byte at a time:
    # no ldmatrix for bytes).
    fp8_convert: str = "cast"
    # Decode only, CUDA only: a sequence of at most this many tokens has its K and V rows
    # asked of the L2 (`prefetch_l2`) before the wait (engine/pdl.py's early reads), so that
    # the gathers after the wait hit the L2; 0: none. A power of two. It reads
    # kv_indptr and kv_indices before the wait: the kernel launched just before the decode
    # must not write them (the backend fills them before the model's first layer).
    prefetch_tokens: int = 0
    # Decode only: the stages of a launch whose programs all fit one wave at a program an SM
    # (bs x KV heads x split programs <= the SMs: an 8B model's bs=1 decode, whose every
    # program is one latency-bound chain of gathered tiles); 0: `num_stages`. A wider grid
    # keeps `num_stages`, whose smaller shared memory lets several programs share an SM.
    one_wave_stages: int = 0


class ExtendConfig(NamedTuple):
    """Launch parameters of the extend kernel."""

    block_m: int            # query rows (token, head-of-group pairs) per program
    block_n: int            # KV tokens per loop iteration
    num_warps: int
    num_stages: int


def default_decode_config(head_dim: int, device: torch.device,
                          v_head_dim: Optional[int] = None,
                          kv_dtype: Optional[torch.dtype] = None) -> DecodeConfig:
    """Launch parameters for keys of `head_dim` and values of `v_head_dim` (default: the
    same) dims, over a pool of `kv_dtype` (default: the queries' dtype); values narrower than
    keys are MLA's latent (a 512 + 64 key, 512 values)."""
    is_mla = v_head_dim is not None and v_head_dim != head_dim
    if kv_dtype is None or not is_fp8(kv_dtype) or not has_sm90_conversions(device):
        return _default_decode_config(head_dim, device, is_mla)
    if head_dim <= 128 and not is_mla:
        return _FP8_DECODE_CONFIG
    # Other FP8 heads keep their 16-bit pool's tiles (untimed over FP8), converted by bits.
    return _default_decode_config(head_dim, device, is_mla)._replace(fp8_convert="bits")


def _checked(config: DecodeConfig) -> DecodeConfig:
    check_fp8_convert(config.fp8_convert)
    tokens = config.prefetch_tokens
    if tokens < 0 or tokens & (tokens - 1):
        raise ValueError(f"prefetch_tokens must be 0 or a power of two, not {tokens}")
    return config


# A 32k-token bs=1 decode over the FP8 pool with the bf16 pool's config ran at about 1.1 TB/s
# against bf16's 2.5 (8B, H100): the loop is latency-bound, not bandwidth-bound. Compiled by
# Triton 3.6 for sm_90 (PTX read; on an H200 the bf16 loop in 5 stages then ran 1.3x faster at
# 32k, bs=1: `one_wave_stages`), that config keeps one K and one V buffer in
# shared memory below 5 stages: each 128-token iteration issues its loads after the previous
# tile's dots and waits for them at once (`cp.async.wait_group 0`), so an iteration costs
# about the same with half the bytes; from 5 stages there are two (`wait_group 3`: the next
# tile's loads fly during this one's dots), from 7 three. The FP8 loop also ran, per thread
# and tile, 256 f16 -> bf16 conversions (F2F, a quarter-rate pipe) after 128 e4m3x2 unpacks,
# and read V's tile (the second dot's transposed operand: no ldmatrix for bytes) a byte at a
# time. So for FP8: the exact "bits" conversion (no F2F) and 5 stages (two buffers: 73 KiB of
# shared memory, 168 registers a thread at 4 warps). `bench/attention_kernels.py --fp8-sweep`
# times it against the others (tiles, warps, stages, splits, conversions) and the bf16 pool's:
# on an H100 at 32k tokens, bs=1, 16 splits ran in 43 us against 56 at 32 and 76 at 64 (the
# bf16 pool's default: 60 us), the best of the grid; but that sweep replayed one pool, partly
# held by the L2, and in the engine's 32k profile this config and the bf16 pool's both take
# 63-64 us a layer: to be re-swept with the bench's pool copies.
_FP8_DECODE_CONFIG = DecodeConfig(block_n=128, min_kv_split_len=256, num_warps=4, num_stages=5,
                                  max_kv_splits=16, fp8_convert="bits")


def _default_decode_config(head_dim: int, device: torch.device, is_mla: bool) -> DecodeConfig:
    if torch.device(device).type != "cuda":
        # Interpreter: fewer, larger numpy ops are faster; the values only need to be legal.
        return DecodeConfig(block_n=32, min_kv_split_len=64, num_warps=4, num_stages=1,
                            block_h=16 if is_mla else 64)
    if is_mla:
        # 16 query heads a program (a 16 x 512 fp32 accumulator) against 32-token tiles of
        # the 576-dim key in two stages (2 x 36 KiB of shared memory); the heads of MLA's
        # single group are sliced across programs that read the same tiles (SGLang's Triton
        # MLA decode uses the same tiling). A split per two 32-token tiles: with V2-Lite's 16
        # heads a request is one program per split, so 256 tokens a split ran a 128-token
        # context as one program walking 4 dependent tiles (16 us a layer on an H100, a
        # latency chain, not bandwidth); a split per tile made that 4 programs merged by the
        # last, but at bs=64 the verify's fp32 partials (16 heads x 512 a split) cost more
        # than its keys. Against one tile a split (H200, one lease, twice; DeepSeek-V2-Lite,
        # 128-token prompts): bs=64 plain 11.04 vs 11.25 ms, NextN 15.75 vs 16.14 ms; bs=1
        # plain 2.33 vs 2.32 ms, NextN 4.84 vs 4.82 ms. 64-token tiles were faster at bs=1
        # plain (2.29 ms) but slower in verify (NextN bs=1 5.00 ms). Contexts from 1k tokens
        # get 16 splits either way. bench/mla_moe_kernels.py --sweep times others.
        return DecodeConfig(block_n=32, min_kv_split_len=64, num_warps=4, num_stages=2,
                            block_h=16)
    # H100/H200: 128-token tiles in three stages keep enough gathered K/V rows in flight to
    # stream a long context (bench/attention_kernels.py --sweep, 8B shape, 32k tokens, bs 1:
    # 71 us a layer against 95 us with 64-token tiles in two stages); a 128 x 128 bf16 K (or
    # V) tile is 32 KiB (Triton 3.6 keeps one of each at three stages, 72 KiB of shared
    # memory, and two from five: see `_FP8_DECODE_CONFIG`, and for bf16 below). Larger heads
    # use smaller tiles. 256 tokens a split: a 32-token split (MLA's rule, cut inside the
    # 128-token tiles, which the kernel supports) took Qwen3-30B-A3B's bs=1 step from 52.9 to
    # 55.5 % of its limit together with the fused q/k norm and router, but in the same run the
    # bs=64 chain steps were slower (Qwen3 37.6 against 32.8 ms, the 8B shape 19.8 against
    # 13.9 ms, different context widths) and the lease ended before the split was timed alone:
    # `bench/attention_kernels.py --sweep-min-split 32,256` does that.
    #
    # A launch that fits one wave (`DecodeConfig.one_wave_stages`: an 8B model's bs=1) takes
    # five stages, which double-buffer K and V: on an H200 (`bench/attention_kernels.py
    # --sweep`, bs 1, pools cycled past the L2) 41.9 us a layer at 32k tokens against 53.7 in
    # three, 16.9 against 22.9 at 8k, 5.5 against 5.3 at 160; in the 8B engine at bs=1 and 32k
    # 178.3 tok/s against 171.2. Five stages for every batch cost bs=64 at 128 tokens 5 % of
    # its tok/s (fewer programs an SM): only the one-wave launches take them.
    #
    # A short sequence (up to 256 tokens: one split) is prefetched into the L2 before the
    # wait: at bs=1 and a short context (128 tokens, 8B) the decode is 8 programs whose one
    # split is a chain of reads (the KV indices, then the gathered K and V rows from DRAM,
    # one 128-token tile after the other) after the q/k/v kernel, 7.6 us a layer in the step
    # profile; the indices and the prefetch now run during that kernel's split-K merge and
    # RoPE epilogue. `bench/attention_kernels.py --prefetch` times it on and off.
    if head_dim <= 128:
        return DecodeConfig(block_n=128, min_kv_split_len=256, num_warps=4, num_stages=3,
                            prefetch_tokens=256, one_wave_stages=5)
    return DecodeConfig(block_n=32, min_kv_split_len=256, num_warps=4, num_stages=2)


def default_extend_config(head_dim: int, device: torch.device,
                          v_head_dim: Optional[int] = None) -> ExtendConfig:
    if torch.device(device).type != "cuda":
        return ExtendConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if head_dim > 256 or (v_head_dim or head_dim) > 256:
        # MLA's 576-dim keys and 512-dim latent values: a 32 x 512 fp32 accumulator per
        # program keeps to the registers of 8 warps.
        return ExtendConfig(block_m=32, block_n=32, num_warps=8, num_stages=1)
    # H100/H200: 128 query rows against 64-token K/V tiles; 8 warps for head_dim 128 keep the
    # 128 x 128 fp32 accumulator in registers. Larger heads halve both tiles.
    if head_dim <= 64:
        return ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)
    if head_dim <= 128:
        return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=1)


def _dot_input_precision(dtype: torch.dtype) -> str:
    # fp32 operands would silently run as TF32 on tensor cores; keep them exact so an fp32
    # engine matches the torch reference. The setting does not affect 16-bit operands.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------------
# kv_indptr / kv_indices
# ---------------------------------------------------------------------------------------------

# Compiled once whatever the batch: the request table's row stride (a snapshot table's width:
# any number) and the per-request vectors (views at any offset) are not specialised on their
# value or alignment. A served H200 run compiled this kernel again 1,632 steps in (127 ms in
# one step; docs/benchmarks.md, sixteenth round): most likely a width or an offset the warm-up
# had not met (its constexprs take values every warm-up meets). Recorded over the Triton
# backend's CPU tests (mixed, captured, backend): row strides that are and are not multiples
# of 16, decode slots at 8-byte offsets, every vector int64. Their values are read one a
# program, and the table's rows 8 bytes a lane rather than 16.
FILL_KV_UNSPECIALIZED = ("req_pool_indices", "prefix_lens", "new_token_slots", "stride_table_row")
# The same for the extend kernels: their new tokens' slots come as views at any offset, and a
# tree mask's strides are its width (both seen to vary over the CPU tests); they are read a
# few values a program.
EXTEND_UNSPECIALIZED = ("new_token_slots", "stride_mask_req", "stride_mask_row")


@triton.jit(do_not_specialize=FILL_KV_UNSPECIALIZED)
def _fill_kv_indices_kernel(
    req_to_token, req_pool_indices, prefix_lens, kv_indptr, kv_indices, new_token_slots,
    stride_table_row,
    APPEND_NEW_TOKEN: tl.constexpr, BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    req = tl.program_id(0)
    row = tl.load(req_pool_indices + req).to(tl.int64)
    num_prefix = tl.load(prefix_lens + req).to(tl.int64)
    # The list's offset is the sum of the earlier lists' lengths: each program sums them
    # itself (a few hundred at most), which saves the cumsum's kernels before this one.
    out_start = tl.zeros([], tl.int64)
    for start in range(0, req, SCAN_BLOCK):
        earlier = start + tl.arange(0, SCAN_BLOCK)
        lens = tl.load(prefix_lens + earlier, mask=earlier < req, other=0).to(tl.int64)
        out_start += tl.sum(lens + tl.where(earlier < req, APPEND_NEW_TOKEN, 0), 0)
    if req == 0:
        tl.store(kv_indptr, out_start)
    tl.store(kv_indptr + req + 1, out_start + num_prefix + APPEND_NEW_TOKEN)
    offs = tl.arange(0, BLOCK)
    for start in range(0, num_prefix, BLOCK):
        pos = start + offs
        mask = pos < num_prefix
        slots = tl.load(req_to_token + row * stride_table_row + pos, mask=mask)
        tl.store(kv_indices + out_start + pos, slots, mask=mask)
    if APPEND_NEW_TOKEN:
        tl.store(kv_indices + out_start + num_prefix, tl.load(new_token_slots + req))


def fill_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    prefix_lens: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    decode_token_slots: Optional[torch.Tensor] = None, block: int = 512) -> None:
    """Write request b's KV slot list at `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`.

    The list is `req_to_token[req_pool_indices[b], :prefix_lens[b]]`, followed by
    `decode_token_slots[b]` when given (decode attends to its own new token too).
    `kv_indptr` ([bs+1]) is overwritten; `kv_indices` must hold the sum of the list lengths,
    which the caller bounds from host values (e.g. `bs * max_seq_len`). One kernel.
    """
    bs = req_pool_indices.shape[0]
    assert kv_indptr.shape[0] >= bs + 1 and req_to_token.stride(1) == 1
    # Read as consecutive values (a one-element view of any stride is contiguous too).
    assert decode_token_slots is None or decode_token_slots.is_contiguous()
    if bs == 0:
        kv_indptr[:1].zero_()  # not `= 0`: a host scalar copy, which CUDA-graph capture refuses
        return
    _fill_kv_indices_kernel[(bs,)](
        req_to_token, req_pool_indices, prefix_lens, kv_indptr, kv_indices,
        decode_token_slots if decode_token_slots is not None else kv_indices,  # unused then
        req_to_token.stride(0),
        APPEND_NEW_TOKEN=decode_token_slots is not None, BLOCK=block, SCAN_BLOCK=256,
        **launch_options(kv_indices.device),
    )


# ---------------------------------------------------------------------------------------------
# Shared pieces of the attention kernels
# ---------------------------------------------------------------------------------------------

class _HeadLayout(NamedTuple):
    """How the kernels tile a head's dimensions. Keys have `main_dim + rope_dim` dims and values
    `main_dim`; the key's first `main_dim` dims go in one block with the values' dims and the
    last `rope_dim` (MLA's decoupled RoPE key; 0 otherwise) in a second, so a 512 + 64 MLA key
    is tiled as 512 + 64 rather than padded to 1024."""

    main_dim: int
    rope_dim: int
    block_d: int
    block_dpe: int    # 1 (unused) without a rope part
    # How the kernels address the values: "key_strides" (a buffer shaped like the keys: the
    # key offsets serve, as in Llama's pool), "key_prefix" (the first main_dim dims of the
    # keys, MLA's latent: the key tile is the value tile) or "own_strides".
    values: str


def _head_layout(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> _HeadLayout:
    key_dim, value_dim = k_buffer.shape[-1], v_buffer.shape[-1]
    assert q.shape[-1] == key_dim and value_dim <= key_dim, (q.shape, k_buffer.shape,
                                                             v_buffer.shape)
    rope_dim = key_dim - value_dim
    same_strides = v_buffer.stride() == k_buffer.stride()
    if same_strides and v_buffer.data_ptr() == k_buffer.data_ptr():
        # The MLA pool hands out the latent as a view of the key buffer: one load serves
        # both, instead of reading the same bytes twice.
        values = "key_prefix"
    else:
        values = "key_strides" if same_strides else "own_strides"
    # tl.dot takes 16 dims at least on a GPU (the tiny test models' rope keys have 8); the
    # padded dims load as zeros.
    block_dpe = max(16, triton.next_power_of_2(rope_dim)) if rope_dim else 1
    return _HeadLayout(value_dim, rope_dim, triton.next_power_of_2(value_dim), block_dpe, values)


@triton.jit
def _load_query(q, row_offsets, row_mask, offs_d, dim_mask, MAIN_DIM: tl.constexpr,
                ROPE_DIM: tl.constexpr, BLOCK_DPE: tl.constexpr):
    """The query rows at `q + row_offsets`: their main part [rows, BLOCK_D] and, when the key
    has a rope block (MLA), their rope part [rows, BLOCK_DPE] (else the main part again)."""
    q_tile = tl.load(q + row_offsets[:, None] + offs_d[None, :],
                     mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if ROPE_DIM > 0:
        offs_dpe = tl.arange(0, BLOCK_DPE)
        q_rope = tl.load(q + row_offsets[:, None] + MAIN_DIM + offs_dpe[None, :],
                         mask=row_mask[:, None] & (offs_dpe < ROPE_DIM)[None, :], other=0.0)
    else:
        q_rope = q_tile
    return q_tile, q_rope


@triton.jit
def _online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores [rows, cols] and its values [cols, dim] into the running
    max `m_i`, denominator `l_i` and unnormalised output `acc`. Masked scores are -inf."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has only seen masked columns keeps m = -inf; shifting by 0 instead makes
    # exp2 return 0 for it rather than NaN (-inf - -inf).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tile_scores(q_tile, q_rope, k_buffer, v_buffer, slots, kv_head, stride_k_slot,
                 stride_k_head, stride_v_slot, stride_v_head, offs_d, col_mask, dim_mask,
                 MAIN_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_DPE: tl.constexpr,
                 VALUES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FP8_CONVERT: tl.constexpr):
    """Unscaled scores of the query rows against the keys of `slots` ([rows, cols]) and those
    keys' values ([cols, dim], in the dot's dtype)."""
    slots = slots.to(tl.int64)
    tile_mask = col_mask[:, None] & dim_mask[None, :]
    offsets = slots[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :]
    k = fp8_tile(tl.load(k_buffer + offsets, mask=tile_mask, other=0.0), q_tile.dtype,
                 FP8_CONVERT)
    if VALUES == "key_prefix":
        v = k
    elif VALUES == "key_strides":
        v = fp8_tile(tl.load(v_buffer + offsets, mask=tile_mask, other=0.0), q_tile.dtype,
                     FP8_CONVERT)
    else:
        v = fp8_tile(tl.load(v_buffer + slots[:, None] * stride_v_slot + kv_head * stride_v_head
                             + offs_d[None, :], mask=tile_mask, other=0.0), q_tile.dtype,
                     FP8_CONVERT)
    if ROPE_DIM > 0:
        offs_dpe = tl.arange(0, BLOCK_DPE)
        k_rope = fp8_tile(tl.load(k_buffer + slots[:, None] * stride_k_slot
                                  + kv_head * stride_k_head + MAIN_DIM + offs_dpe[None, :],
                                  mask=col_mask[:, None] & (offs_dpe < ROPE_DIM)[None, :],
                                  other=0.0), q_tile.dtype, FP8_CONVERT)
    scores = tl.dot(q_tile, tl.trans(k), input_precision=DOT_PRECISION)
    if ROPE_DIM > 0:
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
    return scores, v


@triton.jit
def _attend_slot_range(q_tile, q_rope, m_i, l_i, acc, k_buffer, v_buffer, slot_list, begin, end,
                       kv_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                       offs_n, offs_d, dim_mask, sm_scale_log2, BLOCK_N: tl.constexpr,
                       MAIN_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_DPE: tl.constexpr,
                       VALUES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       FP8_CONVERT: tl.constexpr):
    """Fold keys `slot_list[begin:end]`, all visible to every row, into the running softmax."""
    for start in range(begin, end, BLOCK_N):
        cols = start + offs_n
        col_mask = cols < end
        slots = tl.load(slot_list + cols, mask=col_mask, other=0)
        scores, v = _tile_scores(q_tile, q_rope, k_buffer, v_buffer, slots, kv_head,
                                 stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                                 offs_d, col_mask, dim_mask, MAIN_DIM, ROPE_DIM, BLOCK_DPE,
                                 VALUES, DOT_PRECISION, FP8_CONVERT)
        scores = tl.where(col_mask[None, :], scores * sm_scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attend_new_tokens(q_tile, q_rope, m_i, l_i, acc, k_buffer, v_buffer, new_token_slots,
                       custom_mask, req, tokens, row_mask, end, extend_len, kv_head,
                       stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                       stride_mask_req, stride_mask_row, offs_n, offs_d, dim_mask, sm_scale_log2,
                       BLOCK_N: tl.constexpr, USE_CUSTOM_MASK: tl.constexpr,
                       MAIN_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_DPE: tl.constexpr,
                       VALUES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       FP8_CONVERT: tl.constexpr):
    """Fold this forward's new tokens `[0, end)` (their slots were just written, so they are
    what later forwards will see in the pool) under the causal or the custom (tree) mask."""
    for start in range(0, end, BLOCK_N):
        cols = start + offs_n
        col_mask = cols < extend_len
        slots = tl.load(new_token_slots + cols, mask=col_mask, other=0)
        scores, v = _tile_scores(q_tile, q_rope, k_buffer, v_buffer, slots, kv_head,
                                 stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                                 offs_d, col_mask, dim_mask, MAIN_DIM, ROPE_DIM, BLOCK_DPE,
                                 VALUES, DOT_PRECISION, FP8_CONVERT)
        scores = scores * sm_scale_log2
        if USE_CUSTOM_MASK:
            visible = tl.load(custom_mask + req * stride_mask_req
                              + tokens[:, None] * stride_mask_row + cols[None, :],
                              mask=row_mask[:, None] & col_mask[None, :], other=0) != 0
        else:
            visible = (cols[None, :] <= tokens[:, None]) & col_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _softmax_start(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax's state before any key: running max, sum and output of ROWS rows."""
    return (tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32),
            tl.zeros([ROWS, BLOCK_D], tl.float32))


@triton.jit
def _store_or_merge_splits(acc, m_i, l_i, out_ptrs, po_ptrs, pl_ptrs, tile_mask, row_mask, split,
                           num_splits, counter, stride_po_split, v_scale, BLOCK_M: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Finish one split's rows: a single split stores its output at once; otherwise every split
    stores its partial result (normalised output and base-2 log-sum-exp) and counts its arrival
    on `counter`, and the last to arrive merges them all in split order, stores the output and
    zeroes the counter for the next launch (and the next CUDA-graph replay). A second kernel
    for the merge would cost a launch a layer, more than the merge itself at short contexts.
    Splits past the end of a short sequence (`split >= num_splits`) store nothing. Partials
    are unscaled; `v_scale` (the FP8 pool's V scale, else 1.0) scales the output."""
    if num_splits == 1:
        if split == 0:
            # Padded rows saw nothing (l = 0); they are not stored, the guard avoids 0/0.
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            tl.store(out_ptrs, (acc / l_i[:, None] * v_scale).to(out_ptrs.dtype.element_ty),
                     mask=tile_mask)
    elif split < num_splits:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(po_ptrs + split * stride_po_split, acc / l_i[:, None], mask=tile_mask)
        tl.store(pl_ptrs + split, m_i + tl.log2(l_i), mask=row_mask)
        # Every thread's partial stores come before the arrival (a CTA barrier, then the
        # atomic's release); the last split reads the others' after its acquire, from L2.
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            tl.debug_barrier()
            m_i, l_i, acc = _softmax_start(BLOCK_M, BLOCK_D)
            for s in range(0, num_splits):
                lse = tl.load(pl_ptrs + s, mask=row_mask, other=0.0, cache_modifier=".cg")
                part = tl.load(po_ptrs + s * stride_po_split, mask=tile_mask, other=0.0,
                               cache_modifier=".cg")
                m_new = tl.maximum(m_i, lse)
                alpha = tl.exp2(m_i - m_new)
                weight = tl.exp2(lse - m_new)
                acc = acc * alpha[:, None] + weight[:, None] * part
                l_i = l_i * alpha + weight
                m_i = m_new
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            tl.store(out_ptrs, (acc / l_i[:, None] * v_scale).to(out_ptrs.dtype.element_ty),
                     mask=tile_mask)
            tl.store(counter, 0)


# ---------------------------------------------------------------------------------------------
# Decode: split-KV, merged by the last split
# ---------------------------------------------------------------------------------------------

# Programs a tile's splits run on, per SM: where a batch's tiles alone make this many, its
# splits run one after the other in a tile's program. A program launched for a split past
# its prefix's end still costs the GPU a dispatch: with a program a split (16), a chain
# verify of 60 rows of ~300-token prefixes (2 splits each) launched 7,680 programs a layer,
# ~7 of 8 with nothing to do, and the 256-token mixed graph (64-token chunks: 4 token blocks
# a tile) 34,816, its attention 6.4 ms of the step's 14.0 ms of kernels. With this, on an
# H100 (8B): that mixed step's attention 0.95 ms (8.6 ms of kernels), a 64-row verify over
# 320 tokens 58 against 76 us a layer (bench/attention_kernels.py --split-programs 16 rows).
SPLIT_PROGRAMS_PER_SM = 4


def default_split_programs(tiles: int, max_kv_splits: int, device: torch.device) -> int:
    """Programs per tile: every split its own where the tiles leave the GPU room (a long
    prefix at a small batch), fewer down to one as the tiles fill SPLIT_PROGRAMS_PER_SM."""
    return max(1, min(max_kv_splits, triton.cdiv(SPLIT_PROGRAMS_PER_SM * num_sms(device), tiles)))


@triton.jit
def _kv_split_len(seq_len, MAX_KV_SPLITS: tl.constexpr, MIN_KV_SPLIT_LEN: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Tokens per split of a sequence: a multiple of BLOCK_N, or of MIN_KV_SPLIT_LEN where that
    is smaller (then a split may end inside a tile, whose masked rows load nothing: a short
    context runs as several one-tile programs without the long contexts' tiles shrinking;
    SGLang's Triton decode splits at 32 tokens under its 64-token tiles the same way).
    Depends only on the sequence's own length, so a request's result does not change with the
    batch it runs in."""
    if MIN_KV_SPLIT_LEN < BLOCK_N:
        granule: tl.constexpr = MIN_KV_SPLIT_LEN
    else:
        granule: tl.constexpr = BLOCK_N
    num_splits = tl.maximum(tl.minimum(tl.cdiv(seq_len, MIN_KV_SPLIT_LEN), MAX_KV_SPLITS), 1)
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), granule), 1) * granule


@triton.jit
def _prefetch_kv_rows(k_buffer, v_buffer, slot_list, begin, end, kv_head, stride_k_slot,
                      stride_k_head, stride_v_slot, stride_v_head, MAIN_DIM: tl.constexpr,
                      ROPE_DIM: tl.constexpr, VALUES: tl.constexpr, TOKENS: tl.constexpr,
                      LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr):
    """Ask the L2 for the K (and V) rows of `kv_head` of the keys `slot_list[begin:end]`,
    at most TOKENS of them, a line of LINE_ELEMENTS elements at a time (LINES a row, a power
    of two). Lines past a row's end and keys past `end` name the first key's first line
    again: every address lies in the buffers."""
    if begin < end:  # (the splits past a short sequence's end have nothing to fetch)
        cols = begin + tl.arange(0, TOKENS)
        col_mask = cols < end
        slots = tl.load(slot_list + cols, mask=col_mask, other=0)
        slots = tl.where(col_mask, slots, tl.load(slot_list + begin)).to(tl.int64)[:, None]
        lines = tl.arange(0, LINES)[None, :] * LINE_ELEMENTS
        key_lines = tl.where(lines < MAIN_DIM + ROPE_DIM, lines, 0)
        prefetch_l2(k_buffer + slots * stride_k_slot + kv_head * stride_k_head + key_lines)
        value_lines = tl.where(lines < MAIN_DIM, lines, 0)
        if VALUES == "key_strides":
            prefetch_l2(v_buffer + slots * stride_k_slot + kv_head * stride_k_head + value_lines)
        elif VALUES == "own_strides":
            prefetch_l2(v_buffer + slots * stride_v_slot + kv_head * stride_v_head + value_lines)


@triton.jit
def _decode_kernel(
    q, out, k_buffer, v_buffer, kv_indptr, kv_indices, partial_out, partial_lse, arrivals,
    sm_scale_log2, v_scale, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_k_slot,
    stride_k_head, stride_v_slot, stride_v_head, stride_po_tok, stride_po_head, stride_po_split,
    stride_pl_tok, stride_pl_head,
    GROUP_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    MAIN_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr, VALUES: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr, MIN_KV_SPLIT_LEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_CONVERT: tl.constexpr, PDL: tl.constexpr, PREFETCH_TOKENS: tl.constexpr = 0,
    PREFETCH_LINES: tl.constexpr = 1, LINE_ELEMENTS: tl.constexpr = 64,
):
    # A program covers BLOCK_H query heads of one KV head's group (the whole group unless it
    # is larger than BLOCK_H, as MLA's one KV head for all query heads is) over splits of the
    # sequence (below). A sequence of at most MIN_KV_SPLIT_LEN tokens is one split: one pass,
    # its program stores the output and the other programs exit at once.
    req = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    first_split = tl.program_id(2)

    # With PREFETCH_TOKENS, before the wait (engine/pdl.py's early reads), while the q/k/v
    # kernel's tail runs: the KV indices (written before the model's first layer, never by
    # the predecessor: `DecodeConfig.prefetch_tokens`) and, for a sequence of at most
    # PREFETCH_TOKENS tokens, an L2 prefetch of its K and V (each split its own part), so
    # the loads after the wait hit the L1 (indices) and the L2 (K and V). Longer sequences
    # stream many tiles; there the prefetch would save one latency of many and add a burst
    # of loads to the predecessor's tail.
    EARLY_INDICES: tl.constexpr = PREFETCH_TOKENS > 0 and EARLY_READS
    if not EARLY_INDICES:
        wait_for_predecessor(PDL)
    kv_start = tl.load(kv_indptr + req)
    seq_len = tl.load(kv_indptr + req + 1) - kv_start
    split_len = _kv_split_len(seq_len, MAX_KV_SPLITS, MIN_KV_SPLIT_LEN, BLOCK_N)
    num_splits = tl.maximum(tl.cdiv(seq_len, split_len), 1)
    if EARLY_INDICES:  # (a sequence this short is one split: its program's first)
        first_begin = first_split * split_len
        _prefetch_kv_rows(k_buffer, v_buffer, kv_indices + kv_start, first_begin,
                          tl.where(seq_len <= PREFETCH_TOKENS,
                                   tl.minimum(first_begin + split_len, seq_len), first_begin),
                          kv_head,
                          stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, MAIN_DIM,
                          ROPE_DIM, VALUES, PREFETCH_TOKENS, PREFETCH_LINES, LINE_ELEMENTS)
        wait_for_predecessor(PDL)
    release_dependents(PDL)

    if HEAD_BLOCKS == 1:
        offs_h = tl.arange(0, BLOCK_H)
    else:
        offs_h = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP_SIZE + offs_h
    head_mask = offs_h < GROUP_SIZE
    dim_mask = offs_d < MAIN_DIM
    q_tile, q_rope = _load_query(q, req * stride_q_tok + heads * stride_q_head, head_mask,
                                 offs_d, dim_mask, MAIN_DIM, ROPE_DIM, BLOCK_DPE)

    # The splits program_id(2), + num_programs(2), ...: a program a split unless the batch
    # fills the GPU without (`default_split_programs`); the same result either way.
    for split in range(first_split, num_splits, tl.num_programs(2)):
        split_begin = split * split_len
        m_i, l_i, acc = _softmax_start(BLOCK_H, BLOCK_D)
        m_i, l_i, acc = _attend_slot_range(
            q_tile, q_rope, m_i, l_i, acc, k_buffer, v_buffer, kv_indices + kv_start,
            split_begin, tl.minimum(split_begin + split_len, seq_len), kv_head, stride_k_slot,
            stride_k_head, stride_v_slot, stride_v_head, offs_n, offs_d, dim_mask,
            sm_scale_log2, BLOCK_N, MAIN_DIM, ROPE_DIM, BLOCK_DPE, VALUES, DOT_PRECISION,
            FP8_CONVERT)
        _store_or_merge_splits(
            acc, m_i, l_i,
            out + req * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
            partial_out + req * stride_po_tok + heads[:, None] * stride_po_head + offs_d[None, :],
            partial_lse + req * stride_pl_tok + heads * stride_pl_head,
            head_mask[:, None] & dim_mask[None, :], head_mask, split, num_splits,
            arrivals + req * tl.num_programs(1) + tl.program_id(1), stride_po_split, v_scale,
            BLOCK_H, BLOCK_D)


def _check_qkv_out(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                   out: torch.Tensor) -> None:
    assert q.shape[1] % k_buffer.shape[1] == 0 and v_buffer.shape[1] == k_buffer.shape[1]
    assert out.shape == (*q.shape[:2], v_buffer.shape[-1]), (out.shape, q.shape, v_buffer.shape)
    assert q.stride(-1) == out.stride(-1) == k_buffer.stride(-1) == v_buffer.stride(-1) == 1


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     out: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     partial_out: torch.Tensor, partial_lse: torch.Tensor, arrivals: torch.Tensor,
                     sm_scale: float, config: Optional[DecodeConfig] = None,
                     k_scale: float = 1.0, v_scale: float = 1.0,
                     split_programs: Optional[int] = None) -> None:
    """out[b] = attention of q[b] over the slots `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`.

    q: [bs, num_heads, key_dim]; k_buffer: [slots, num_kv_heads, key_dim]; v_buffer: [slots,
    num_kv_heads, value_dim] (any slot/head strides; may be a view of the key buffer, as
    MLA's latent is); out: [bs, num_heads, value_dim]. partial_out: [>= bs, num_heads,
    max_kv_splits, value_dim] fp32 and partial_lse: [>= bs, num_heads, max_kv_splits] fp32
    are scratch; `max_kv_splits` is their third dim. arrivals: int32 [>= bs * num_kv_heads *
    tiles per KV head (at most the group size rounded up to a power of two)], all zero (the
    kernel leaves them zero). `k_scale`, `v_scale`: an FP8 pool's scales (stored = x / scale).
    With `config.prefetch_tokens` (the CUDA default's), the kernel launched just before this
    one must not write `kv_indptr` or `kv_indices`. `split_programs`: the programs that run a
    tile's splits (default: `default_split_programs`'s); any number gives the same result.
    """
    bs, num_heads, key_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    _check_qkv_out(q, k_buffer, v_buffer, out)
    assert partial_out.dtype == partial_lse.dtype == torch.float32
    assert partial_out.shape[0] >= bs and partial_out.shape[1:3] == partial_lse.shape[1:]
    layout = _head_layout(q, k_buffer, v_buffer)
    config = _checked(config or default_decode_config(key_dim, q.device, layout.main_dim,
                                                      k_buffer.dtype))
    group_size = num_heads // num_kv_heads
    heads_per_tile, head_blocks = _head_tiling(group_size, max(16, config.block_h))
    block_h = max(16, heads_per_tile)  # tl.dot needs at least 16 rows; padded rows are masked
    assert arrivals.dtype == torch.int32 and arrivals.numel() >= bs * num_kv_heads * head_blocks
    if bs == 0:
        return
    max_kv_splits = partial_out.shape[2]
    split_programs = split_programs or default_split_programs(bs * num_kv_heads * head_blocks,
                                                              max_kv_splits, q.device)
    stages = decode_stages(config, bs * num_kv_heads * head_blocks * split_programs, q.device,
                           k_buffer.element_size())
    _decode_kernel[(bs, num_kv_heads * head_blocks, split_programs)](
        q, out, k_buffer, v_buffer, kv_indptr, kv_indices, partial_out, partial_lse, arrivals,
        sm_scale * LOG2_E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_buffer.stride(0),
        k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP_SIZE=group_size, BLOCK_H=block_h, HEAD_BLOCKS=head_blocks,
        MAIN_DIM=layout.main_dim, ROPE_DIM=layout.rope_dim, BLOCK_D=layout.block_d,
        BLOCK_DPE=layout.block_dpe, VALUES=layout.values, BLOCK_N=config.block_n,
        MAX_KV_SPLITS=max_kv_splits, MIN_KV_SPLIT_LEN=config.min_kv_split_len,
        DOT_PRECISION=_dot_input_precision(q.dtype), FP8_CONVERT=config.fp8_convert,
        **decode_prefetch_meta(config, k_buffer, q.device),
        num_warps=config.num_warps, num_stages=stages, **launch_options(q.device),
    )


def decode_stages(config: DecodeConfig, programs: int, device: torch.device,
                  kv_bytes: int = 2) -> int:
    """The stages of a decode launch of `programs` programs over a pool of `kv_bytes` an
    element: `config.one_wave_stages` where they fit one wave at a program an SM and the pool
    is 16-bit or narrower (as timed: an fp32 pool's double-buffered 128-token K and V tiles,
    256 KB, would not fit an H100's shared memory), else `config.num_stages`."""
    if config.one_wave_stages and programs <= num_sms(device) and kv_bytes <= 2:
        return config.one_wave_stages
    return config.num_stages


def decode_prefetch_meta(config: DecodeConfig, k_buffer: torch.Tensor,
                         device: torch.device) -> dict:
    """The decode kernel's prefetch constexprs for `config` over keys like `k_buffer`'s: none
    off CUDA (the hint is inline PTX, which the interpreter does not run)."""
    line_elements = L2_LINE_BYTES // k_buffer.element_size()
    return dict(PREFETCH_TOKENS=config.prefetch_tokens if device.type == "cuda" else 0,
                PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(k_buffer.shape[-1],
                                                                  line_elements)),
                LINE_ELEMENTS=line_elements)


def _head_tiling(group_size: int, max_rows: int, tokens_pad: int = 1) -> tuple[int, int]:
    """(heads per tile, tiles per KV head) for tiles of `tokens_pad` tokens: the whole group
    (padded to a power of two) when it fits in `max_rows`, else a power-of-two slice of it."""
    group_pad = triton.next_power_of_2(group_size)
    heads_per_tile = min(group_pad, max(1, max_rows // tokens_pad))
    return heads_per_tile, triton.cdiv(group_size, heads_per_tile)


@triton.jit(do_not_specialize=EXTEND_UNSPECIALIZED)
def _extend_attention_kernel(
    q, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, new_token_slots,
    custom_mask, sm_scale_log2, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head, stride_mask_req, stride_mask_row,
    GROUP_SIZE: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    MAIN_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr, VALUES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_CUSTOM_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_CONVERT: tl.constexpr, PDL: tl.constexpr,
):
    # Row r of the program's tile is (new token r // HEADS_PER_TILE, query head
    # r % HEADS_PER_TILE of this program's slice of the KV head's group): all those heads
    # share every K/V tile the program loads. The slice is the whole group unless the group
    # is larger than a tile (MLA).
    wait_for_predecessor(PDL)
    TOKENS_PER_BLOCK: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    req = tl.program_id(0)
    if HEAD_BLOCKS == 1:
        kv_head = tl.program_id(1)
    else:
        kv_head = tl.program_id(1) // HEAD_BLOCKS
        first_head = (tl.program_id(1) % HEAD_BLOCKS) * HEADS_PER_TILE
    first_token = tl.program_id(2) * TOKENS_PER_BLOCK

    qo_start = tl.load(qo_indptr + req)
    extend_len = tl.load(qo_indptr + req + 1) - qo_start
    kv_start = tl.load(kv_indptr + req)
    prefix_len = tl.load(kv_indptr + req + 1) - kv_start
    # The grid covers the longest request; programs past this request's tokens run no loop.
    is_live = first_token < extend_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tokens = first_token + offs_m // HEADS_PER_TILE
    if HEAD_BLOCKS == 1:
        head_in_group = offs_m % HEADS_PER_TILE
    else:
        head_in_group = first_head + offs_m % HEADS_PER_TILE
    heads = kv_head * GROUP_SIZE + head_in_group
    row_mask = (tokens < extend_len) & (head_in_group < GROUP_SIZE)
    dim_mask = offs_d < MAIN_DIM
    q_tile, q_rope = _load_query(q, (qo_start + tokens) * stride_q_tok + heads * stride_q_head,
                                 row_mask, offs_d, dim_mask, MAIN_DIM, ROPE_DIM, BLOCK_DPE)

    m_i, l_i, acc = _softmax_start(BLOCK_M, BLOCK_D)

    # Stage 1: the cached prefix, visible to every new token.
    m_i, l_i, acc = _attend_slot_range(
        q_tile, q_rope, m_i, l_i, acc, k_buffer, v_buffer, kv_indices + kv_start, 0,
        tl.where(is_live, prefix_len, 0), kv_head, stride_k_slot, stride_k_head, stride_v_slot,
        stride_v_head, offs_n, offs_d, dim_mask, sm_scale_log2, BLOCK_N, MAIN_DIM, ROPE_DIM,
        BLOCK_DPE, VALUES, DOT_PRECISION, FP8_CONVERT)

    # Stage 2: the new tokens themselves.
    if USE_CUSTOM_MASK:
        new_end = extend_len
    else:
        new_end = tl.minimum(extend_len, first_token + TOKENS_PER_BLOCK)  # causal: no later key
    m_i, l_i, acc = _attend_new_tokens(
        q_tile, q_rope, m_i, l_i, acc, k_buffer, v_buffer, new_token_slots + qo_start,
        custom_mask, req, tokens, row_mask, tl.where(is_live, new_end, 0), extend_len, kv_head,
        stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_mask_req,
        stride_mask_row, offs_n, offs_d, dim_mask, sm_scale_log2, BLOCK_N, USE_CUSTOM_MASK,
        MAIN_DIM, ROPE_DIM, BLOCK_DPE, VALUES, DOT_PRECISION, FP8_CONVERT)

    # Padded rows saw nothing (l = 0); they are not stored, the guard only avoids 0/0.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(out + (qo_start + tokens)[:, None] * stride_o_tok + heads[:, None] * stride_o_head
             + offs_d[None, :], (acc / l_i[:, None] * v_scale).to(out.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     out: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, new_token_slots: torch.Tensor,
                     max_extend_len: int, sm_scale: float,
                     custom_mask: Optional[torch.Tensor] = None,
                     config: Optional[ExtendConfig] = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Attention of the new tokens of each request over its prefix and its new tokens.

    Request b's new tokens are rows `qo_indptr[b]:qo_indptr[b+1]` of q/out and their K/V sit
    at `new_token_slots` (same rows) in the buffers; its prefix is the slot list
    `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`. New token j sees the whole prefix and new
    token k when k <= j, or when `custom_mask[b, j, k]` if a mask is given
    ([bs, >= max_extend_len, >= max_extend_len], bool or uint8). `max_extend_len` (host)
    must bound every request's number of new tokens. Shapes and `k_scale`, `v_scale` as in
    `decode_attention`.
    """
    num_tokens, num_heads, key_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    bs = qo_indptr.shape[0] - 1
    _check_qkv_out(q, k_buffer, v_buffer, out)
    layout = _head_layout(q, k_buffer, v_buffer)
    if num_tokens == 0 or bs == 0:
        return
    config = config or default_extend_config(key_dim, q.device, layout.main_dim)
    group_size = num_heads // num_kv_heads
    heads_per_tile, head_blocks = _head_tiling(group_size, config.block_m)
    # Short extends (verify, draft-extend) would leave most rows of a full tile empty; shrink
    # it to what the longest request needs. A row's keys and their order do not depend on the
    # tile height (a shorter causal loop only skips tiles the row cannot see).
    block_m = max(min(config.block_m, triton.next_power_of_2(max_extend_len * heads_per_tile)),
                  16, heads_per_tile)
    if custom_mask is not None:
        assert custom_mask.stride(-1) == 1
        if custom_mask.dtype == torch.bool:
            custom_mask = custom_mask.view(torch.uint8)  # same bytes; loads as 0/1
    grid = (bs, num_kv_heads * head_blocks,
            triton.cdiv(max_extend_len, block_m // heads_per_tile))
    _extend_attention_kernel[grid](
        q, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, new_token_slots,
        custom_mask if custom_mask is not None else qo_indptr,  # unused without a mask
        sm_scale * LOG2_E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        custom_mask.stride(0) if custom_mask is not None else 0,
        custom_mask.stride(1) if custom_mask is not None else 0,
        GROUP_SIZE=group_size, HEADS_PER_TILE=heads_per_tile, HEAD_BLOCKS=head_blocks,
        MAIN_DIM=layout.main_dim, ROPE_DIM=layout.rope_dim, BLOCK_D=layout.block_d,
        BLOCK_DPE=layout.block_dpe, VALUES=layout.values, BLOCK_M=block_m,
        BLOCK_N=config.block_n, USE_CUSTOM_MASK=custom_mask is not None,
        DOT_PRECISION=_dot_input_precision(q.dtype),
        # Long extends over an FP8 prefix keep Triton's conversion: "bits" is chosen (and
        # timed) for the split decode and short-extend loops only.
        FP8_CONVERT="cast",
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(q.device),
    )


# ---------------------------------------------------------------------------------------------
# Short extend (verify, draft-extend): split-KV over the prefix, merged by the last split
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=EXTEND_UNSPECIALIZED)
def _short_extend_kernel(
    q, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, new_token_slots, custom_mask,
    partial_out, partial_lse, arrivals, sm_scale_log2, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head, stride_mask_req, stride_mask_row, stride_po_tok,
    stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head,
    NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, TOKEN_BLOCKS: tl.constexpr, MAIN_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr,
    VALUES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr, MIN_KV_SPLIT_LEN: tl.constexpr, USE_CUSTOM_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8_CONVERT: tl.constexpr, PDL: tl.constexpr,
):
    # Row r of the tile is (new token first_token + r // HEADS_PER_TILE, query head
    # r % HEADS_PER_TILE of the program's slice of the group; the whole group unless it
    # exceeds a tile, as a large MLA group does): those tokens and heads share every K/V tile.
    # A request's tokens past one tile take the next token block (`short_extend_tiling`); a
    # block past a shorter request's tokens reads nothing. Split s covers its slice of the
    # prefix; split 0 also covers the new tokens. A request with one split writes its output
    # at once. Otherwise every split stores its partial result and counts its arrival; the
    # last to arrive merges them (no second kernel: at short contexts its launch would cost
    # more than the splits save).
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    wait_for_predecessor(PDL)
    release_dependents(PDL)
    req = tl.program_id(0)
    tile = tl.program_id(1)  # (KV head, head block, token block)
    kv_head = tile // (HEAD_BLOCKS * TOKEN_BLOCKS)
    if HEAD_BLOCKS > 1:
        first_head = (tile // TOKEN_BLOCKS) % HEAD_BLOCKS * HEADS_PER_TILE
    first_token = tile % TOKEN_BLOCKS * TOKENS_PER_TILE

    qo_start = tl.load(qo_indptr + req)
    extend_len = tl.load(qo_indptr + req + 1) - qo_start
    kv_start = tl.load(kv_indptr + req)
    prefix_len = tl.load(kv_indptr + req + 1) - kv_start
    split_len = _kv_split_len(prefix_len, MAX_KV_SPLITS, MIN_KV_SPLIT_LEN, BLOCK_N)
    num_splits = tl.maximum(tl.cdiv(prefix_len, split_len), 1)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tokens = first_token + offs_m // HEADS_PER_TILE
    if HEAD_BLOCKS == 1:
        head_in_group = offs_m % HEADS_PER_TILE
    else:
        head_in_group = first_head + offs_m % HEADS_PER_TILE
    heads = kv_head * GROUP_SIZE + head_in_group
    row_mask = (tokens < extend_len) & (head_in_group < GROUP_SIZE)
    dim_mask = offs_d < MAIN_DIM
    rows = qo_start + tokens
    tile_mask = row_mask[:, None] & dim_mask[None, :]
    q_tile, q_rope = _load_query(q, rows * stride_q_tok + heads * stride_q_head, row_mask,
                                 offs_d, dim_mask, MAIN_DIM, ROPE_DIM, BLOCK_DPE)
    if USE_CUSTOM_MASK:
        new_end = extend_len
    else:
        new_end = tl.minimum(extend_len, first_token + TOKENS_PER_TILE)  # causal: no later key

    # The grid's third dim may be smaller than the splits (`split_programs`): a program runs
    # splits program_id(2), + num_programs(2), ... one after the other, each as its own
    # program would (the same result, whichever program runs it). A token block past this
    # request's tokens (the grid covers the longest) runs none.
    for split in range(tl.program_id(2), tl.where(first_token < extend_len, num_splits, 0),
                       tl.num_programs(2)):
        split_begin = split * split_len
        m_i, l_i, acc = _softmax_start(BLOCK_M, BLOCK_D)
        m_i, l_i, acc = _attend_slot_range(
            q_tile, q_rope, m_i, l_i, acc, k_buffer, v_buffer, kv_indices + kv_start,
            split_begin, tl.minimum(split_begin + split_len, prefix_len), kv_head,
            stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, offs_n, offs_d,
            dim_mask, sm_scale_log2, BLOCK_N, MAIN_DIM, ROPE_DIM, BLOCK_DPE, VALUES,
            DOT_PRECISION, FP8_CONVERT)
        m_i, l_i, acc = _attend_new_tokens(
            q_tile, q_rope, m_i, l_i, acc, k_buffer, v_buffer, new_token_slots + qo_start,
            custom_mask, req, tokens, row_mask, tl.where(split == 0, new_end, 0), extend_len,
            kv_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
            stride_mask_req, stride_mask_row, offs_n, offs_d, dim_mask, sm_scale_log2, BLOCK_N,
            USE_CUSTOM_MASK, MAIN_DIM, ROPE_DIM, BLOCK_DPE, VALUES, DOT_PRECISION, FP8_CONVERT)
        _store_or_merge_splits(
            acc, m_i, l_i,
            out + rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
            partial_out + rows[:, None] * stride_po_tok + heads[:, None] * stride_po_head
            + offs_d[None, :],
            partial_lse + rows * stride_pl_tok + heads * stride_pl_head, tile_mask, row_mask,
            split, num_splits,
            arrivals + req * (NUM_KV_HEADS * HEAD_BLOCKS * TOKEN_BLOCKS) + tile,
            stride_po_split, v_scale, BLOCK_M, BLOCK_D)


class ShortExtendTiling(NamedTuple):
    """How `short_extend_attention` tiles a KV head's query rows: tiles of `block_m` rows, each
    `heads_per_tile` heads (the whole group where it fits) of `block_m // heads_per_tile` new
    tokens; `head_blocks` tiles across the group, `token_blocks` across the longest request's
    tokens (a shorter request's blocks past its tokens read nothing)."""

    heads_per_tile: int
    head_blocks: int
    block_m: int
    token_blocks: int

    @property
    def tiles_per_kv_head(self) -> int:
        return self.head_blocks * self.token_blocks


def short_extend_tiling(group_size: int, max_extend_len: int,
                        config: DecodeConfig) -> ShortExtendTiling:
    """A tile of at least `config.block_h` rows (16, and the longest request's tokens) holds
    the whole group where it fits, then as many tokens as fill it. Heads first: a verify row's
    4 tokens in a bucket sized for 64-token chunks (a mixed step's) then take one tile that
    reads the prefix once, where tiles of all 64 tokens and a slice of the group read it once
    per slice (H100, 8B, 60 chain rows and a 1-token chunk in the 256-token mixed graph: this
    kernel took 6.4 ms of the step's 14.0 ms of kernels, the step 2.8x its decode step)."""
    tokens_pad = triton.next_power_of_2(max_extend_len)
    rows = max(16, config.block_h, tokens_pad)
    heads_per_tile, head_blocks = _head_tiling(group_size, rows)
    tokens_per_tile = min(tokens_pad, rows // heads_per_tile)
    # tl.dot needs at least 16 rows on tensor cores; padded rows are masked out.
    block_m = max(16, tokens_per_tile * heads_per_tile)
    return ShortExtendTiling(heads_per_tile, head_blocks, block_m,
                             triton.cdiv(max_extend_len, block_m // heads_per_tile))


def short_extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                           out: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, new_token_slots: torch.Tensor,
                           max_extend_len: int, sm_scale: float, partial_out: torch.Tensor,
                           partial_lse: torch.Tensor, arrivals: torch.Tensor,
                           custom_mask: Optional[torch.Tensor] = None,
                           config: Optional[DecodeConfig] = None,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           split_programs: Optional[int] = None) -> None:
    """`extend_attention`'s result for short extends, split over the prefix like decode.

    The arguments are `extend_attention`'s, plus the split scratch of `decode_attention`
    with one row per new token: partial_out [>= num_tokens, num_heads, max_kv_splits,
    value_dim] and partial_lse [>= num_tokens, num_heads, max_kv_splits], fp32; and
    `arrivals`, int32 [>= bs * num_kv_heads * tiles per KV head (`short_extend_tiling`;
    at most the group size rounded up to a power of two)], all zero (the kernel leaves them
    zero). A request's splits depend on its own prefix length only (batch invariance, as in
    decode). `k_scale`, `v_scale` as in `decode_attention`. `split_programs`: the programs
    that run a tile's splits (default: `default_split_programs`'s); any number gives the same
    result.
    """
    num_tokens, num_heads, key_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    bs = qo_indptr.shape[0] - 1
    _check_qkv_out(q, k_buffer, v_buffer, out)
    layout = _head_layout(q, k_buffer, v_buffer)
    assert partial_out.dtype == partial_lse.dtype == torch.float32
    assert partial_out.shape[0] >= num_tokens and partial_out.shape[1:3] == partial_lse.shape[1:]
    config = _checked(config or default_decode_config(key_dim, q.device, layout.main_dim,
                                                      k_buffer.dtype))
    group_size = num_heads // num_kv_heads
    tiling = short_extend_tiling(group_size, max_extend_len, config)
    assert (arrivals.dtype == torch.int32
            and arrivals.numel() >= bs * num_kv_heads * tiling.tiles_per_kv_head)
    if num_tokens == 0 or bs == 0:
        return
    if custom_mask is not None:
        assert custom_mask.stride(-1) == 1
        if custom_mask.dtype == torch.bool:
            custom_mask = custom_mask.view(torch.uint8)  # same bytes; loads as 0/1
    max_kv_splits = partial_out.shape[2]
    tiles = bs * num_kv_heads * tiling.tiles_per_kv_head
    split_programs = split_programs or default_split_programs(tiles, max_kv_splits, q.device)
    _short_extend_kernel[(bs, num_kv_heads * tiling.tiles_per_kv_head, split_programs)](
        q, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, new_token_slots,
        custom_mask if custom_mask is not None else qo_indptr,  # unused without a mask
        partial_out, partial_lse, arrivals, sm_scale * LOG2_E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        custom_mask.stride(0) if custom_mask is not None else 0,
        custom_mask.stride(1) if custom_mask is not None else 0,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP_SIZE=group_size, HEADS_PER_TILE=tiling.heads_per_tile,
        HEAD_BLOCKS=tiling.head_blocks, TOKEN_BLOCKS=tiling.token_blocks,
        MAIN_DIM=layout.main_dim, ROPE_DIM=layout.rope_dim, BLOCK_D=layout.block_d,
        BLOCK_DPE=layout.block_dpe, VALUES=layout.values, BLOCK_M=tiling.block_m,
        BLOCK_N=config.block_n, MAX_KV_SPLITS=max_kv_splits,
        MIN_KV_SPLIT_LEN=config.min_kv_split_len, USE_CUSTOM_MASK=custom_mask is not None,
        DOT_PRECISION=_dot_input_precision(q.dtype), FP8_CONVERT=config.fp8_convert,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(q.device),
    )
