"""ModelRunner: one model on one device with its KV pool and attention backend."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from specserve.engine.attention.base import AttentionBackend
from specserve.engine.kvcache.pools import TokenToKVPool
from specserve.engine.runtime.forward_batch import ForwardBatch


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def create_attention_backend(name: str, device: torch.device, *, num_heads: int, num_kv_heads: int,
                             head_dim: int, max_context_len: int, max_batch_size: int,
                             needs_cpu_seq_lens: Optional[bool]) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from specserve.engine.attention.torch_native import TorchNativeAttnBackend
        return TorchNativeAttnBackend(needs_cpu_seq_lens=bool(needs_cpu_seq_lens))
    if name == "triton":
        try:
            from specserve.engine.attention.triton.backend import TritonAttnBackend
        except ImportError as e:
            raise ValueError(f"attention_backend: triton is not available ({e}); "
                             "install specserve[triton] or use 'torch'") from e
        backend = TritonAttnBackend(num_heads, num_kv_heads, head_dim, max_context_len, device,
                                    max_batch_size=max_batch_size)
        if needs_cpu_seq_lens:
            backend.needs_cpu_seq_lens = True
        return backend
    if name == "flashinfer":
        from specserve.engine.attention.flashinfer import FlashInferAttnBackend
        try:
            # needs_cpu_seq_lens=False opts into the plan that never reads host lengths; None
            # keeps FlashInfer's default, planning on exact host lengths (split-KV).
            return FlashInferAttnBackend(num_heads, num_kv_heads, head_dim, device,
                                         sync_free=needs_cpu_seq_lens is False)
        except ImportError as e:
            raise ValueError("attention_backend: flashinfer needs "
                             "`pip install specserve[flashinfer]` (flashinfer-python 0.5.3; "
                             f"importing it failed: {e})") from e
    raise ValueError(f"attention_backend: unknown backend {name!r}")


class ModelRunner:
    """Runs forwards of `model` over `kv_pool`; every call happens on the forward stream."""

    def __init__(self, model: nn.Module, kv_pool: TokenToKVPool, attn_backend: AttentionBackend):
        self.model = model
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend

    def forward(self, fb: ForwardBatch, *model_args, read_done=None):
        """Run the model; records `read_done` once nothing more reads `req_to_token`."""
        fb.attn_backend = self.attn_backend
        fb.kv_pool = self.kv_pool
        self.attn_backend.init_forward_metadata(fb)
        if read_done is not None:
            read_done.record()
        return self.model(fb, *model_args)
