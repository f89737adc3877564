"""RMSNorm computed in fp32, as Hugging Face does, so fp32 logits match it exactly."""
from __future__ import annotations

import torch
from torch import nn

from specserve.engine.layers.fused_loader import fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, returns (norm(x + residual), x + residual): the pre-norm block form."""
        if x.is_cuda and fused is not None:
            return fused.add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
