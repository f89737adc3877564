"""KV cache memory: the request-to-token table, per-layer K/V buffers, and the slot allocator.

Two levels, as in SGLang: `ReqToTokenPool.table[r, i]` is the KV slot holding token i of the
request in row r; `TokenToKVPool` owns the K/V data of every slot. Row 0 of the table and
slot 0 of the pool are reserved: padded batch rows point at them, so `-req_pool_idx` is
always a valid negative sentinel and padded tokens write somewhere harmless.
"""
from __future__ import annotations

import torch


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
                 dtype: torch.dtype, device: torch.device):
        self.num_slots = num_slots
        # One tensor per K and V with the layer first: each layer's buffer is a contiguous view,
        # and an all-layer move is one indexed copy instead of one per layer.
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k_buffer = list(self.k_all.unbind(0))
        self.v_buffer = list(self.v_all.unbind(0))

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = k.to(self.k_buffer[layer_id].dtype)
        self.v_buffer[layer_id][loc] = v.to(self.v_buffer[layer_id].dtype)

    def move_kv_cache(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the K/V of slots `src` to slots `tgt` in every layer (tree compaction): the
        sources are gathered before anything is written, so overlapping moves are safe."""
        self.k_all[:, tgt] = self.k_all[:, src]
        self.v_all[:, tgt] = self.v_all[:, src]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


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
