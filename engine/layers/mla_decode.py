"""MLA's decode-sized forwards (at most `MAX_ROWS` tokens: decode and verify steps) in few
Triton kernels (CUDA; the interpreter runs them in tests).

`MLAAttention`'s torch form (engine/models/deepseek.py) runs, between the projections and the
attention, about a dozen small launches a layer: the latent's copy out of the kv_a output and
its RMSNorm, torch.cat's interleave-to-halves reorder of q_pe and k_pe, the RoPE kernel, two
indexed stores into the pool, cuBLAS's batched q_nope x W_UK, a cat of that with q_pe, then
cuBLAS's batched W_UV product and a transpose copy for o_proj. Each costs a few microseconds
of a bs=1 step whose weights take ~150 us a layer to read. Here two launches do that work:

- `absorb_query` (the layer's first launch after the projections), two kinds of programs:
  - a program per head and column tile of q_nope x W_UK, the absorbed query's latent part;
  - a program a token: RMSNorm of the latent, RoPE of the rope key, both stored in the
    token's pool slot (quantised for an FP8 pool, as `set_mla_kv` stores them), and RoPE of
    every head's q_pe into the rope part of the absorbed query [T, H, latent + rope].
    Interleaved rope dims (the checkpoint's (x0, x1), (x2, x3) pairs) are read in place as
    the halves the neox rotation takes: no reorder copy;
  Both read the same q and write disjoint parts of the absorbed query: one launch instead of
  two in a chain.
- `head_matmul` (a program per head and column tile): out[t, h] = x[t, h] W[h]^T for every
  head's own small matrix, reading each head's matrix once for all the tokens: o_proj's input
  [T, H * v] straight from the attention output (x W_UV^T).

The roundings are the torch path's: the RMSNorm of `RMSNorm.forward`, the RoPE of
`_rope_kernel` (products and sums rounded to the activation dtype), one rounding of each fp32
matmul sum.
"""
from __future__ import annotations

import torch

from specserve.engine.sm_count import num_sms
from specserve.engine.kvcache.fp8 import is_fp8
from specserve.engine.layers.skinny_gemm import MAX_ROWS

try:
    import triton
    import triton.language as tl

    from specserve.engine.layers.fused import store_kv
    from specserve.engine.pdl import launch_options, release_dependents, wait_for_predecessor
except ImportError:  # the CPU build needs no Triton
    triton = None


def can_fuse(x: torch.Tensor) -> bool:
    """Whether a forward of the hidden states x [T, hidden] runs the fused MLA kernels: CUDA
    with Triton, and a decode-sized T."""
    return triton is not None and x.is_cuda and 1 <= x.shape[0] <= MAX_ROWS


