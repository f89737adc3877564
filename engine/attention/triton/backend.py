"""TritonAttnBackend: paged attention with metadata built on the device from upper bounds."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
import triton

from specserve.engine.attention.base import AttentionBackend
from specserve.engine.attention.triton.kernels import (
    DecodeConfig, ExtendConfig, decode_attention, default_decode_config, default_extend_config,
    extend_attention, fill_kv_indices, short_extend_attention)

# Extends of at most this many new tokens per request run split over the prefix (verify,
# draft-extend, a cached prompt's tail, short prefill chunks), the group's heads sliced over
# programs where tokens x heads exceed a tile: unsplit, one request's 32 new tokens over a
# 4k-token prefix ran one program per query head, 32 programs walking the whole prefix
# (6.6 of a 12.7 ms step on an H100). Longer extends have query rows enough to fill the GPU.
SPLIT_EXTEND_MAX_TOKENS = 64

if TYPE_CHECKING:
    from specserve.engine.forward_batch import ForwardBatch


class TritonAttnMetadata(NamedTuple):
    """What `forward` needs, built once per ForwardBatch and shared by every layer."""

    is_decode: bool                     # one new token per request and no custom mask
    split_extend: bool                  # a short extend, split over the prefix
    kv_indptr: torch.Tensor             # [bs+1] offsets into kv_indices
    kv_indices: torch.Tensor            # decode: prefix + new slot; extend: prefix only
    qo_indptr: Optional[torch.Tensor]   # [bs+1] offsets of each request's new tokens (extend)
    max_extend_len: int
    custom_mask: Optional[torch.Tensor]  # [bs, max_extend, max_extend] (tree verify)
    partial_out: Optional[torch.Tensor]  # split-KV scratch, a row per query token (decode or
    partial_lse: Optional[torch.Tensor]  # split extend)
    arrivals: Optional[torch.Tensor]     # decode or split extend: per (request, KV head[, head
                                         # slice]) split counters, zero between forwards


class TritonAttnBackend(AttentionBackend):
    """Decode and short extends (split-KV), and long extends (prefix + causal/custom-masked
    new tokens), in Triton kernels.

    `init_forward_metadata` reads no device value on the host: `kv_indptr` is a device cumsum
    of `prefix_lens`, `kv_indices` is sized by `batch_size * max_seq_len`, and the only host
    inputs are `extend_lens_cpu` and `max_seq_len`. Given `fb.extend_lens` (a captured
    extend), `qo_indptr` is their device cumsum and `extend_lens_cpu` only bounds them: the
    grids, sized by the bounds, are the same at every replay. Prefix slots come from the requests'
    `kv_rows`; the new tokens' slots always come from `out_cache_loc`. The index and split-KV
    scratch buffers are preallocated for up to `max_batch_size` requests of up to
    `max_context_len` tokens, with up to `max_query_len` new tokens each in a split extend
    (the verify width), so those forwards always reuse the same addresses (what CUDA-graph
    replay will need); larger forwards allocate their own.

    `v_head_dim` (default `head_dim`) narrower than `head_dim` is MLA in its absorbed form:
    one KV head whose key is latent || rope and whose value is the latent, i.e. the pool's
    `v_buffer[layer]` is a view of the first `v_head_dim` dims of `k_buffer[layer]`; the
    caller has stored both, so `forward` gets k = v = None. The output is [T, H * v_head_dim].
    The split-KV scratch is `max_batch_size * max_query_len * num_heads * max_kv_splits *
    v_head_dim` fp32: 4 MiB a row at 128 MLA heads, 16 splits and a 512 latent, so size
    `max_batch_size` (and `max_kv_splits`) for MLA with care.

    `kv_dtype` (default: the model's) is the pool's storage dtype: an FP8 pool gets decode
    launch parameters of its own (`default_decode_config`), whose `max_kv_splits` sizes the
    split scratch.
    """

    needs_cpu_seq_lens = False
    supports_cuda_graphs = True
    supports_device_extend_lens = True
    supports_mixed_forward = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_context_len: int,
                 device: torch.device, *, max_batch_size: int = 128,
                 max_kv_splits: Optional[int] = None,
                 max_query_len: int = 1, decode_config: Optional[DecodeConfig] = None,
                 extend_config: Optional[ExtendConfig] = None, needs_cpu_seq_lens: bool = False,
                 v_head_dim: Optional[int] = None, kv_dtype: Optional[torch.dtype] = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        # The kernels never read host lengths; True only makes the engine produce them.
        self.needs_cpu_seq_lens = needs_cpu_seq_lens
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if not 0 < self.v_head_dim <= head_dim:
            raise ValueError(f"v_head_dim {self.v_head_dim} must be in (0, head_dim {head_dim}]")
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.decode_config = decode_config or default_decode_config(head_dim, self.device,
                                                                    self.v_head_dim, kv_dtype)
        # A sequence gets min(cdiv(length, min_kv_split_len), max_kv_splits) splits and none is
        # longer than max_context_len: splits past cdiv(max_context_len, min_kv_split_len)
        # would only be grid programs that exit at once (and scratch never written).
        reachable = triton.cdiv(max_context_len, self.decode_config.min_kv_split_len)
        self.max_kv_splits = max_kv_splits or min(self.decode_config.max_kv_splits, reachable)
        self.extend_config = extend_config or default_extend_config(head_dim, self.device,
                                                                    self.v_head_dim)

        self._kv_indptr_buf = torch.zeros(max_batch_size + 1, dtype=torch.int64,
                                          device=self.device)
        self._qo_indptr_buf = torch.zeros(max_batch_size + 1, dtype=torch.int64,
                                          device=self.device)
        # int32 halves the index traffic of the attention loops; slot ids stay far below 2**31.
        self._kv_indices_buf = torch.empty(max_batch_size * max_context_len, dtype=torch.int32,
                                           device=self.device)
        self._partial_out_buf, self._partial_lse_buf = self._alloc_split_kv_scratch(
            max_batch_size * max_query_len)
        # A split forward (decode or short extend) has one counter per (request, KV head,
        # slice of the group's heads), at most a slice per head.
        self._arrivals_per_req = num_kv_heads * triton.next_power_of_2(num_heads // num_kv_heads)
        self._arrivals_buf = torch.zeros(max_batch_size * self._arrivals_per_req,
                                         dtype=torch.int32, device=self.device)

    def _alloc_split_kv_scratch(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_tokens, self.num_heads, self.max_kv_splits)
        return (torch.empty(*shape, self.v_head_dim, dtype=torch.float32, device=self.device),
                torch.empty(shape, dtype=torch.float32, device=self.device))

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        bs = fb.batch_size
        extend_lens = fb.extend_lens_cpu
        max_extend_len = fb.max_extend_len
        device_lens = fb.extend_lens is not None  # extend_lens_cpu: bounds
        if not device_lens and fb.num_tokens != sum(extend_lens):
            raise ValueError(f"{fb.num_tokens} tokens but extend_lens_cpu sums to "
                             f"{sum(extend_lens)}")
        if fb.max_seq_len < max_extend_len:
            raise ValueError(f"max_seq_len {fb.max_seq_len} is not a bound on prefix + extend "
                             f"(max_extend_len {max_extend_len}); was it set?")
        is_decode = not device_lens and fb.custom_mask is None and all(n == 1 for n in extend_lens)
        fits_buffers = bs <= self.max_batch_size and fb.max_seq_len <= self.max_context_len

        # Every request's list (prefix, plus the new token for decode) is at most max_seq_len.
        kv_indices_bound = bs * fb.max_seq_len
        if fits_buffers:
            kv_indptr = self._kv_indptr_buf[:bs + 1]
            kv_indices = self._kv_indices_buf[:kv_indices_bound]
        else:
            kv_indptr = torch.empty(bs + 1, dtype=torch.int64, device=self.device)
            kv_indices = torch.empty(kv_indices_bound, dtype=torch.int32, device=self.device)
        fill_kv_indices(fb.kv_rows.table, fb.kv_rows.rows, fb.prefix_lens, kv_indptr, kv_indices,
                        decode_token_slots=fb.out_cache_loc if is_decode else None)

        split_extend = not is_decode and max_extend_len <= SPLIT_EXTEND_MAX_TOKENS
        qo_indptr = partial_out = partial_lse = arrivals = None
        if is_decode or split_extend:
            num_rows = fb.num_tokens
            if num_rows <= self._partial_out_buf.shape[0]:
                partial_out = self._partial_out_buf[:num_rows]
                partial_lse = self._partial_lse_buf[:num_rows]
            else:
                partial_out, partial_lse = self._alloc_split_kv_scratch(num_rows)
        if is_decode or split_extend:  # the kernels leave the counters at zero for the next forward
            arrivals = (self._arrivals_buf if bs <= self.max_batch_size else
                        torch.zeros(bs * self._arrivals_per_req, dtype=torch.int32,
                                    device=self.device))
        if not is_decode:
            qo_indptr = (self._qo_indptr_buf[:bs + 1] if bs <= self.max_batch_size
                         else torch.empty(bs + 1, dtype=torch.int64, device=self.device))
            if device_lens:
                qo_indptr[:1].zero_()
                torch.cumsum(fb.extend_lens, 0, out=qo_indptr[1:])
            else:
                self._copy_offsets_to_device(extend_lens, qo_indptr)

        fb.attn_metadata = TritonAttnMetadata(
            is_decode=is_decode, split_extend=split_extend, kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            qo_indptr=qo_indptr, max_extend_len=max_extend_len, custom_mask=fb.custom_mask,
            partial_out=partial_out, partial_lse=partial_lse, arrivals=arrivals)

    def _copy_offsets_to_device(self, lengths: list[int], out: torch.Tensor) -> None:
        """out = [0, cumsum(lengths)...]. Uniform widths (verify, draft-extend) are an arange
        on the device, which a CUDA graph can capture; ragged ones (prefill) are one H2D copy,
        asynchronous from pinned memory."""
        if len(set(lengths)) == 1:
            torch.arange(0, (len(lengths) + 1) * lengths[0], lengths[0], out=out)
            return
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=out.dtype,
                               pin_memory=self.device.type == "cuda")
        out.copy_(offsets, non_blocking=True)

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                layer_id: int, fb: "ForwardBatch", scale: float) -> torch.Tensor:
        metadata: TritonAttnMetadata = fb.attn_metadata
        num_tokens = q.shape[0]
        assert q.shape[1:] == (self.num_heads, self.head_dim), q.shape
        if k is not None:
            fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        k_buffer = fb.kv_pool.k_buffer[layer_id]
        v_buffer = fb.kv_pool.v_buffer[layer_id]
        # An FP8 pool's scales (1.0 otherwise): host floats, so graphs capture them as is.
        scales = dict(k_scale=fb.kv_pool.scales.k[layer_id], v_scale=fb.kv_pool.scales.v[layer_id])
        out = q.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        if metadata.is_decode:
            decode_attention(q, k_buffer, v_buffer, out, metadata.kv_indptr, metadata.kv_indices,
                             metadata.partial_out, metadata.partial_lse, metadata.arrivals,
                             scale, self.decode_config, **scales)
        elif metadata.split_extend:
            short_extend_attention(q, k_buffer, v_buffer, out, metadata.qo_indptr,
                                   metadata.kv_indptr, metadata.kv_indices, fb.out_cache_loc,
                                   metadata.max_extend_len, scale, metadata.partial_out,
                                   metadata.partial_lse, metadata.arrivals,
                                   custom_mask=metadata.custom_mask, config=self.decode_config,
                                   **scales)
        else:
            extend_attention(q, k_buffer, v_buffer, out, metadata.qo_indptr, metadata.kv_indptr,
                             metadata.kv_indices, fb.out_cache_loc, metadata.max_extend_len,
                             scale, custom_mask=metadata.custom_mask, config=self.extend_config,
                             **scales)
        return out.view(num_tokens, self.num_heads * self.v_head_dim)
