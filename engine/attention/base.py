"""The attention backend seam.

Every forward is described the same way: request b of the batch has `prefix_lens[b]` tokens
already in the KV pool and adds `extend_lens_cpu[b]` new tokens (1 for decode, the draft
width for verify and draft-extend, the chunk for prefill). New token j of request b sees
every prefix token and the new tokens k <= j, or, when `custom_mask` is given (tree
verify), the new tokens k with `custom_mask[b, j, k]`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from specserve.engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Paged attention over the KV pool (page size 1).

    `needs_cpu_seq_lens` says whether `init_forward_metadata` reads host sequence lengths
    (`ForwardBatch.seq_lens_cpu`). A backend that sets it False builds its metadata on the
    device from upper bounds, so the scheduler can skip the host sync that produces them.
    """

    needs_cpu_seq_lens: bool = True
    supports_cuda_graphs: bool = False  # metadata built by device ops from static buffers
    # Reads `ForwardBatch.extend_lens` (device lengths under host bounds): captured extends.
    supports_device_extend_lens: bool = False
    # Runs a mixed forward (runtime/mixed_step.py): ragged new-token counts over device prefix
    # lengths, with a [bs, max_extend, max_extend] custom mask when a tree verify rides along.
    supports_mixed_forward: bool = False
    # Set up by `preallocate_verify_mask`: verify's tree mask, filled in place after drafting.
    verify_custom_mask: Optional[torch.Tensor] = None

    def preallocate_verify_mask(self, max_batch_size: int, num_draft_tokens: int,
                                device: torch.device) -> None:
        """A [max_batch_size, D, D] bool buffer that speculative verify fills in place (the
        MLA contract: metadata from preallocated buffers, no host lengths, graph-stable)."""
        self.verify_custom_mask = torch.zeros((max_batch_size, num_draft_tokens, num_draft_tokens),
                                              dtype=torch.bool, device=device)

    def get_verify_buffers_to_fill_after_draft(self) -> list[Optional[torch.Tensor]]:
        """[custom_mask, None]: buffers verify fills in place after drafting (None: build new)."""
        return [self.verify_custom_mask, None]

    @abstractmethod
    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        """Prepare per-forward metadata. This is the forward's only read of `fb.kv_rows`; the
        scheduler may rewrite the request table once it returns (write-after-read barrier)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: "ForwardBatch", scale: float) -> torch.Tensor:
        """Store k, v at `fb.out_cache_loc` in layer `layer_id`'s pool, then attend.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim], or
        both None when the caller already stored them there (the fused RoPE kernel does; MLA
        layers store latent || rope themselves). Returns [num_tokens, num_heads * v_head_dim]
        where v_head_dim is the pool's `v_buffer` width (head_dim except for MLA).
        """


def decide_needs_cpu_seq_lens(backends, force: Optional[bool] = None) -> bool:
    """OR of `needs_cpu_seq_lens` over every backend a forward touches.

    `None` entries (e.g. no draft model) are skipped; a backend without the attribute is
    assumed to need host lengths; `force=True` (a mode that reads host lengths, or the
    user's override) wins.
    """
    if force:
        return True
    return any(getattr(b, "needs_cpu_seq_lens", True) for b in backends if b is not None)