if triton is not None:
    @triton.jit
    def _rope_halves(src, d, mask, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
        """The two halves the neox rotation takes from rope dims at `src` (fp32): dims
        (0..HALF, HALF..2 HALF), or with INTERLEAVE the even and the odd dims."""
        if INTERLEAVE:
            x1 = tl.load(src + 2 * d, mask=mask, other=0.0)
            x2 = tl.load(src + 2 * d + 1, mask=mask, other=0.0)
        else:
            x1 = tl.load(src + d, mask=mask, other=0.0)
            x2 = tl.load(src + HALF + d, mask=mask, other=0.0)
        return x1.to(tl.float32), x2.to(tl.float32)

    @triton.jit
    def _rotate(x1, x2, cos1, cos2, sin1, sin2, like):
        # torch rounds each product and the sum to the activation dtype (`like`'s element
        # type), as `_rope_kernel` does.
        dtype = like.dtype.element_ty
        o1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
        o2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
        return o1.to(dtype), o2.to(dtype)

    @triton.jit
    def _rope_norm_store_token(
        token, q, kv, q_out, pool, loc, positions, cos, sin, norm_weight, eps, scale_inv,
        num_heads, stride_q_tok, stride_q_head, stride_kv_tok, stride_qo_tok, stride_qo_head,
        stride_pool_slot,
        LATENT: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
        INTERLEAVE: tl.constexpr, BLOCK_LATENT: tl.constexpr, BLOCK_H: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        """Token `token`'s latent norm, rope key (both into its pool slot) and rotated q_pe."""
        token = token.to(tl.int64)
        dtype = q_out.dtype.element_ty
        pos = tl.load(positions + token).to(tl.int64)
        slot = tl.load(loc + token).to(tl.int64)
        d = tl.arange(0, HALF)
        # torch casts the fp32 cos/sin table to the activation dtype first.
        cos1 = tl.load(cos + pos * 2 * HALF + d).to(dtype).to(tl.float32)
        cos2 = tl.load(cos + pos * 2 * HALF + HALF + d).to(dtype).to(tl.float32)
        sin1 = tl.load(sin + pos * 2 * HALF + d).to(dtype).to(tl.float32)
        sin2 = tl.load(sin + pos * 2 * HALF + HALF + d).to(dtype).to(tl.float32)
        row = pool + slot * stride_pool_slot

        # The latent's RMSNorm (RMSNorm.forward: fp32 statistics, the normed value rounded to
        # the activation dtype, then times the weight in that dtype).
        cols = tl.arange(0, BLOCK_LATENT)
        cmask = cols < LATENT
        h = tl.load(kv + token * stride_kv_tok + cols, mask=cmask, other=0.0).to(tl.float32)
        normed = (h * tl.math.rsqrt(tl.sum(h * h, 0) / LATENT + eps)).to(dtype).to(tl.float32)
        w = tl.load(norm_weight + cols, mask=cmask, other=0.0).to(tl.float32)
        store_kv(row + cols, (w * normed).to(dtype), cmask, scale_inv, KV_FP8)

        # The rope key, rotated into the slot after the latent.
        k1, k2 = _rope_halves(kv + token * stride_kv_tok + LATENT, d, d < HALF, HALF, INTERLEAVE)
        o1, o2 = _rotate(k1, k2, cos1, cos2, sin1, sin2, q_out)
        store_kv(row + LATENT + d, o1, d < HALF, scale_inv, KV_FP8)
        store_kv(row + LATENT + HALF + d, o2, d < HALF, scale_inv, KV_FP8)

        # Every head's q_pe, rotated into the absorbed query after its latent part.
        heads = tl.arange(0, BLOCK_H)[:, None]
        hmask = (heads < num_heads) & (d[None, :] < HALF)
        q1, q2 = _rope_halves(q + token * stride_q_tok + heads * stride_q_head + NOPE, d[None, :],
                              hmask, HALF, INTERLEAVE)
        o1, o2 = _rotate(q1, q2, cos1[None, :], cos2[None, :], sin1[None, :], sin2[None, :], q_out)
        dst = q_out + token * stride_qo_tok + heads * stride_qo_head + LATENT + d[None, :]
        tl.store(dst, o1, mask=hmask)
        tl.store(dst + HALF, o2, mask=hmask)

    @triton.jit
    def _head_tile(
        head, tile, x, w, y, M, N, K, stride_xm, stride_xh, stride_wh, stride_wn, stride_wk,
        stride_ym, stride_yh,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # y[m, h, n] = sum_k x[m, h, k] w[h, n, k]: head h's matrix, one column tile, every
        # token's row in one tl.dot (rows padded to 16, masked).
        head = head.to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        x_ptrs = x + head * stride_xh + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w + head * stride_wh + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k
            x_tile = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_tile = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(x_tile, w_tile, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        tl.store(y + head * stride_yh + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _head_matmul_kernel(
        x, w, y, M, N, K, stride_xm, stride_xh, stride_wh, stride_wn, stride_wk, stride_ym,
        stride_yh,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_for_predecessor(PDL)
        release_dependents(PDL)
        _head_tile(tl.program_id(0), tl.program_id(1), x, w, y, M, N, K, stride_xm, stride_xh,
                   stride_wh, stride_wn, stride_wk, stride_ym, stride_yh, BLOCK_M, BLOCK_N,
                   BLOCK_K, DOT_PRECISION)

    @triton.jit
    def _absorb_query_kernel(
        q, kv, q_out, pool, loc, positions, cos, sin, norm_weight, eps, scale_inv, w_uk,
        num_tokens, num_heads, n_tiles, stride_q_tok, stride_q_head, stride_kv_tok,
        stride_qo_tok, stride_qo_head, stride_pool_slot, stride_wh, stride_wn, stride_wk,
        LATENT: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
        INTERLEAVE: tl.constexpr, BLOCK_LATENT: tl.constexpr, BLOCK_H: tl.constexpr,
        KV_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):
        # Programs [0, heads x tiles): q_nope x W_UK tiles; then one a token: norm, RoPEs and
        # the pool store (disjoint outputs, the same input).
        wait_for_predecessor(PDL)
        release_dependents(PDL)
        pid = tl.program_id(0)
        matmul_programs = num_heads * n_tiles
        if pid < matmul_programs:
            _head_tile(pid // n_tiles, pid % n_tiles, q, w_uk, q_out, num_tokens, LATENT, NOPE,
                       stride_q_tok, stride_q_head, stride_wh, stride_wn, stride_wk,
                       stride_qo_tok, stride_qo_head, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        else:
            _rope_norm_store_token(
                pid - matmul_programs, q, kv, q_out, pool, loc, positions, cos, sin,
                norm_weight, eps, scale_inv, num_heads, stride_q_tok, stride_q_head,
                stride_kv_tok, stride_qo_tok, stride_qo_head, stride_pool_slot, LATENT, NOPE,
                HALF, INTERLEAVE, BLOCK_LATENT, BLOCK_H, KV_FP8)


def absorb_query(q: torch.Tensor, kv: torch.Tensor, w_uk: torch.Tensor, q_abs: torch.Tensor,
                 pool: torch.Tensor, loc: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 interleave: bool, kv_scale: float = 1.0) -> None:
    """The absorbed query and the new tokens' pool rows, in one launch. From q [T, H, nope +
    rope] (the q projection's heads), kv [T, latent + rope] (the kv_a projection) and W_UK
    [H, nope, latent] (a view of kv_b's weight):

    - q_abs [T, H, latent + rope]: q_nope x W_UK, then every head's rotated q_pe;
    - `pool[loc[t], 0]` ([slots, 1, latent + rope]): RMSNorm(latent) (weight `norm_weight`)
      and the rotated rope key (an FP8 pool stores them quantised with `kv_scale`).

    `cos`/`sin`: the fp32 [positions, rope] tables. `interleave`: the rope dims are (x0, x1)
    pairs (rotated as the halves of even and odd dims)."""
    num_tokens, num_heads, qk_dim = q.shape
    nope_dim, latent = w_uk.shape[1:]
    rope = qk_dim - nope_dim
    assert latent == norm_weight.shape[0] and w_uk.shape[0] == num_heads
    assert kv.shape == (num_tokens, latent + rope) and q_abs.shape == (num_tokens, num_heads, latent + rope)
    assert pool.is_contiguous() and pool.shape[1:] == (1, latent + rope)
    assert q.stride(2) == kv.stride(1) == q_abs.stride(2) == 1 and rope % 2 == 0
    assert (rope // 2) & (rope // 2 - 1) == 0, "half the rope dims: a power of two"
    assert 1 <= num_tokens <= MAX_ROWS, f"absorb_query: {num_tokens} rows (1..{MAX_ROWS})"
    assert q.dtype == w_uk.dtype == q_abs.dtype
    block_n = _column_tile(num_heads, latent, q.device)
    n_tiles = triton.cdiv(latent, block_n)
    _absorb_query_kernel[(num_heads * n_tiles + num_tokens,)](
        q, kv, q_abs, pool, loc, positions, cos, sin, norm_weight, eps, 1.0 / kv_scale, w_uk,
        num_tokens, num_heads, n_tiles, q.stride(0), q.stride(1), kv.stride(0), q_abs.stride(0),
        q_abs.stride(1), pool.stride(0), w_uk.stride(0), w_uk.stride(2), w_uk.stride(1),
        LATENT=latent, NOPE=nope_dim, HALF=rope // 2, INTERLEAVE=interleave,
        BLOCK_LATENT=triton.next_power_of_2(latent), BLOCK_H=triton.next_power_of_2(num_heads),
        KV_FP8=is_fp8(pool.dtype), BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=min(128, max(16, triton.next_power_of_2(nope_dim))),
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=4, num_stages=3,
        **launch_options(q.device))


def _column_tile(num_heads: int, n: int, device: torch.device) -> int:
    # 32 columns a program, 16 where that leaves SMs idle (W_UV's 128 columns x 16 heads):
    # at decode every program is a stream of its head's weight rows.
    return 32 if num_heads * triton.cdiv(n, 32) >= num_sms(device) else 16


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, h] = x[t, h] @ w[h]^T for x [T, H, K], w [H, N, K] and out [T, H, N] (views with
    any strides but a contiguous last dim of x and out; T <= MAX_ROWS): each head's matrix is
    read once for all T tokens."""
    num_tokens, num_heads, k = x.shape
    n = w.shape[1]
    assert w.shape == (num_heads, n, k) and out.shape == (num_tokens, num_heads, n)
    assert x.stride(2) == out.stride(2) == 1 and x.dtype == w.dtype == out.dtype
    assert 1 <= num_tokens <= MAX_ROWS, f"head_matmul: {num_tokens} rows (1..{MAX_ROWS})"
    block_n = _column_tile(num_heads, n, x.device)
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    _head_matmul_kernel[(num_heads, triton.cdiv(n, block_n))](
        x, w, out, num_tokens, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        w.stride(2), out.stride(0), out.stride(1), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=4, num_stages=3,
        **launch_options(x.device))
