"""The KV pool's size from the engine's share of a device (EngineConfig.gpu_memory_utilization).

An engine may take `fraction` of the device's total memory in all: what it holds once its
weights are loaded (PyTorch's reserved memory, plus an estimate of what CUDA holds outside
PyTorch), a reserve for what it allocates later besides the pool (eager forwards' activations,
the CUDA graphs' shared pool, small tables), and the KV pool, which gets the remainder. Sizing
by the device's total, not by its free memory, is what lets several engines share one GPU: each
takes its own share whatever the others have taken so far (as vLLM's --gpu-memory-utilization).
Pure arithmetic, so that it is tested without a GPU; builder.py measures the inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30
# What a CUDA process holds outside PyTorch's allocator: its context, loaded kernel modules
# (cuBLAS, Triton), NCCL's buffers under tensor parallelism. Another process on the same device
# makes it impossible to measure per process from the free memory, so it is estimated.
NON_TORCH_BYTES = 1 * GiB
# Buffers built after the pool besides the forwards' transients: the penalty table, the
# attention backends' split buffers, the FutureMap, the grammar channel.
TABLES_BYTES = 512 * MiB
FLOAT32_BYTES = 4
# Per KV slot besides its K and V: the allocator's free list (int64) and the copy a merge of
# freed slots makes; a small model's slot is a few hundred bytes, so it counts.
SLOT_INDEX_BYTES = 16


def forward_workspace_bytes(tokens: int, logit_rows: int, hidden_size: int,
                            intermediate_size: int, vocab_size: int, act_bytes: int) -> int:
    """An estimate of one forward's transient memory: per token the residual stream, the
    normed input, the attention's input and output (4 x hidden) and the MLP's gate, up and
    activation (3 x intermediate, this rank's share); float32 logits of `logit_rows` rows and
    their log-softmax."""
    per_token = (4 * hidden_size + 3 * intermediate_size) * act_bytes
    return tokens * per_token + 2 * logit_rows * vocab_size * FLOAT32_BYTES


@dataclass(frozen=True)
class MemoryShare:
    """What sizes the pool, in bytes: the device's `total` and `free` memory and the engine's
    `fraction` of the total; `held`: what the engine holds now (weights and their buffers,
    PyTorch's reserve, CUDA's own); `reserve`: what it will allocate besides the pool."""

    total: int
    free: int
    fraction: float
    held: int
    reserve: int

    @property
    def budget(self) -> int:
        return int(self.total * self.fraction)

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.held - self.reserve

    def describe(self) -> str:
        return (f"gpu_memory_utilization {self.fraction:g} of {self.total / GiB:.1f} GiB is "
                f"{self.budget / GiB:.2f} GiB; the engine holds {self.held / GiB:.2f} GiB "
                f"(weights, CUDA context) and reserves {self.reserve / GiB:.2f} GiB "
                f"(activations, CUDA graphs, tables)")


def kv_pool_slots(share: MemoryShare, bytes_per_slot: int, min_slots: int) -> int:
    """KV slots of `bytes_per_slot` that the share leaves. ValueError naming the field when
    fewer than `min_slots` (one request's least) fit, or when the device's free memory cannot
    hold the pool and the reserve (other processes hold more than the rest of the device)."""
    slots = max(0, share.kv_bytes) // bytes_per_slot
    if slots < min_slots:
        raise ValueError(
            f"gpu_memory_utilization (--gpu-memory-utilization): {share.describe()}, which "
            f"leaves {max(0, share.kv_bytes) / GiB:.2f} GiB for the KV pool: {slots} slots of "
            f"{bytes_per_slot} bytes, fewer than one request needs ({min_slots}); give a "
            f"larger share")
    needed = slots * bytes_per_slot + share.reserve
    if needed > share.free:
        raise ValueError(
            f"gpu_memory_utilization (--gpu-memory-utilization): {share.describe()}; the KV "
            f"pool ({slots * bytes_per_slot / GiB:.2f} GiB) and the reserve need "
            f"{needed / GiB:.2f} GiB, but only {share.free / GiB:.2f} GiB of the device are "
            f"free (other processes hold the rest); give a smaller share")
    return slots
