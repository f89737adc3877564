"""Packed token bitmasks (xgrammar's layout: int32 words, bit t % 32 of word t // 32 set when
token t is allowed) applied to logits on the device."""
from __future__ import annotations

from typing import Optional

import torch

from specserve.engine.aranges import arange


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] packed int32 -> [N, vocab_size] bool."""
    bits = (bitmask.unsqueeze(-1) >> arange(32, bitmask.device).to(torch.int32)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


# What apply_token_bitmask allocates per logit at most: the unpacked bits (two int32
# temporaries); then the bool masks and the masked float32 copy (6 bytes).
BITMASK_BYTES_PER_LOGIT = 8


def bitmask_workspace_bytes(rows: int, vocab_size: int) -> int:
    """A bound on the bytes apply_token_bitmask allocates to mask `rows` rows of logits: per
    bit of the packed words (the vocabulary rounded up to 32), and the 32 bit positions."""
    return (rows * bitmask_width(vocab_size) * 32 + 32) * BITMASK_BYTES_PER_LOGIT


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """-inf on every logit whose token the bitmask disallows. `token_ids` maps logit columns to
    token ids when the logits cover a subset of the vocabulary (an EAGLE-3 draft's hot tokens);
    the bitmask is over the full vocabulary either way.

    Applied before the sampler's rules: -inf stays -inf through penalties, logit_bias and the
    min_new_tokens ban, so masking first equals masking last."""
    if token_ids is None:
        allowed = allowed_tokens(bitmask, logits.shape[-1])
    else:
        allowed = allowed_tokens(bitmask, int(bitmask.shape[1]) * 32)[:, token_ids]
        # A draft vocabulary may hold none of the allowed tokens: that row stays unmasked (its
        # drafts are refused by the verify) rather than all -inf, whose softmax is NaN.
        allowed = allowed | ~allowed.any(dim=1, keepdim=True)
    return logits.masked_fill(~allowed, float("-inf"))
