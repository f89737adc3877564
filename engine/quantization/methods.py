"""Which `LinearMethod` (layers/linear_method.py) a linear layer takes: its format's, from the
scheme served (the checkpoint's `quantization_config`, or online FP8) and what the checkpoint
stores for the layer's parts; None keeps it 16-bit."""
from __future__ import annotations

from typing import Optional

from torch import nn

from specserve.engine.layers.linear_method import LinearMethod, PartSlice
from specserve.engine.layers.parallel import ParallelLMHead
from specserve.engine.quantization.config import Int4Config, OnlineFp8Config, Scheme
from specserve.engine.quantization.fp8 import fp8_method_for, online_fp8_method
from specserve.engine.quantization.int4 import int4_method_for


def linear_method_for(scheme: Optional[Scheme], reader, parts: list[PartSlice], what: str,
                      layer: nn.Module) -> Optional[LinearMethod]:
    """INT4 where the scheme is INT4 and the checkpoint has the parts' `qweight`s; FP8 where
    the parts' weights are float8 (refused without an FP8 scheme); with online FP8 every
    16-bit layer (the LM head only with `lm_head`); else None (missing tensors are reported
    by the generic loader)."""
    if isinstance(scheme, Int4Config):
        method = int4_method_for(scheme, reader, parts, what)
        if method is not None:
            return method
    if not all(p.key in reader for p in parts):
        return None  # (a tied LM head's weight is the embedding's: it stays 16-bit)
    method = fp8_method_for(scheme, reader, parts, what)
    if method is None and isinstance(scheme, OnlineFp8Config) and (
            scheme.lm_head or not isinstance(layer, ParallelLMHead)):
        return online_fp8_method(layer)
    return method
