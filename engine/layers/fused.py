"""Fused Triton kernels for the elementwise parts of a decoder layer (CUDA).

At batch size 1 a decode step is bandwidth-bound GEMVs plus hundreds of tiny elementwise
kernels; each of those costs a few microseconds even inside a CUDA graph, which measured as
~45% of an 8B step on an H200 before fusion. Each kernel here replaces 5-12 of them and
reproduces the torch path's roundings (sums and products rounded to the activation dtype
where torch rounds), so results match the unfused layers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.engine.kvcache.fp8 import is_fp8
from specserve.engine.pdl import (
    launch_options, release_dependents, wait_after_early_reads, wait_for_predecessor,
    wait_unless_early_reads)


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight is no kernel's output: read before the wait, its latency (a DRAM read: the
    # step's weights stream through the L2) overlaps the predecessor's tail (engine/pdl.py).
    wait_unless_early_reads(PDL)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_after_early_reads(PDL)
    release_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)  # torch adds in the activation dtype
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    normed = (h * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual, weight: torch.Tensor, eps: float):
    """RMSNorm(x + residual) and x + residual (or RMSNorm(x) when residual is None). x's rows
    may be strided (a view of a fused projection's columns: MLA's q LoRA); the results are
    contiguous."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    res_in = residual.reshape(-1, shape[-1]).contiguous() if residual is not None else x2
    if x2.shape[0]:
        _add_rmsnorm_kernel[(x2.shape[0],)](
            x2, res_in, weight, out, res_out, shape[-1], x2.stride(0), eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(shape[-1]), num_warps=4 if shape[-1] <= 2048 else 8,
            **launch_options(x.device))
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def store_kv(ptr, x, mask, scale_inv, KV_FP8: tl.constexpr):
    """Store `x` (the model's k or v, in the activation dtype) into the KV pool at `ptr` as
    the pool's `set_kv` would: as is, or for an FP8 pool times 1/scale (`scale_inv`), clamped
    to e4m3's +-448 and rounded to nearest even (engine/kvcache/fp8.py's `quantize`)."""
    if KV_FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * scale_inv, -448.0), 448.0)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_heads(src, dst, n_heads, cos1, cos2, sin1, sin2, scale_inv, HALF: tl.constexpr,
                BLOCK_H: tl.constexpr, KV_FP8: tl.constexpr):
    """Rotate the heads of one token: src and dst point at its first head (heads contiguous).
    With KV_FP8, dst is an FP8 pool's row, written through `store_kv`."""
    d = tl.arange(0, HALF)
    heads = tl.arange(0, BLOCK_H)
    dtype = src.dtype.element_ty
    hmask = heads[:, None] < n_heads
    base = src + heads[:, None] * (2 * HALF)
    x1 = tl.load(base + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    # torch rounds each product and the sum to the activation dtype.
    o1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    o2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    out = dst + heads[:, None] * (2 * HALF)
    store_kv(out + d[None, :], o1.to(dtype), hmask, scale_inv, KV_FP8)
    store_kv(out + HALF + d[None, :], o2.to(dtype), hmask, scale_inv, KV_FP8)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, loc_ptr, pos_ptr,
                 cos_ptr, sin_ptr, q_stride, k_stride, v_stride, num_q_heads, num_k_heads,
                 k_scale_inv, v_scale_inv, STORE_KV: tl.constexpr, KV_FP8: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF)
    dtype = q_out_ptr.dtype.element_ty
    # torch casts the fp32 cos/sin table to the activation dtype first.
    cos1 = tl.load(cos_ptr + pos * 2 * HALF + d).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + d).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * 2 * HALF + d).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + d).to(dtype).to(tl.float32)
    kv_row = num_k_heads * 2 * HALF
    # With STORE_KV the rotated k and the v go straight to the token's KV slot, which saves
    # the two indexed copies per layer that storing them afterwards costs.
    if STORE_KV:
        k_row = tl.load(loc_ptr + token).to(tl.int64)
    else:
        k_row = token
    _rope_heads(q_ptr + token * q_stride, q_out_ptr + token * num_q_heads * 2 * HALF, num_q_heads,
                cos1[None, :], cos2[None, :], sin1[None, :], sin2[None, :], 1.0, HALF, BLOCK_H,
                False)
    _rope_heads(k_ptr + token * k_stride, k_out_ptr + k_row * kv_row, num_k_heads,
                cos1[None, :], cos2[None, :], sin1[None, :], sin2[None, :], k_scale_inv, HALF,
                BLOCK_H, KV_FP8)
    if STORE_KV:
        cols = tl.arange(0, BLOCK_H * 2 * HALF)
        v = tl.load(v_ptr + token * v_stride + cols, mask=cols < kv_row, other=0.0)
        store_kv(v_out_ptr + k_row * kv_row + cols, v, cols < kv_row, v_scale_inv, KV_FP8)


def _check_heads(*xs: torch.Tensor) -> None:
    dim = xs[0].shape[2]
    assert all(x.stride(2) == 1 and x.stride(1) == dim for x in xs), "heads must be contiguous"


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox RoPE of q [T, Hq, D] and k [T, Hk, D] (rows may be strided views of a fused qkv)."""
    T, hq, dim = q.shape
    hk = k.shape[1]
    q_out = torch.empty((T, hq, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, hk, dim), dtype=k.dtype, device=k.device)
    _check_heads(q, k)
    if T:
        _rope_kernel[(T,)](q, k, k, q_out, k_out, k_out, positions, positions, cos, sin,
                           q.stride(0), k.stride(0), 0, hq, hk, 1.0, 1.0, STORE_KV=False,
                           KV_FP8=False,
                           HALF=dim // 2, BLOCK_H=triton.next_power_of_2(max(hq, hk)), num_warps=4,
                           **launch_options(q.device))
    return q_out, k_out


def rope_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, loc: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """`rope`, with the rotated k and the v written to `k_cache[loc]` and `v_cache[loc]`
    ([slots, Hk, D] each) instead of returned. Returns the rotated q. An FP8 cache stores
    them quantised with its layer's `k_scale` and `v_scale` (engine/kvcache/fp8.py)."""
    T, hq, dim = q.shape
    hk = k.shape[1]
    q_out = torch.empty((T, hq, dim), dtype=q.dtype, device=q.device)
    _check_heads(q, k, v)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1:] == k.shape[1:]
    if T:
        _rope_kernel[(T,)](q, k, v, q_out, k_cache, v_cache, loc, positions, cos, sin,
                           q.stride(0), k.stride(0), v.stride(0), hq, hk, 1.0 / k_scale,
                           1.0 / v_scale, STORE_KV=True, KV_FP8=is_fp8(k_cache.dtype),
                           HALF=dim // 2, BLOCK_H=triton.next_power_of_2(max(hq, hk)), num_warps=4,
                           **launch_options(q.device))
    return q_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * n)
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4,
                                                            **launch_options(gate_up.device))
    return out
