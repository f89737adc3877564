"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F


from specserve.engine.layers.fused_loader import fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [.., 2 * I] gate/up projection."""
    if gate_up.is_cuda and fused is not None:
        return fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
