"""KV cache memory: the request-to-token table, per-layer K/V buffers, and the slot allocator.

Two levels, as in SGLang: `ReqToTokenPool.table[r, i]` is the KV slot holding token i of the
request in row r; `TokenToKVPool` owns the K/V data of every slot. Row 0 of the table and
slot 0 of the pool are reserved: padded batch rows point at them, so `-req_pool_idx` is
always a valid negative sentinel and padded tokens write somewhere harmless.

A pool's dtype may be FP8 (`kvcache/fp8.py`): it then stores K and V divided by its per-layer
`scales`, which its readers multiply back; other pools have scales of 1.0.
"""
from __future__ import annotations

from typing import Optional

import torch

from specserve.engine.kvcache.fp8 import KVScales, to_pool


class ReqToTokenPool:
    """Rows of KV slot indices, one per running request; row 0 is the padding row."""

    def __init__(self, num_rows: int, row_width: int, device: torch.device):
        self.num_rows = num_rows
        self.row_width = row_width
        self.table = torch.zeros((num_rows + 1, row_width), dtype=torch.int64, device=device)
        self._free_rows = list(range(num_rows, 0, -1))  # pop() hands out low rows first

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise RuntimeError("ReqToTokenPool: no free row")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        assert 0 < row <= self.num_rows and row not in self._free_rows, row
        self._free_rows.append(row)


class TokenToKVPool:
    """Per-layer K and V buffers indexed by slot; slot 0 is the dummy that padding writes."""

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, scales: Optional[KVScales] = None):
        self.num_slots = num_slots
        self.scales = scales or KVScales.ones(num_layers)
        assert self.scales.num_layers == num_layers, (self.scales.num_layers, num_layers)
        # One tensor per K and V with the layer first: each layer's buffer is a contiguous view,
        # and an all-layer move is one indexed copy instead of one per layer.
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k_buffer = list(self.k_all.unbind(0))
        self.v_buffer = list(self.v_all.unbind(0))

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        dtype = self.k_all.dtype
        self.k_buffer[layer_id][loc] = to_pool(k, dtype, self.scales.k[layer_id])
        self.v_buffer[layer_id][loc] = to_pool(v, dtype, self.scales.v[layer_id])

    def move_kv_cache(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the K/V of slots `src` to slots `tgt` in every layer (tree compaction): the
        sources are gathered before anything is written, so overlapping moves are safe. The
        stored values move as they are (FP8 included: the scales are per layer, not per slot)."""
        self.k_all[:, tgt] = self.k_all[:, src]
        self.v_all[:, tgt] = self.v_all[:, src]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class MLATokenToKVPool:
    """Multi-head latent attention's KV: per slot and layer one vector, latent || rope key.

    Attention reads it as one KV head whose key is the whole vector and whose value is the
    latent: `v_buffer[layer]` is a strided view of `k_buffer[layer]`'s first `kv_lora_rank`
    dims (no copy), so backends read V through its own strides. Being the same bytes, K and V
    have one scale per layer when the pool is FP8: `scales.k`, which `scales.v` repeats.
    """

    def __init__(self, num_slots: int, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype: torch.dtype, device: torch.device, scales: Optional[KVScales] = None):
        self.num_slots = num_slots
        k_scales = (scales or KVScales.ones(num_layers)).k
        assert len(k_scales) == num_layers, (len(k_scales), num_layers)
        self.scales = KVScales(k_scales, k_scales)
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank
        self.kv_all = torch.zeros((num_layers, num_slots + 1, 1, kv_lora_rank + qk_rope_head_dim),
                                  dtype=dtype, device=device)
        self.k_buffer = list(self.kv_all.unbind(0))
        self.v_buffer = [k[..., :kv_lora_rank] for k in self.k_buffer]

    def set_mla_kv(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor,
                   k_rope: torch.Tensor) -> None:
        """Store the new tokens' latent [T, kv_lora_rank] and rotated rope key [T, rope]."""
        buf, scale = self.k_buffer[layer_id], self.scales.k[layer_id]
        buf[loc, 0, :self.kv_lora_rank] = to_pool(latent, buf.dtype, scale)
        buf[loc, 0, self.kv_lora_rank:] = to_pool(k_rope, buf.dtype, scale)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The backend-facing form: k [T, 1, latent + rope] is the whole vector; v (the
        latent, k's prefix) is stored with it."""
        self.k_buffer[layer_id][loc] = to_pool(k, self.kv_all.dtype, self.scales.k[layer_id])

    def move_kv_cache(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """Tree compaction: slots `src` to slots `tgt` in every layer, one indexed copy; the
        sources are gathered before anything is written, so overlapping moves are safe."""
        if self.num_layers == 0:
            return
        self.kv_all[:, tgt] = self.kv_all[:, src]

    @staticmethod
    def bytes_per_slot(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * (kv_lora_rank + qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()


class TokenSlotAllocator:
    """Free KV slots kept as a device tensor: alloc and free never read device memory.

    The host only tracks how many slots are free; which slots they are stays on the device.
    Frees are queued and merged at the next alloc so that a step's frees cost one `cat`.
    """

    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64, device=device)
        self._pending: list[torch.Tensor] = []
        self._num_pending = 0

    @property
    def num_free(self) -> int:
        return self._free.shape[0] + self._num_pending

    def alloc(self, n: int) -> torch.Tensor:
        if n > self.num_free:
            raise RuntimeError(f"TokenSlotAllocator: {n} slots wanted, {self.num_free} free")
        if n > self._free.shape[0]:
            self._merge_pending()
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._pending.append(slots)
            self._num_pending += slots.shape[0]

    def _merge_pending(self) -> None:
        self._free = torch.cat([self._free, *self._pending])
        self._pending.clear()
        self._num_pending = 0
