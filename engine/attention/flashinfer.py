"""FlashInferAttnBackend: FlashInfer 0.5.3 paged attention over the page-size-1 KV pool.

`forward` stores the new tokens' K/V first, so every request's keys are in the pool when
attention runs: request b's KV list is its prefix slots (from `fb.kv_rows`) followed by its
new tokens' slots
(`out_cache_loc`), and one FlashInfer call covers prefix and new tokens. Each pool slot is
one FlashInfer page of size 1 (NHD layout).

- DECODE with exact host lengths: `BatchDecodeWithPagedKVCacheWrapper` (split-KV decode).
- Everything else (prefill, draft-extend, target-verify with the packed tree mask, decode
  without host lengths): `BatchPrefillWithPagedKVCacheWrapper` (FA2), causal or masked.

Host lengths. FlashInfer's `plan()` builds the tile schedule on the host from host arrays,
while the kernels read the real lengths from the device `kv_indptr` (FlashInfer 0.5.3,
include/flashinfer/attention/{scheduler,prefill,decode}.cuh). A plan whose lengths differ
from the device ones is only safe when it does not split the KV: with split-KV, the plan
fixes each request's number of KV chunks from the host lengths; the prefill kernel then
writes its partial outputs with a stride computed from the device length while the merge
reads them through the planned `merge_indptr`, and the decode kernel does not clamp a
chunk's start to the real length (the chunk size underflows). With `disable_split_kv=True`
the FA2 prefill plan has one KV chunk per request, `kv_chunk_size` goes unused, and the tiles
depend only on the query lengths, which the host always knows (`extend_lens_cpu`). Hence:

- synced (`sync_free=False`, `needs_cpu_seq_lens=True`): with `fb.seq_lens_cpu` the plan
  sees the exact lengths and may split the KV; forwards without host lengths (tree-draft
  steps always come without them) take the sync-free plan below.
- sync-free (`sync_free=True`, `needs_cpu_seq_lens=False`): the plan sees every request at
  the host bound `max_seq_len`, split-KV disabled; the kernels get the real device
  `kv_indptr`, tree masks are packed on the device at the real lengths. Exact; what it
  gives up is split-KV parallelism (long contexts at small batch run on fewer CTAs).

CUDA graphs (sync-free only). A sync-free plan depends only on the batch size, the query
lengths and the bound `max_seq_len`. A forward at the backend's full bound
(`max_seq_len == max_context_len`, what every captured step uses) with one query length for
all requests is planned once per (batch size, query length, masked) on a wrapper of its own,
and that plan is kept: the graph's warm-up run plans it, the capture and every replay reuse
it, and the captured part (slot lists, real `kv_indptr`, the packed mask, the kernels) is all
device work. The synced plan reads exact host lengths every step, so it cannot be captured.

FlashInfer internals used (hence the exact version check): after `plan()` the wrappers'
`_paged_kv_indptr_buf` and `_mask_indptr_buf` are pointed at device tensors holding the real
offsets, and `_sm_scale` is set per forward; and the wrappers' pinned host staging buffer
is replaced by a pageable one (see `_unpin_plan_staging`).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from specserve.engine.attention.base import AttentionBackend

if TYPE_CHECKING:
    from specserve.engine.forward_batch import ForwardBatch

SUPPORTED_FLASHINFER_VERSION = "0.5.3"
WORKSPACE_BYTES = 128 * 1024 * 1024  # split-KV partial outputs; FlashInfer's recommended size
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # FA2 prefill needs head_dim >= 64 (KernelTraits::IsInvalid)
SUPPORTED_GROUP_SIZES = (1, 2, 3, 4, 8)  # the decode kernel's DISPATCH_GQA_GROUP_SIZE
KV_CACHE_DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer's FA2 kernels are 16-bit only


# ---------------------------------------------------------------------------------------------
# Device metadata (pure torch: no host reads of device values, so no synchronisation)
# ---------------------------------------------------------------------------------------------

def build_kv_indices(slot_table: torch.Tensor, table_rows: torch.Tensor,
                     prefix_lens: torch.Tensor, new_token_slots: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     num_entries: int) -> torch.Tensor:
    """Flat int32 KV slot list: entry `kv_indptr[b] + j` is token j of request b.

    Request b's tokens are its prefix, `slot_table[table_rows[b], :prefix_lens[b]]`, then its
    new tokens, `new_token_slots[qo_indptr[b]:qo_indptr[b+1]]`. `num_entries` is a host
    bound on `kv_indptr[-1]`; entries past the real end hold arbitrary slots nobody reads.
    """
    device = kv_indptr.device
    last_request = table_rows.shape[0] - 1
    pos = torch.arange(num_entries, dtype=kv_indptr.dtype, device=device)
    req = torch.searchsorted(kv_indptr[1:], pos, right=True).clamp_(max=last_request)
    j = pos - kv_indptr[req]
    prefix = prefix_lens.to(kv_indptr.dtype)[req]
    prefix_slot = slot_table[table_rows[req], j.clamp(max=slot_table.shape[1] - 1)]
    new_index = (qo_indptr[req] + j - prefix).clamp_(0, new_token_slots.shape[0] - 1)
    return torch.where(j < prefix, prefix_slot, new_token_slots[new_index]).to(torch.int32)


def pack_custom_mask(custom_mask: torch.Tensor, prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, num_bytes: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's packed custom mask for queries that see their whole prefix.

    FlashInfer reads request b's mask as a row-major [extend_b, kv_b] bit matrix
    (kv_b = prefix_b + extend_b; little-endian bits) starting at byte `mask_indptr[b]`.
    Query j sees every prefix key and new key k iff `custom_mask[b, j, k]`.
    `num_bytes` is a host bound on the packed size. Returns (packed uint8 [num_bytes + 1],
    mask_indptr int32 [bs + 1]); the extra byte absorbs writes that have nothing to fix.

    Every byte starts as all ones (prefix keys are always visible); only the bytes that hold
    some row's new-key bits are computed, bs * extend * (extend // 8 + 2) of them at most,
    so the cost does not grow with the context length.
    """
    device = custom_mask.device
    bs, max_extend = custom_mask.shape[0], custom_mask.shape[1]
    prefix = prefix_lens.to(torch.int64).view(bs, 1, 1)
    extend = extend_lens.to(torch.int64).view(bs, 1, 1)
    kv = prefix + extend
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    torch.cumsum(((extend * kv + 7) // 8).view(bs), 0, dtype=torch.int32, out=mask_indptr[1:])
    packed = torch.full((num_bytes + 1,), 0xFF, dtype=torch.uint8, device=device)

    # The bytes covering row q's new-key bits [row start + prefix, row start + kv).
    first_bit = mask_indptr[:-1].to(torch.int64).view(bs, 1, 1) * 8
    q = torch.arange(max_extend, device=device).view(1, max_extend, 1)
    first_new_bit = first_bit + q * kv + prefix
    span = max_extend // 8 + 2
    byte = first_new_bit // 8 + torch.arange(span, device=device).view(1, 1, span)
    used = (q < extend) & (byte <= (first_new_bit + extend - 1) // 8)
    byte = torch.where(used, byte, num_bytes)

    # Decode each bit of those bytes back to (query, key) of its request.
    local = byte.unsqueeze(-1) * 8 + torch.arange(8, device=device) - first_bit.unsqueeze(-1)
    row, col = local // kv.unsqueeze(-1), local % kv.unsqueeze(-1)
    new_col = col - prefix.unsqueeze(-1)
    batch = torch.arange(bs, device=device).view(bs, 1, 1, 1)
    sees_new = custom_mask[batch, row.clamp(0, max_extend - 1), new_col.clamp(0, max_extend - 1)]
    visible = (row < extend.unsqueeze(-1)) & ((new_col < 0) | sees_new)
    bit_values = torch.pow(2, torch.arange(8, dtype=torch.int32, device=device))  # no host copy: sync-free
    values = (visible.to(torch.int32) * bit_values).sum(-1).to(torch.uint8)
    # A byte shared by two rows is computed identically for both, so duplicates agree.
    packed[byte.reshape(-1)] = values.reshape(-1)
    return packed, mask_indptr


def host_offsets(lengths: list[int]) -> torch.Tensor:
    """[0, cumsum(lengths)...] as a host int32 tensor (what `plan()` reads)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Backend
# ---------------------------------------------------------------------------------------------

class FlashInferMetadata(NamedTuple):
    wrapper: Any                # the FlashInfer wrapper planned for this forward
    kv_indptr: torch.Tensor     # [bs+1] int32, real lengths (device)
    kv_indices: torch.Tensor    # int32 KV slots, prefix then new tokens per request


class FlashInferAttnBackend(AttentionBackend):
    """See the module docstring. `sync_free` selects the plan that never reads host lengths;
    `max_context_len` is the bound of the forwards that CUDA graphs capture, and
    `max_query_len` their most new tokens per request (the verify width)."""

    needs_cpu_seq_lens = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 *, sync_free: bool = False, max_context_len: Optional[int] = None,
                 max_query_len: int = 1, workspace_bytes: int = WORKSPACE_BYTES):
        import flashinfer  # ImportError when the extra is not installed

        if flashinfer.__version__ != SUPPORTED_FLASHINFER_VERSION:
            raise RuntimeError(
                f"FlashInferAttnBackend relies on FlashInfer {SUPPORTED_FLASHINFER_VERSION} "
                f"internals, found {flashinfer.__version__}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"attention_backend: flashinfer supports head_dim "
                             f"{SUPPORTED_HEAD_DIMS}, the model has {head_dim}")
        if num_heads % num_kv_heads or num_heads // num_kv_heads not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"attention_backend: flashinfer supports {SUPPORTED_GROUP_SIZES} "
                             f"query heads per KV head, the model has {num_heads}/{num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.sync_free = sync_free
        self.needs_cpu_seq_lens = not sync_free
        self.max_context_len = max_context_len
        self.max_query_len = max_query_len
        self.supports_cuda_graphs = sync_free and max_context_len is not None
        # FlashInfer wants the float workspace zeroed before first use; both wrappers share
        # it, which is safe because their kernels run in stream order.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        _unpin_plan_staging(self._decode)
        self._prefill = self._new_prefill_wrapper()
        # (batch size, query length, masked) -> a prefill wrapper planned once at the bound.
        self._kept_plans: dict[tuple[int, int, bool], Any] = {}
        self._planned: Optional[FlashInferMetadata] = None

    def _new_prefill_wrapper(self):
        import flashinfer

        # "fa2" pinned: "auto" picks FA3 on Hopper, whose plan and run read host lengths.
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
        _unpin_plan_staging(wrapper)
        return wrapper

    def _kept_plan_key(self, fb: "ForwardBatch") -> Optional[tuple[int, int, bool]]:
        """The key of a forward whose sync-free plan is kept (see the module docstring)."""
        lens = fb.extend_lens_cpu
        if not (self.supports_cuda_graphs and fb.max_seq_len == self.max_context_len
                and lens[0] <= self.max_query_len and all(n == lens[0] for n in lens)):
            return None
        return fb.batch_size, lens[0], fb.custom_mask is not None

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        bs, extend_lens = fb.batch_size, fb.extend_lens_cpu
        if fb.extend_lens is not None:  # plan() tiles the host query lengths
            raise ValueError("FlashInferAttnBackend: needs host extend lengths")
        if fb.num_tokens != sum(extend_lens):
            raise ValueError(f"{fb.num_tokens} tokens but extend_lens_cpu sums to "
                             f"{sum(extend_lens)}")
        if bs == 0:
            fb.attn_metadata = self._planned = None
            return
        if fb.max_seq_len < fb.max_extend_len:
            raise ValueError(f"max_seq_len {fb.max_seq_len} is not a bound on prefix + extend "
                             f"(max_extend_len {fb.max_extend_len}); was it set?")
        kept_key = self._kept_plan_key(fb)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and kept_key not in self._kept_plans:
            raise RuntimeError("FlashInferAttnBackend: only a sync-free forward at the "
                               "max_context_len bound, planned before the capture, can be "
                               "captured in a CUDA graph")
        kv_dtype = fb.kv_pool.k_buffer[0].dtype
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"attention_backend: flashinfer needs a float16 or bfloat16 model, "
                             f"got {kv_dtype}")
        exact_seq_lens = None if self.sync_free else fb.seq_lens_cpu

        # Device side: real lengths and slot lists.
        qo_indptr_host = host_offsets(extend_lens)
        if kept_key is not None:  # no host copy: a captured graph must not read host memory
            qo_indptr = torch.arange(0, (bs + 1) * kept_key[1], kept_key[1], dtype=torch.int32,
                                     device=self.device)
        else:
            qo_indptr = self._to_device(qo_indptr_host)
        extend = qo_indptr[1:] - qo_indptr[:-1]
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
        torch.cumsum(fb.prefix_lens.to(torch.int32) + extend, 0, dtype=torch.int32,
                     out=kv_indptr[1:])
        num_entries = sum(exact_seq_lens) if exact_seq_lens is not None else bs * fb.max_seq_len
        kv_indices = build_kv_indices(fb.kv_rows.table, fb.kv_rows.rows, fb.prefix_lens, fb.out_cache_loc,
                                      qo_indptr, kv_indptr, num_entries)

        # Host side: the plan, from exact lengths or from the bound without split-KV.
        planned_seq_lens = exact_seq_lens if exact_seq_lens is not None \
            else [fb.max_seq_len] * bs
        kv_indptr_host = host_offsets(planned_seq_lens)
        last_page_len_host = torch.ones(bs, dtype=torch.int32)  # pages of one token
        common = dict(q_data_type=kv_dtype, kv_data_type=kv_dtype)
        is_decode = fb.custom_mask is None and all(n == 1 for n in extend_lens)
        if is_decode and exact_seq_lens is not None:
            wrapper = self._decode
            wrapper.plan(kv_indptr_host, kv_indices, last_page_len_host, self.num_heads,
                         self.num_kv_heads, self.head_dim, 1, **common)
        else:
            packed_mask = mask_indptr = None
            if fb.custom_mask is not None:
                num_bytes = sum((e * s + 7) // 8 for e, s in zip(extend_lens, planned_seq_lens))
                packed_mask, mask_indptr = pack_custom_mask(fb.custom_mask, fb.prefix_lens,
                                                            extend, num_bytes)
            wrapper = self._kept_plans.get(kept_key) if kept_key is not None else None
            if wrapper is None:
                wrapper = self._prefill if kept_key is None else self._new_prefill_wrapper()
                wrapper.plan(qo_indptr_host, kv_indptr_host, kv_indices, last_page_len_host,
                             self.num_heads, self.num_kv_heads, self.head_dim, 1,
                             packed_custom_mask=packed_mask, causal=packed_mask is None,
                             disable_split_kv=exact_seq_lens is None, **common)
                if kept_key is not None:
                    self._kept_plans[kept_key] = wrapper
            if packed_mask is not None:
                # plan() derives bit offsets from the host (planned) lengths; the kernel
                # reads byte offsets of the real ones. A kept plan saw another forward's mask.
                wrapper._custom_mask_buf, wrapper._mask_indptr_buf = packed_mask, mask_indptr
        wrapper._paged_kv_indptr_buf = kv_indptr  # the real lengths, whatever plan() saw
        wrapper._paged_kv_indices_buf = kv_indices  # a kept plan saw another forward's slots
        fb.attn_metadata = self._planned = FlashInferMetadata(
            wrapper, kv_indptr, kv_indices)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # From pinned memory, so the copy is asynchronous and its source stays valid until
        # it ran (the caching host allocator tracks it).
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: "ForwardBatch", scale: float) -> torch.Tensor:
        if k is not None:
            fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        metadata: Optional[FlashInferMetadata] = fb.attn_metadata
        if metadata is None:  # empty batch
            return q.new_empty(0, self.num_heads * self.head_dim)
        if metadata is not self._planned:
            # The wrappers hold one plan: another batch was planned since this one.
            raise RuntimeError("FlashInferAttnBackend: forward of a batch whose plan was "
                               "replaced; call init_forward_metadata right before forward")
        # Pool buffers [slots, KV heads, D] viewed as pages of one token: [slots, 1, H, D].
        k_cache = fb.kv_pool.k_buffer[layer_id].unsqueeze(1)
        v_cache = fb.kv_pool.v_buffer[layer_id].unsqueeze(1)
        metadata.wrapper._sm_scale = scale
        out = metadata.wrapper.run(q.contiguous(), (k_cache, v_cache))
        return out.view(q.shape[0], self.num_heads * self.head_dim)


def _unpin_plan_staging(wrapper) -> None:
    """Make `plan()` safe to call while earlier plans' copies are still queued.

    `plan()` writes its schedule into the wrapper's page-locked host buffer and copies it to
    the device with a raw cudaMemcpyAsync. The overlap scheduler plans forward N+1 while
    forward N is still queued, so the host would overwrite the buffer before N's copy ran.
    A pageable source is staged by the driver before cudaMemcpyAsync returns, so the buffer
    can be rewritten at once; the copy stays ordered on the stream.
    """
    staging = wrapper._pin_memory_int_workspace_buffer
    wrapper._pin_memory_int_workspace_buffer = torch.empty(staging.shape, dtype=staging.dtype)
