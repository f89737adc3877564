"""ForwardBatch: one forward's view of a batch (built by the workers), and where its KV is.

This module sits below the attention backends, the models and the workers, all of which read
it; it imports none of them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Protocol

import torch

from specserve.engine.aranges import arange

if TYPE_CHECKING:
    from specserve.engine.kvcache.pools import TokenToKVPool


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()         # prefill, possibly after a cached prefix (chunked prefill)
    DECODE = enum.auto()         # one new token per request
    TARGET_VERIFY = enum.auto()  # num_draft_tokens per request, tree mask
    DRAFT_EXTEND = enum.auto()   # fixed width num_draft_tokens per request, causal
    # Decode (or verify) rows and prefill chunks in one target forward (runtime/mixed_step.py)
    MIXED = enum.auto()


class KVRows(NamedTuple):
    """Where each request's KV slots are: request b's token j is in slot `table[rows[b], j]`.

    The one layout every attention backend reads. The scheduler's `req_to_token` pool with
    the batch's pool rows, or a snapshot of those rows or per-branch rows built by
    tree drafting, addressed by batch index (`by_batch_index`).
    """

    table: torch.Tensor   # [num_rows, width] int64 KV slots
    rows: torch.Tensor    # [bs] int64 row of each request

    @staticmethod
    def by_batch_index(table: torch.Tensor) -> "KVRows":
        return KVRows(table, arange(table.shape[0], table.device))

    def padded(self, width: int) -> torch.Tensor:
        """[bs, width] slots of every request's first `width` tokens (past a request's end:
        whatever the row holds, masked by the caller)."""
        return self.table[self.rows, :width]


class Attention(Protocol):
    """What the model layers call (an `attention.AttentionBackend`, set by the ModelRunner)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: "ForwardBatch", scale: float) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """Inputs of one model forward. Tensors live on the model's device unless named *_cpu.

    `prefix_lens` is the KV length before this forward, `extend_lens_cpu` the number of new
    tokens per request, so `seq_lens = prefix_lens + extend_lens`. A captured extend
    (runtime/captured_extend.py) knows them only on the device (`extend_lens`, summing to
    `num_tokens`); `extend_lens_cpu` then holds the bucket's bound on each, what the
    attention's grid is sized by (backends with `supports_device_extend_lens`).
    `seq_lens_cpu` is the exact host mirror of `seq_lens` or None on the GPU-only path;
    `max_seq_len` is then an upper bound. The new tokens' slots are both `out_cache_loc` and
    the entries of `kv_rows` after each prefix.
    """

    mode: ForwardMode
    input_ids: torch.Tensor          # [num_tokens] int64
    positions: torch.Tensor          # [num_tokens] int64
    kv_rows: KVRows
    prefix_lens: torch.Tensor        # [bs] int64
    extend_lens_cpu: list[int]       # [bs]
    out_cache_loc: torch.Tensor      # [num_tokens] int64 KV slots the new tokens are written to
    seq_lens_cpu: Optional[list[int]] = None
    max_seq_len: int = 0             # exact max(seq_lens) when seq_lens_cpu is known, else a bound
    custom_mask: Optional[torch.Tensor] = None  # [bs, max_extend, max_extend] bool (tree verify)
    extend_lens: Optional[torch.Tensor] = None  # [bs] int64, device lengths (see above)
    # EAGLE-3: target layers whose outputs the forward also returns (the head's features)
    aux_hidden_layers: tuple[int, ...] = ()
    # Set by the ModelRunner that runs the forward:
    kv_pool: Optional["TokenToKVPool"] = None
    attn_backend: Optional[Attention] = None
    attn_metadata: Any = None         # owned by the attention backend

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens_cpu) if self.extend_lens_cpu else 0
