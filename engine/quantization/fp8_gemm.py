"""FP8-weight matrix products outside the skinny GEMM's range (prefill, large batches, the CPU).

The CPU path dequantises the weight and runs F.linear in the activation dtype (exactly
`fp8_linear_reference`)."""
from __future__ import annotations

from typing import Optional

import torch

from specserve.engine.quantization.fp8 import WeightScale, fp8_linear_reference


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: WeightScale,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T (+ bias) in x's dtype."""
    return fp8_linear_reference(x, weight, scale, bias)
