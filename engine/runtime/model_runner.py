"""ModelRunner: one model on one device with its KV pool and attention backend."""
from __future__ import annotations

from torch import nn

from specserve.engine.attention.base import AttentionBackend
from specserve.engine.forward_batch import ForwardBatch
from specserve.engine.kvcache.pools import TokenToKVPool


class ModelRunner:
    """Runs forwards of `model` over `kv_pool`; every call happens on the forward stream."""

    def __init__(self, model: nn.Module, kv_pool: TokenToKVPool, attn_backend: AttentionBackend):
        self.model = model
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend

    def forward(self, fb: ForwardBatch, *model_args, read_done=None):
        """Run the model; records `read_done` once nothing more reads the request table."""
        fb.attn_backend = self.attn_backend
        fb.kv_pool = self.kv_pool
        self.attn_backend.init_forward_metadata(fb)
        if read_done is not None:
            read_done.record()
        return self.model(fb, *model_args)

    def store_kv(self, fb: ForwardBatch, *model_args) -> None:
        """Only the new tokens' K/V into the pool (the model's `store_kv`): nothing reads the
        pool, so no attention metadata is built."""
        fb.attn_backend = self.attn_backend
        fb.kv_pool = self.kv_pool
        self.model.store_kv(fb, *model_args)
