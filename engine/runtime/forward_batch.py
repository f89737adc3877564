"""ForwardBatch: one forward's view of a batch (built by the scheduler or the spec worker)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from specserve.engine.attention.base import AttentionBackend
    from specserve.engine.kvcache.pools import ReqToTokenPool, TokenToKVPool


class ForwardMode(enum.Enum):
    EXTEND = enum.auto()         # prefill, possibly after a cached prefix (chunked prefill)
    DECODE = enum.auto()         # one new token per request
    IDLE = enum.auto()           # an empty batch (backends must accept it)
    TARGET_VERIFY = enum.auto()  # num_draft_tokens per request, tree mask
    DRAFT_EXTEND = enum.auto()   # fixed width num_draft_tokens per request, causal


@dataclass
class ForwardBatch:
    """Inputs of one model forward. Tensors live on the model's device unless named *_cpu.

    `prefix_lens` is the KV length before this forward, `extend_lens_cpu` the number of new
    tokens per request (always host-known), so `seq_lens = prefix_lens + extend_lens`.
    `seq_lens_cpu` is the exact host mirror of `seq_lens` or None on the GPU-only path;
    `max_seq_len` is then an upper bound.
    """

    mode: ForwardMode
    input_ids: torch.Tensor          # [num_tokens] int64
    positions: torch.Tensor          # [num_tokens] int64
    req_pool_indices: torch.Tensor   # [bs] int64
    prefix_lens: torch.Tensor        # [bs] int64
    extend_lens_cpu: list[int]       # [bs]
    out_cache_loc: torch.Tensor      # [num_tokens] int64 KV slots the new tokens are written to
    req_to_token: "ReqToTokenPool"
    kv_pool: "TokenToKVPool"
    attn_backend: "AttentionBackend"
    seq_lens_cpu: Optional[list[int]] = None
    max_seq_len: int = 0             # exact max(seq_lens) when seq_lens_cpu is known, else a bound
    custom_mask: Optional[torch.Tensor] = None  # [bs, max_extend, max_extend] bool (tree verify)
    # Per-request KV slot rows that replace req_to_token rows (tree drafting): [bs, width];
    # the first prefix_lens[b] entries are the prefix, then the new tokens' slots.
    kv_indices_override: Optional[torch.Tensor] = None
    capture_aux_hidden: bool = False  # EAGLE-3: also return the target's auxiliary layers
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
